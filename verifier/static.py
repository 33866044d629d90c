"""Stage 1, static: read the program as an AST (never import it) and reject what
no honest epilogue program needs.

A program is a module that composes catalogue calls.  Everything else is either
a way to compute outside the catalogue (torch, numpy, tensor methods), a way to
cheat the judge (caching outputs between calls, reading files or the
environment, introspecting the harness, swallowing errors) or a way to escape
the sandbox.  Each violation names its line and the fix, because the message is
what the LLM reads next.

The allow-list, tight on purpose (widen it only with a reason).  Its names
(the catalogue's importable names and the harness-only ones, the attributes
and methods allowed on non-catalogue values) come from
``coda_agent/program_rules.py``, the table the catalogue text the model reads
is rendered from, so the two cannot disagree:

- imports: ``from coda_agent.primitives import NAME[, ...]`` and ``import math``
  / ``from math import ...``; the harness entry points of the catalogue are not
  for programs.
- module level: the docstring, imports, function definitions and assignments
  of constants (numbers, strings, tuples of them, arithmetic over them,
  ``math`` values and calls such as ``math.sqrt(2 / math.pi)``, and catalogue
  declarations).  A module-level dict/list/set is mutable state that survives
  between calls (the classic cached-output cheat), so it is banned.
- attribute reads and method calls on non-catalogue objects: the table's
  metadata and free views (``.shape``, ``.t()``, ``.view()``...) and the
  container methods (``.items()``, ``.append()``...).  Anything else
  (``.float()``, ``.to()``, ``.clone()``, ``.sum()``...) is PyTorch compute.
- item assignment only into a dict or list the same function created
  (``outs = {}; outs["y"] = y``); never into an input, ``saved`` or a tensor.
- no classes, ``global``/``nonlocal``, ``try``, ``with``, ``async``, dunder
  names or attributes, attribute assignment, mutable default arguments.

What an AST cannot see (operator arithmetic on tensors in ``forward``) is
caught at run time: the reference stage audits PyTorch calls made from the
program's own lines, and the GPU launch audit counts kernels.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass

from coda_agent.program_rules import static_allow_list
from coda_agent.tasks.spec import TaskSpec

ALLOWED = static_allow_list()  # the program rules table: the same one the catalogue text renders

_WHY = {
    "torch": "PyTorch compute is not allowed; express the math in an @epilogue or an auxiliary catalogue kernel",
    "numpy": "numpy is not allowed; express the math with catalogue primitives",
    "io": "programs may not touch files, the network, processes or the environment",
    "dynamic": "dynamic code and reflection are not allowed; call catalogue functions directly",
    "introspection": "introspection of the harness is not allowed",
    "threads": "threads and async are not allowed; a program is straight-line catalogue calls",
}
BANNED_NAMES = {
    **dict.fromkeys(["torch", "triton", "cutlass", "quack"], "torch"),
    **dict.fromkeys(["numpy", "np"], "numpy"),
    **dict.fromkeys(["open", "os", "sys", "subprocess", "socket", "pathlib", "Path", "shutil", "io",
                     "input", "print_function", "environ", "urllib", "requests", "http"], "io"),
    **dict.fromkeys(["eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr",
                     "hasattr", "globals", "locals", "vars", "dir", "type", "super", "object",
                     "importlib", "builtins", "breakpoint", "memoryview", "classmethod",
                     "staticmethod", "property", "exit", "quit", "help", "ctypes", "pickle"],
                    "dynamic"),
    **dict.fromkeys(["inspect", "gc", "traceback", "weakref", "sys"], "introspection"),
    **dict.fromkeys(["threading", "concurrent", "asyncio", "multiprocessing", "signal"],
                    "threads"),
}


@dataclass
class Violation:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def check_source(source: str, spec: TaskSpec) -> list[Violation]:
    """All violations in line order; empty when the program may run."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [Violation(e.lineno or 1, f"syntax error: {e.msg}; fix the Python syntax")]
    checker = _Checker()
    checker.check_module(tree)
    checker.check_contract(tree, spec)
    seen: set[tuple[int, str]] = set()
    out = []
    for v in sorted(checker.violations, key=lambda v: v.line):
        if (v.line, v.message) not in seen:
            seen.add((v.line, v.message))
            out.append(v)
    return out


