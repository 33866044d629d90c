"""Stage 1, static: read the program as an AST (never import it) and reject what
no honest epilogue program needs.  The fast first filter, and feedback with the
program's own line; no guarantee rests on it (the package docstring says why:
a Python sandbox by AST filtering is escapable, so the verdict comes from the
judge, in a process the program never runs in).

A program is a module that composes catalogue calls.  Each violation names its
line and the fix, because the message is what the LLM reads next.

**Provenance, per name.**  Every name is resolved the way Python will resolve
it: the innermost function (or lambda, or comprehension) that binds it, then
the module, then the builtins.  What it is bound to decides what may be done
with it, never what it is called: ``from math import e as fr`` binds ``fr`` to a
float, and a parameter or local named ``fr`` elsewhere is a local value.

- **catalogue** (``from coda_agent.primitives import NAME``): called, passed,
  used as annotations; never reached into (no attributes).
- **math** (``import math``, ``from math import ...``): ``math.<public name>``;
  its functions called, its constants read.
- **the program's own functions and module constants**: called and read.
- **a local value** (a parameter, anything assigned in a function: tensors, numbers, dicts): the
  attributes and methods of the program rules table (``coda_agent/program_rules.py``: metadata
  and free views such as ``.shape`` and ``.t()``, container methods such as ``.items()``);
  nothing else (``.float()`` is PyTorch compute, ``.gi_frame`` a way out).
- **builtins**: the allow-list :data:`BUILTINS` (``len``, ``range``, ``min``..., and the
  exceptions a program may raise); every other builtin is refused with its reason (``open``:
  files; ``getattr``: reflection; ``str``, f-strings and ``%`` outside an error's message: a
  device's name is the one text the runtime audit cannot see read, and ``.device`` is read only
  as a catalogue call's argument, so no device is held, compared or formatted; ...).

**Epilogue bodies** (:mod:`.static_epilogue`): an @epilogue fn, and every program
function it calls, is arithmetic, comparisons and calls of the catalogue's math on names and
numbers (no attributes, indexing but of a module constant, builtins, branches or loops on
values): both lowerings evaluate it, the compiled kernel on values that have none of those.

Also refused: imports other than the catalogue and ``math`` (and any import inside a function); the
harness's own catalogue entry points (the table's ``HARNESS_ONLY``: ``load_program``,
``lowering``...); dunder names and attributes; epilogue fns declared inside a function (the
catalogue dry-runs a declaration, and a nested one closes over the call's tensors); classes,
``global``/``nonlocal``, ``try``, ``with``, ``async``, ``yield``, ``match``; attribute assignment;
item assignment except into a dict or list the same function created; module-level statements
other than imports, function definitions and constants (numbers, strings, tuples of them,
arithmetic over them, ``math`` calls and catalogue declarations on them: ``GELU_C = math.sqrt(2 /
math.pi)``, ``SQ = col_sum()``; never a tensor); assignment expressions (``:=``, which bind where
no statement does); defaults other than literal constants (a computed or mutable default is state
that survives between calls); a module name bound twice.

The importable names, the harness-only ones and the attributes and methods
come from :func:`coda_agent.program_rules.static_allow_list`, the table the
catalogue text the model reads is rendered from, so the two cannot disagree.
"""

from __future__ import annotations

import ast
import difflib
import math
from dataclasses import dataclass, field

from coda_agent.program_rules import BUILTINS, MESSAGE_BUILTINS, static_allow_list
from coda_agent.syntax import parse
from coda_agent.tasks.spec import TaskSpec
from coda_agent.verifier.static_contract import check_contract

ALLOWED = static_allow_list()  # the program rules table: the same one the catalogue text renders
MATH_NAMES = frozenset(n for n in dir(math) if not n.startswith("_"))

