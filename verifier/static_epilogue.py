"""The static stage's rule for epilogue bodies (:func:`check_epilogues`, which
:func:`.static.check_source` calls with its checker, whose name bindings it reads).

An @epilogue fn is evaluated by both lowerings: by the reference lowering on PyTorch tensors
(whole tiles, or whole vectors in a ``vector_pass``) and by the cute lowering on the values of
one element of the compiled kernel, which have no attributes, items, length, text or truth
value.  A body that reads any of those computes one thing on the CPU and another on the GPU,
or reads the data it is given on the host.  So the body of an epilogue fn, and of every
program function it calls, is arithmetic, comparisons and calls (of the catalogue's epilogue
math, ``math`` or such functions) on names and numbers; the result is a dict display.  The
reference stage's audit (:class:`.program.TorchAudit`) holds the same line at run time for
whatever reaches a tensor.
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from coda_agent.program_rules import static_allow_list
from coda_agent.verifier.static import LOCAL, Binding, Violation, _bound_in

ALLOWED = static_allow_list()


def check_epilogues(checker: Any, tree: ast.Module) -> None:
    """Flag, per statement, the first thing in an epilogue body that is no epilogue math
    (module docstring), following the program functions the body calls."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    todo = [(fn, fn.name) for fn in defs.values() if any(_is_epilogue(checker, d) for d in fn.decorator_list)]
    seen: set[str] = set()
    while todo:
        fn, via = todo.pop()
        if fn.name in seen:
            continue
        seen.add(fn.name)
        who = "an @epilogue fn" if fn.name == via else f"`{fn.name}`, which the @epilogue fn `{via}` calls"
        body = fn.body[1:] if fn.body and _docstring(fn.body[0]) else fn.body
        local = _bound_in(fn).names  # its parameters and locals: values, whatever a module name says

        def resolve(name: str) -> Binding | None:
            return LOCAL if name in local else checker.module.get(name)

        for stmt in body:
            whys = [(node, why) for node in ast.walk(stmt) if (why := _not_epilogue_math(resolve, node))]
            if whys:  # the outermost offence of a statement says it
                node, why = whys[0]
                checker.violations.append(Violation(
                    getattr(node, "lineno", stmt.lineno), f"inside {who}: {why}; an epilogue body is "
                    "arithmetic, comparisons and calls of the catalogue's math (`where`, `maximum`, "
                    "`unpack`...) on its values, since the compiled kernel's values are numbers per element"))
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and checker.module.get(node.func.id) == Binding("function") and node.func.id in defs:
                    todo.append((defs[node.func.id], via))


def _is_epilogue(checker: Any, decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and checker.module.get(target.id) == Binding("catalogue", "epilogue")


def _not_epilogue_math(resolve: Callable[[str], Binding | None], node: ast.AST) -> str:
    """Why ``node`` is no epilogue math ('' when it is)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.Return, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Name,
                         ast.Tuple, ast.Dict, ast.keyword, ast.expr_context, ast.operator, ast.unaryop,
                         ast.cmpop)):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return "`not` asks a value for its truth; use where(cond, a, b)"
        return ""
    if isinstance(node, ast.Constant):
        return "" if isinstance(node.value, (int, float, str)) and not isinstance(node.value, bool) \
            else f"the constant {node.value!r} is no number"
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and resolve(node.value.id) == Binding("math"):
            return ""
        return f"`.{node.attr}` reads an attribute"
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and resolve(f.value.id) == Binding("math"):
            return ""
        if isinstance(f, ast.Attribute):
            return f"`.{f.attr}()` calls a method"
        if not isinstance(f, ast.Name):
            return "a call of something other than a function by its name"
        bound = resolve(f.id)
        if bound is not None and (bound.kind in ("function", "math_function")
                                  or (bound.kind == "catalogue" and bound.of in ALLOWED.epilogue_math)):
            return ""
        return f"`{f.id}(...)` is not the catalogue's epilogue math"
    if isinstance(node, ast.Subscript):
        if isinstance(node.value, ast.Name) and resolve(node.value.id) == Binding("constant"):
            return ""  # a number from a module-level tuple of them
        return "indexing (`x[...]`): a pair's lanes are unpack(pair), a tile's elements are the tile"
    if isinstance(node, (ast.If, ast.IfExp, ast.BoolOp, ast.While, ast.For, ast.Match)):
        return "a Python branch or loop on values; select with where(cond, a, b)"
    what = {ast.GeneratorExp: "a generator", ast.ListComp: "a comprehension", ast.Lambda: "a lambda",
            ast.JoinedStr: "an f-string", ast.List: "a list", ast.Starred: "unpacking with *"}
    return f"{what.get(type(node), type(node).__name__)} is not epilogue math"


def _docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