def epilogue_function_names(source: str) -> set[str]:
    """Names of functions decorated with ``epilogue`` (and those nested in them):
    code whose tensor arithmetic is traced by the catalogue, not PyTorch compute."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _decorator_name(d) == "epilogue" for d in node.decorator_list):
            names |= {n.name for n in ast.walk(node)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {"<lambda>"} if any(isinstance(n, ast.Lambda) for n in ast.walk(node)) else set()
    return names


def _decorator_name(d: ast.expr) -> str:
    if isinstance(d, ast.Call):
        d = d.func
    if isinstance(d, ast.Name):
        return d.id
    return d.attr if isinstance(d, ast.Attribute) else ""


class _Checker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.catalogue_names: set[str] = set()  # imported from the catalogue or math
        self.module_constants: set[str] = set()
        self.local_containers: list[set[str]] = []  # per function: names bound to dict/list displays
        self.call_targets: set[int] = set()  # ids of Attribute nodes that are called (`x.items()`)

    def bad(self, node: ast.AST, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 1), message))

    # ------------------------------------------------------------------ module level

    def check_module(self, tree: ast.Module) -> None:
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self.visit(stmt)  # now: the constants below may use what it binds (`math.sqrt`)
            elif isinstance(stmt, ast.FunctionDef):
                pass
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                pass  # docstring
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                value = stmt.value
                if value is None or not self._constant_like(value):
                    self.bad(stmt, "module-level state: a module-level name may only bind a constant, "
                             "a tuple of constants or a catalogue declaration (a dict/list here would "
                             "survive between calls); build it inside forward/backward instead")
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.module_constants.add(n.id)
            elif isinstance(stmt, ast.ClassDef):
                pass  # reported by visit_ClassDef
            else:
                self.bad(stmt, f"module-level {type(stmt).__name__} statement: only imports, constants "
                         "and function definitions may appear at module level; move the code into "
                         "forward/backward")
        for stmt in tree.body:
            if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self.visit(stmt)

    def _constant_like(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Tuple):
            return all(self._constant_like(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp):
            return self._constant_like(node.operand)
        if isinstance(node, ast.BinOp):
            return self._constant_like(node.left) and self._constant_like(node.right)
        if isinstance(node, ast.Name):
            return node.id in self.catalogue_names or node.id in self.module_constants
        if isinstance(node, ast.Attribute):
            return isinstance(node.value, ast.Name) and node.value.id in self.catalogue_names
        if isinstance(node, ast.Call):
            return (self._constant_like(node.func)
                    and all(self._constant_like(a) for a in node.args)
                    and all(self._constant_like(k.value) for k in node.keywords))
        return False

    # ------------------------------------------------------------------ imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == ALLOWED.math_module:
                self.catalogue_names.add(alias.asname or alias.name)
            else:
                self._bad_import(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module not in (ALLOWED.catalogue_module, ALLOWED.math_module):
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
                self.catalogue_names.add(alias.asname or alias.name)
            else:
                self.catalogue_names.add(alias.asname or alias.name)

    def _bad_import(self, node: ast.AST, module: str) -> None:
        root = module.split(".")[0]
        why = _WHY.get(BANNED_NAMES.get(root, ""), "")
        self.bad(node, f"import of `{module}`: programs may import only `from {ALLOWED.catalogue_module} "
                 f"import ...` and `{ALLOWED.math_module}`" + (f" ({why})" if why else ""))

    # ------------------------------------------------------------------ banned statements

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bad(node, f"class `{node.name}`: programs define no classes; use functions")
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        self.bad(node, "`global` statement: programs keep no state between calls; pass values explicitly")

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        self.bad(node, "`nonlocal` statement: programs keep no state between calls; return values instead")

    def visit_Try(self, node: ast.AST) -> None:
        self.bad(node, "try/except: a program must not catch errors (it would swallow catalogue "
                 "errors); remove the try and let errors surface")
        self.generic_visit(node)

    visit_TryStar = visit_Try

    def visit_With(self, node: ast.AST) -> None:
        self.bad(node, "`with` statement: programs need no context managers (the verifier chooses the "
                 "lowering and streams); remove it")
        self.generic_visit(node)

    visit_AsyncWith = visit_With

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.bad(node, f"async function `{node.name}`: {_WHY['threads']}")
        self.generic_visit(node)

    def visit_Await(self, node: ast.Await) -> None:
        self.bad(node, f"await: {_WHY['threads']}")
        self.generic_visit(node)

    # ------------------------------------------------------------------ functions

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            if not self._constant_like(default):
                self.bad(default, f"default argument of `{node.name}` is not a constant (a mutable "
                         "default keeps state between calls); use None or a number")
        containers = {n.id for s in ast.walk(node) if isinstance(s, ast.Assign)
                      and isinstance(s.value, (ast.Dict, ast.List, ast.DictComp, ast.ListComp))
                      for t in s.targets for n in [t] if isinstance(n, ast.Name)}
        self.local_containers.append(containers)
        self.generic_visit(node)
        self.local_containers.pop()

    # ------------------------------------------------------------------ names and attributes

    def visit_Name(self, node: ast.Name) -> None:
        if _is_dunder(node.id):
            self.bad(node, f"`{node.id}`: dunder names are not allowed in programs")
        elif node.id in BANNED_NAMES and node.id not in self.catalogue_names:
            kind = BANNED_NAMES[node.id]
            self.bad(node, f"`{node.id}`: {_WHY[kind]}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_dunder(node.attr):
            self.bad(node, f"`.{node.attr}`: dunder attributes are not allowed in programs")
        elif isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bad(node, f"assignment to attribute `.{node.attr}`: programs may not set attributes "
                     "(no state on functions or tensors); return values instead")
        elif not self._on_catalogue(node) and node.attr not in ALLOWED.attributes \
                and not self._is_call_target(node):
            self.bad(node, f"attribute `.{node.attr}` on a non-catalogue object: only "
                     f"{', '.join('.' + a for a in sorted(ALLOWED.attributes))} may be read; use a catalogue "
                     "primitive for the rest")
        self.generic_visit(node)

    def _on_catalogue(self, node: ast.Attribute) -> bool:
        return isinstance(node.value, ast.Name) and node.value.id in self.catalogue_names

    def _is_call_target(self, node: ast.Attribute) -> bool:
        return id(node) in self.call_targets

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            self.call_targets.add(id(func))
            if not self._on_catalogue(func) and not _is_dunder(func.attr) \
                    and func.attr not in ALLOWED.methods:
                self.bad(node, f"method call `.{func.attr}()` on a non-catalogue object: that is PyTorch "
                         "compute outside the catalogue; express it with catalogue primitives (allowed "
                         f"methods: {', '.join('.' + m + '()' for m in sorted(ALLOWED.methods))})")
        self.generic_visit(node)

    # ------------------------------------------------------------------ stores

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_store(t)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._check_store(t)
        self.generic_visit(node)

    def _check_store(self, target: ast.expr) -> None:
        for t in ast.walk(target):
            if isinstance(t, ast.Subscript):
                base = t.value
                local = self.local_containers[-1] if self.local_containers else set()
                if not (isinstance(base, ast.Name) and base.id in local):
                    self.bad(t, "item assignment into an input, `saved` or a tensor: programs may not "
                             "mutate their inputs or write tensors in place; build a new dict "
                             "(`outs = {}; outs[\"y\"] = ...`) or have the epilogue write the output")

    # ------------------------------------------------------------------ the contract

    def check_contract(self, tree: ast.Module, spec: TaskSpec) -> None:
        funcs = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
        wanted = [*spec.inputs, *spec.params]
        fwd = funcs.get("forward")
        if fwd is None:
            self.bad(tree.body[0] if tree.body else tree,
                     f"no top-level `def forward({', '.join(wanted)})`; define it, returning "
                     f"a dict with {sorted(spec.outputs)}")
        else:
            self._check_signature(fwd, wanted, "forward")
        bwd = funcs.get("backward")
        grads = [f"d{o}" for o in spec.grad_outputs]
        if spec.has_backward and bwd is None:
            self.bad(fwd or tree, f"the task asks for gradients {spec.gradients}: define "
                     f"`def backward(saved, {', '.join(grads)})` returning "
                     f"{{{', '.join(repr('d' + g) for g in spec.gradients)}}}")
        elif not spec.has_backward and bwd is not None:
            self.bad(bwd, "this task has no gradients; remove `backward`")
        elif bwd is not None:
            a = bwd.args
            positional = [*a.posonlyargs, *a.args]
            if not positional:
                self.bad(bwd, "backward's first parameter must be `saved` (the forward's inputs, params "
                         "and returned dict)")
            else:
                rest = [p.arg for p in positional[1:]] + [p.arg for p in a.kwonlyargs]
                self._check_params(bwd, rest, grads, "backward", bool(a.kwarg),
                                   n_defaults=len(a.defaults) + sum(d is not None for d in a.kw_defaults))

    def _check_signature(self, fn: ast.FunctionDef, wanted: list[str], what: str) -> None:
        a = fn.args
        names = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
        if a.posonlyargs:
            self.bad(fn, f"{what}: parameters are passed by keyword; drop the `/`")
        self._check_params(fn, names, wanted, what, bool(a.kwarg),
                           n_defaults=len(a.defaults) + sum(d is not None for d in a.kw_defaults))

    def _check_params(self, fn: ast.FunctionDef, names: list[str], wanted: list[str], what: str,
                      has_kwargs: bool, n_defaults: int) -> None:
        missing = [w for w in wanted if w not in names]
        if missing and not has_kwargs:
            self.bad(fn, f"{what} does not accept {missing}; its parameters must be "
                     f"({', '.join(wanted)}) (called by keyword)")
        extra = [n for n in names if n not in wanted]
        if len(extra) > n_defaults:
            self.bad(fn, f"{what} has parameters {extra} the verifier does not pass; its parameters "
                     f"must be ({', '.join(wanted)})")


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4
