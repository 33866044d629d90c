"""Reading a module class's code, for the rules that find a kernel's site in any model whose code
has its shape instead of in a list of classes (``linear_acts``: a linear and its activation;
``gated_mlps``: a gated MLP written otherwise than LLaMA's).

A rule reads the class's methods as an instance runs them (:func:`run_methods`: each name's first
definition along the MRO, and the overridden one too where it calls ``super()``) and holds the
attributes it patches to one use each (:func:`touched_once`): a patch that changes what
``self.fc1`` or ``self.act`` compute is exact only where the site is the one place that touches
them.  Code that cannot be read (a class built at run time) gives no site.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from functools import lru_cache
from typing import Any

from torch import nn

from coda_agent.syntax import parse


def tree(fn: Any) -> ast.FunctionDef | None:
    """The AST of one function, from its source; None where it cannot be read."""
    try:
        node = parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


@lru_cache(maxsize=None)
def run_methods(cls: type) -> tuple[ast.FunctionDef, ...]:
    """The methods an instance of ``cls`` may run, from its classes' sources (``__init__`` aside:
    it assigns the attributes, it does not run them)."""
    chosen: list[ast.FunctionDef] = []
    reaches: dict[str, bool] = {}  # name -> whether the definitions chosen so far reach the next one
    for k in cls.__mro__:
        if k in (nn.Module, object):
            continue
        for f in _methods(k):
            if reaches.get(f.name, True):
                chosen.append(f)
                reaches[f.name] = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                                      and n.func.id == "super" for n in ast.walk(f))
    return tuple(chosen)


def _methods(cls: type) -> list[ast.FunctionDef]:
    if cls.__module__ in ("builtins", "torch.nn.modules.module"):
        return []
    try:
        node = parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return []
    return [f for f in getattr(node, "body", []) if isinstance(f, ast.FunctionDef) and f.name != "__init__"]


@lru_cache(maxsize=None)
def _uses(cls: type) -> tuple[dict[str, int], frozenset[str]] | None:
    """({name: how often ``self.<name>`` is read, assigned or deleted outside ``__init__``}, the
    string constants of those methods, where ``getattr(self, "name")`` would name one); None where
    the forward's code or the class's cannot be read."""
    if tree(cls.forward) is None or not run_methods(cls):
        return None
    uses: dict[str, int] = {}
    strings: set[str] = set()
    for f in run_methods(cls):
        for n in ast.walk(f):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                uses[n.attr] = uses.get(n.attr, 0) + 1
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                strings.add(n.value)
    return uses, frozenset(strings)


def touched_once(cls: type, names: tuple[str, ...]) -> bool:
    """Whether the code of ``cls`` that runs touches each ``self.<name>`` exactly once and never
    names one as a string; False where the code cannot be read."""
    read = _uses(cls)
    if read is None:
        return False
    uses, strings = read
    return all(uses.get(n) == 1 and n not in strings for n in names)


def self_call(node: ast.AST | None) -> tuple[str, ast.expr] | None:
    """(attribute, argument) for ``self.<attribute>(argument)``, one positional argument and no
    keywords; else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self" and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return node.func.attr, node.args[0]
    return None


def assigned(stmt: ast.stmt) -> tuple[str, ast.expr] | None:
    """(name, value) for ``name = value``; else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id, stmt.value
    return None


def returned_expression(fn: ast.FunctionDef) -> ast.expr | None:
    """What a forward written as ``t = ...`` assignments and one ``return`` returns, each
    temporary substituted where it is read: the expression of its arguments.  A name may be
    assigned again (``x = self.fc(x); x = self.act(x)``), but each value assigned must be read
    exactly once before the next assignment or the return, so no substitution repeats or drops a
    computation.  None for any other body (a branch, a loop, a value read twice or never)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # docstring
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    env: dict[str, ast.expr] = {}  # each temporary's current value, substituted
    unread: set[str] = set()
    for stmt in body:
        target = None
        if isinstance(stmt, ast.Return):
            value = stmt.value
        elif (a := assigned(stmt)) is not None:
            target, value = a
        else:
            return None
        for n in ast.walk(value):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in env:
                if n.id not in unread:  # a value read twice
                    return None
                unread.discard(n.id)
        expr = _substitute(value, env)
        if target is None:
            return None if unread else expr
        if target in unread:  # a value overwritten unread
            return None
        env[target] = expr
        unread.add(target)
    return None


def forward_expression(cls: type) -> tuple[ast.expr, str] | None:
    """(what ``cls.forward`` returns, :func:`returned_expression`, the name of its one argument)
    for a forward of one argument besides ``self``; else None."""
    fn = tree(cls.forward)
    if fn is None or len(fn.args.args) != 2 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs:
        return None
    expr = returned_expression(fn)
    return None if expr is None else (expr, fn.args.args[1].arg)


class _Inline(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.expr]):
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.env.get(node.id, node) if isinstance(node.ctx, ast.Load) else node


def _substitute(expr: ast.expr, env: dict[str, ast.expr]) -> ast.expr:
    return _Inline(env).visit(copy.deepcopy(expr))