_WHY = {
    "torch": "PyTorch compute is not allowed; express the math in an @epilogue or an auxiliary catalogue kernel",
    "numpy": "numpy is not allowed; express the math with catalogue primitives",
    "io": "programs may not touch files, the network, processes or the environment",
    "dynamic": "dynamic code and reflection are not allowed; call catalogue functions directly",
    "introspection": "introspection of the harness is not allowed",
    "threads": "threads and async are not allowed; a program is straight-line catalogue calls",
    "text": "a program reads no value as text (a device's name, a tensor's contents, a dtype's): what it "
            "computes is the same on every device, rank and input",
}
BANNED_NAMES = {
    **dict.fromkeys(["torch", "triton", "cutlass", "quack"], "torch"),
    **dict.fromkeys(["numpy", "np"], "numpy"),
    **dict.fromkeys(["open", "os", "sys", "subprocess", "socket", "pathlib", "Path", "shutil", "io",
                     "input", "environ", "urllib", "requests", "http"], "io"),
    **dict.fromkeys(["eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "hasattr",
                     "globals", "locals", "vars", "dir", "type", "super", "object", "importlib", "builtins",
                     "breakpoint", "memoryview", "classmethod", "staticmethod", "property", "exit", "quit",
                     "help", "ctypes", "pickle", "id", "hash", "callable", "iter", "next", "format", "repr",
                     "SystemExit", "KeyboardInterrupt", "BaseException", "Exception"], "dynamic"),
    **dict.fromkeys(["inspect", "gc", "traceback", "weakref", "frame"], "introspection"),
    **dict.fromkeys(["threading", "concurrent", "asyncio", "multiprocessing", "signal"], "threads"), "str": "text",
}
_SCOPES = (ast.FunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_BANNED_STATEMENTS = {
    ast.ClassDef: "programs define no classes; use functions",
    ast.Global: "`global` statement: programs keep no state between calls; pass values explicitly",
    ast.Nonlocal: "`nonlocal` statement: programs keep no state between calls; return values instead",
    ast.Try: "try/except: a program must not catch errors (it would swallow catalogue errors); remove the "
             "try and let errors surface",
    ast.With: "`with` statement: programs need no context managers (the verifier chooses the lowering and "
              "streams); remove it",
    ast.AsyncFunctionDef: f"async function: {_WHY['threads']}",
    ast.AsyncWith: f"async with: {_WHY['threads']}",
    ast.AsyncFor: f"async for: {_WHY['threads']}",
    ast.Await: f"await: {_WHY['threads']}",
    ast.Yield: "`yield`: a program's functions return their results; no generators",
    ast.YieldFrom: "`yield from`: a program's functions return their results; no generators",
    ast.Match: "`match` statement: use if/else",
}
if hasattr(ast, "TryStar"):
    _BANNED_STATEMENTS[ast.TryStar] = _BANNED_STATEMENTS[ast.Try]


@dataclass
class Violation:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def check_source(source: str, spec: TaskSpec) -> list[Violation]:
    """All violations in line order; empty when the program may run."""
    try:
        checker = _Checker(tree := parse(source))
        checker.check_module(tree)
        from coda_agent.verifier.static_epilogue import check_epilogues  # it reads this module's bindings

        check_epilogues(checker, tree)
        check_contract(checker.bad, tree, spec)
    except SyntaxError as e:
        return [Violation(e.lineno or 1, f"syntax error: {e.msg}; fix the Python syntax")]
    except (RecursionError, ValueError, MemoryError) as e:  # nesting too deep for the parser, a NUL byte
        return [Violation(1, f"the program cannot be read ({type(e).__name__}); write plain, shallow Python")]
    seen: set[tuple[int, str]] = set()
    out = []
    for v in sorted(checker.violations, key=lambda v: v.line):
        if (v.line, v.message) not in seen:
            seen.add((v.line, v.message))
            out.append(v)
    return out


@dataclass(frozen=True)
class Binding:
    """What a name is bound to: ``catalogue`` (``of`` = the catalogue name), ``math`` (the module),
    ``math_function``/``math_number`` (``of`` = the member), ``function``, ``constant`` or ``local``."""

    kind: str
    of: str = ""


LOCAL = Binding("local")


@dataclass
class _Scope:
    names: set[str] = field(default_factory=set)
    containers: set[str] = field(default_factory=set)  # locals bound to a dict/list display


def _bound_in(node: ast.AST) -> _Scope:
    """The names a function, lambda or comprehension binds itself (not in nested scopes)."""
    scope = _Scope()
    if isinstance(node, (ast.FunctionDef, ast.Lambda)):
        a = node.args
        scope.names |= {p.arg for p in _parameters(a)}
        body = node.body if isinstance(node.body, list) else [node.body]
    else:
        scope.names |= {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        body = []
    stack = list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope.names.add(n.name)
            continue
        if isinstance(n, _SCOPES):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            scope.names.add(n.id)
        if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Dict, ast.List, ast.DictComp, ast.ListComp)):
            scope.containers |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        stack.extend(ast.iter_child_nodes(n))
    return scope


class _Checker(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.violations: list[Violation] = []
        self.module: dict[str, Binding] = {}
        self.scopes: list[_Scope] = []
        self.call_targets: set[int] = set()  # ids of Attribute nodes that are called (`x.items()`)
        self.device_args: set[int] = set()  # ids of `x.device` nodes passed straight to a catalogue call
        self.in_message = 0  # inside an assert's message or a raise: text there steers nothing
        self._bind_module(tree)

    def bad(self, node: ast.AST, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 1), message))

    # ------------------------------------------------------------------ bindings

    def _bind_module(self, tree: ast.Module) -> None:
        for stmt in tree.body:
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.name == ALLOWED.math_module:
                        self._bind(stmt, a.asname or a.name, Binding("math"))
            elif isinstance(stmt, ast.ImportFrom) and not stmt.level \
                    and stmt.module in (ALLOWED.catalogue_module, ALLOWED.math_module):
                for a in stmt.names:
                    if a.name == "*":
                        continue
                    if stmt.module == ALLOWED.math_module:
                        kind = "math_function" if callable(getattr(math, a.name, None)) else "math_number"
                        self._bind(stmt, a.asname or a.name, Binding(kind, a.name))
                    else:
                        self._bind(stmt, a.asname or a.name, Binding("catalogue", a.name))
            elif isinstance(stmt, ast.FunctionDef):
                self._bind(stmt, stmt.name, Binding("function"))
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self._bind(stmt, n.id, Binding("constant"))

    def _bind(self, node: ast.AST, name: str, binding: Binding) -> None:
        if name in self.module:
            self.bad(node, f"`{name}` is bound twice at module level; give each its own name")
        self.module[name] = binding

    def resolve(self, name: str) -> Binding | None:
        """What ``name`` refers to here; None for a builtin (or nothing)."""
        if any(name in s.names for s in self.scopes):
            return LOCAL
        return self.module.get(name)

    # ------------------------------------------------------------------ module level

    def check_module(self, tree: ast.Module) -> None:
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef)) or type(stmt) in _BANNED_STATEMENTS:
                pass
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                pass  # docstring
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                if stmt.value is None or not self._constant_like(stmt.value):
                    self.bad(stmt, "module-level state: a module-level name may only bind a constant, a tuple "
                             "of constants or a catalogue declaration (`col_sum()`, `TileConfig(...)`; a dict, "
                             "list or tensor here would survive between calls); build it inside "
                             "forward/backward instead")
            else:
                self.bad(stmt, f"module-level {type(stmt).__name__} statement: only imports, constants and "
                         "function definitions may appear at module level; move the code into forward/backward")
        self.visit(tree)

    def _constant_like(self, node: ast.expr) -> bool:
        """A value computed once from literals, math and catalogue declarations (no state)."""
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Tuple):
            return all(self._constant_like(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp):
            return self._constant_like(node.operand)
        if isinstance(node, ast.BinOp):
            return self._constant_like(node.left) and self._constant_like(node.right)
        if isinstance(node, ast.Name):
            return self.module.get(node.id, Binding("")).kind in ("constant", "math_number", "catalogue")
        if isinstance(node, ast.Attribute):
            return self._math_member(node) is not None
        if isinstance(node, ast.Call):
            func = node.func
            callee = self.module.get(func.id, Binding("")) if isinstance(func, ast.Name) else None
            ok = (callee is not None and (callee.kind == "math_function" or (
                callee.kind == "catalogue" and callee.of in ALLOWED.declarations))) or \
                (isinstance(func, ast.Attribute) and self._math_member(func) is not None)
            return ok and all(self._constant_like(a) for a in node.args) \
                and all(self._constant_like(k.value) for k in node.keywords)
        return False

    def _math_member(self, node: ast.Attribute) -> str | None:
        base = node.value
        if isinstance(base, ast.Name) and self.resolve(base.id) == Binding("math") and node.attr in MATH_NAMES:
            return node.attr
        return None

    # ------------------------------------------------------------------ imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name != ALLOWED.math_module or self.scopes:
                self._bad_import(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module not in (ALLOWED.catalogue_module, ALLOWED.math_module) or self.scopes:
            self._bad_import(node, "." * node.level + module)
            return
        for alias in node.names:
            if alias.name == "*":
                self.bad(node, f"`from {module} import *`: import the names you use explicitly")
            elif alias.name in ALLOWED.harness_only:
                self.bad(node, f"`{alias.name}` is for the verifier, not for programs; remove the import")
            elif module == ALLOWED.catalogue_module and alias.name not in ALLOWED.program_api:
                close = difflib.get_close_matches(alias.name, sorted(ALLOWED.program_api), n=1)
                hint = f" (did you mean `{close[0]}`?)" if close else ""
                self.bad(node, f"`{alias.name}` is not in the catalogue{hint}; programs may import "
                         f"{', '.join(sorted(ALLOWED.program_api))}")
            elif module == ALLOWED.math_module and alias.name not in MATH_NAMES:
                self.bad(node, f"`math.{alias.name}` does not exist; import a public name of math")

    def _bad_import(self, node: ast.AST, module: str) -> None:
        root = module.split(".")[0]
        why = _WHY.get(BANNED_NAMES.get(root, ""), "")
        where = " inside a function (imports go at the top of the module)" if self.scopes else ""
        self.bad(node, f"import of `{module}`{where}: programs may import only `from {ALLOWED.catalogue_module} "
                 f"import ...` and `{ALLOWED.math_module}`" + (f" ({why})" if why else ""))

    # ------------------------------------------------------------------ statements and scopes

    def generic_visit(self, node: ast.AST) -> None:
        if type(node) in _BANNED_STATEMENTS:
            name = getattr(node, "name", "")
            self.bad(node, (f"class `{name}`: " if isinstance(node, ast.ClassDef) else "")
                     + _BANNED_STATEMENTS[type(node)])
        if not self.in_message and _formats_text(node):  # an f-string with a value, or `"..." % value`
            self.bad(node, f"a value formatted as text outside an error's message: {_WHY['text']}")
        super().generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            if not _literal(default):
                self.bad(default, f"default argument of `{node.name}` is not a constant (a computed or mutable "
                         "default keeps state between calls); use None or a number")
        for d in node.decorator_list:
            target = d.func if isinstance(d, ast.Call) else d
            if not (isinstance(target, ast.Name) and self.resolve(target.id) is not None
                    and self.resolve(target.id).kind == "catalogue"):
                self.bad(d, f"decorator of `{node.name}`: only catalogue decorators (`@epilogue(...)`) are allowed")
            elif self.scopes:
                self.bad(d, f"`{node.name}` is declared inside a function: declare epilogue fns at module level "
                         "(one declared in forward is declared again on every call, and its body could read that "
                         "call's tensors)")
        self._scoped(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            if not _literal(default):
                self.bad(default, "default argument of a lambda is not a constant (a computed default is "
                         "evaluated where the lambda is made, and keeps what it names); use None or a number")
        self._scoped(node)

    def _scoped(self, node: ast.AST) -> None:
        """Visit ``node``'s parts as Python evaluates them: a function's decorators, defaults and
        annotations, and a comprehension's first iterable, in the enclosing scope; the rest in the
        scope ``node`` makes."""
        outer = _evaluated_outside(node)
        for part in outer:
            self.visit(part)
        skip = {id(part) for part in outer}
        self.scopes.append(_bound_in(node))
        stack = [node]
        while stack:  # the children of node, and of its `arguments` and comprehensions, minus `outer`
            for child in ast.iter_child_nodes(stack.pop()):
                if id(child) in skip:
                    continue
                if isinstance(child, (ast.arguments, ast.arg, ast.comprehension)):
                    stack.append(child)
                else:
                    self.visit(child)
        self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scoped

    # ------------------------------------------------------------------ names and attributes

    def visit_Name(self, node: ast.Name) -> None:
        if _is_dunder(node.id):
            self.bad(node, f"`{node.id}`: dunder names are not allowed in programs")
        elif isinstance(node.ctx, ast.Load) and self.resolve(node.id) is None and node.id not in BUILTINS \
                and not (self.in_message and node.id in MESSAGE_BUILTINS):
            kind = BANNED_NAMES.get(node.id)
            self.bad(node, f"`{node.id}`: {_WHY[kind]}" if kind else
                     f"`{node.id}` is neither defined in the program nor imported from the catalogue, and is "
                     f"not a builtin programs may use ({', '.join(sorted(BUILTINS - {'None', 'True', 'False'}))})")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = node.value
        binding = self.resolve(base.id) if isinstance(base, ast.Name) else LOCAL
        if _is_dunder(node.attr):
            self.bad(node, f"`.{node.attr}`: dunder attributes are not allowed in programs")
        elif isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bad(node, f"assignment to attribute `.{node.attr}`: programs may not set attributes "
                     "(no state on functions or tensors); return values instead")
        elif binding == Binding("math"):
            if node.attr not in MATH_NAMES:
                self.bad(node, f"`math.{node.attr}`: only the public names of math may be used")
        elif binding is not None and binding.kind in ("catalogue", "function", "math_function"):
            self.bad(node, f"attribute `.{node.attr}` of `{base.id}`: programs call catalogue and their own "
                     "functions; they do not reach inside them")
        elif id(node) in self.call_targets:
            if node.attr not in ALLOWED.methods:
                self.bad(node, f"method call `.{node.attr}()`: host code may call only "
                         f"{', '.join('.' + m + '()' for m in sorted(ALLOWED.methods))} (views of tensors, "
                         "and the dicts and lists it builds); anything else on a tensor is PyTorch compute "
                         "outside the catalogue (express it with catalogue primitives), and a string's or "
                         "dict's other methods are not needed (text belongs in an error's message)")
        elif node.attr not in ALLOWED.attributes:
            self.bad(node, f"attribute `.{node.attr}` on a non-catalogue object: only "
                     f"{', '.join('.' + a for a in sorted(ALLOWED.attributes))} may be read; use a catalogue "
                     "primitive for the rest")
        elif node.attr == "device" and id(node) not in self.device_args:
            self.bad(node, "`.device` is read only as an argument of a catalogue call (`column_index(n, x.device)`): "
                     "a program computes the same on every device (a rank's `cuda:1` too), so it keeps none")
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:  # text is allowed where it can only be an error's message
        self.visit(node.test)
        self._message(node.msg)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._message(node.exc, node.cause)

    def _message(self, *nodes: ast.AST | None) -> None:
        self.in_message += 1
        for node in filter(None, nodes):
            self.visit(node)
        self.in_message -= 1

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        # A walrus binds a name where no assignment statement is (a decorator's arguments, a
        # comprehension binding its enclosing function's name): state and aliases the module and
        # scope checks would not see.
        self.bad(node, "assignment expression (`:=`): assign with a statement of its own")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute):
            self.call_targets.add(id(node.func))
        binding = self.resolve(node.func.id) if isinstance(node.func, ast.Name) else None
        if binding is not None and binding.kind == "catalogue":
            self.device_args |= {id(a) for a in [*node.args, *(k.value for k in node.keywords)]
                                 if isinstance(a, ast.Attribute) and a.attr == "device"}
        self.generic_visit(node)

    # ------------------------------------------------------------------ stores

    def visit_Assign(self, node: ast.Assign | ast.AugAssign | ast.Delete) -> None:
        for t in node.targets if hasattr(node, "targets") else [node.target]:
            self._check_store(t)
        self.generic_visit(node)

    visit_AugAssign = visit_Delete = visit_Assign

    def _check_store(self, target: ast.expr) -> None:
        for t in ast.walk(target):
            if isinstance(t, ast.Subscript):
                base = t.value
                local = self.scopes[-1].containers if self.scopes else set()
                if not (isinstance(base, ast.Name) and base.id in local):
                    self.bad(t, "item assignment into an input, `saved` or a tensor: programs may not mutate "
                             "their inputs or write tensors in place; build a new dict "
                             "(`outs = {}; outs[\"y\"] = ...`) or have the epilogue write the output")


def _parameters(a: ast.arguments) -> list[ast.arg]:
    """Every parameter a function or lambda declares, ``*args`` and ``**kwargs`` included."""
    return [p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None]


def _evaluated_outside(node: ast.AST) -> list[ast.AST]:
    """The parts of a function, lambda or comprehension that run in the scope around it."""
    if isinstance(node, (ast.FunctionDef, ast.Lambda)):
        a = node.args
        parts: list[ast.AST | None] = [*a.defaults, *a.kw_defaults]
        if isinstance(node, ast.FunctionDef):
            parts += [*node.decorator_list, *(p.annotation for p in _parameters(a)), node.returns]
        return [p for p in parts if p is not None]
    return [node.generators[0].iter]


def _literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _literal(node.operand)
    return isinstance(node, ast.Tuple) and all(_literal(e) for e in node.elts)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def _formats_text(node: ast.AST) -> bool:
    return (isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in node.values)) or (
        isinstance(node, ast.BinOp) and type(node.op) is ast.Mod
        and isinstance(getattr(node.left, "value", 0), (str, bytes)))
