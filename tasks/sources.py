"""A task's PyTorch reference: importing it, and the source a reader needs to understand it.

Importing (:func:`import_reference`): ``path/to/file.py:function`` is a file
relative to the task file's folder, loaded as a module of its own (a unique
name per file, so two tasks' ``ref.py`` never collide), with its folder on
``sys.path`` while it loads so that it may import the modules beside it
(``from helpers import gelu``); ``package.module:function`` is imported as
usual.

Reading (:func:`reference_source`): a reference rarely stands alone.  The LLM's
prompt shows the reference function together with its *dependency closure*:
every top-level function, class, constant and import of its file that it uses,
recursively, and the same for names it imports from modules in its own folder
(``from .references import rope_rotate``, ``from helpers import gelu``), each
file under a ``# file.py`` header, plus the module docstring where layout
conventions usually live.  Only the AST is read, never executed, so this works
on any file :func:`import_reference` loaded.  :func:`reference_files` lists the
files read, which a run directory keeps.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable

from coda_agent.syntax import parse


class ReferenceImportError(LookupError):
    """The reference cannot be imported; the message names the fix (the task adds file and field)."""


def import_reference(target: str, folder: Path) -> Callable[..., dict]:
    """The function ``target`` (``file.py:fn`` relative to ``folder``, or ``module:fn``) names."""
    where, _, fn_name = target.rpartition(":")
    if where.endswith(".py"):
        file = (folder / where).resolve()
        if not file.is_file():
            raise ReferenceImportError(f"{file} does not exist (a reference file's path is relative to the "
                                       f"task file's folder, {folder})")
        module = _load_file(file)
        shown = where
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 - any import failure is the spec's problem
            beside = folder / f"{where.replace('.', '/')}.py"
            hint = (f"; {beside.name} is beside the task file: write '{beside.relative_to(folder)}:{fn_name}'"
                    if beside.is_file() else "; fix the module path, or name a file: 'ref.py:function'")
            raise ReferenceImportError(f"cannot import module {where!r} ({type(e).__name__}: {e}){hint}") from None
        shown = repr(where)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_"))
        raise ReferenceImportError(f"{shown} has no function {fn_name!r} (it defines {', '.join(defined) or 'none'}); "
                                   "fix the function name")
    return fn


def _load_file(file: Path) -> ModuleType:
    stem = re.sub(r"\W", "_", file.stem)
    name = f"coda_reference_{stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered first, as an import would: dataclasses and torch.compile look it up
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - reported with the file, like any import failure
        del sys.modules[name]
        raise ReferenceImportError(f"cannot import {file} ({type(e).__name__}: {e}); fix the file") from None
    finally:
        sys.path.remove(str(file.parent))
    return module


# --------------------------------------------------------------------------- the dependency closure

@dataclass
class _File:
    path: Path
    lines: list[str]
    body: list[ast.stmt]
    docstring: ast.stmt | None  # the module docstring's statement
    defs: dict[str, int] = field(default_factory=dict)  # top-level name -> index of its statement


@lru_cache(maxsize=64)
def _parse(path: Path) -> _File:
    source = path.read_text()
    tree = parse(source)
    doc = tree.body[0] if tree.body and ast.get_docstring(tree) is not None else None
    f = _File(path, source.splitlines(), tree.body, doc)
    for i, stmt in enumerate(tree.body):
        for name in _defined_names(stmt):
            f.defs.setdefault(name, i)
    return f


def _defined_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    if isinstance(stmt, ast.ImportFrom) and stmt.module != "__future__":
        return [a.asname or a.name for a in stmt.names]
    return []


def _imported(f: _File, stmt: ast.Import | ast.ImportFrom, name: str, root: Path) -> tuple[Path, str | None] | None:
    """(file, name in it) that the import binding ``name`` brings in from ``root``'s folder, or None
    (a module from elsewhere: torch, the standard library).  The name is None where the import
    binds a whole module (``import helpers``, ``from . import helpers``): all of it is needed."""
    if isinstance(stmt, ast.Import):
        alias = next(a for a in stmt.names if (a.asname or a.name.split(".")[0]) == name)
        module, level, inner = alias.name, 0, None
    else:
        alias = next(a for a in stmt.names if (a.asname or a.name) == name)
        if stmt.module is None:
            module, level, inner = alias.name, stmt.level, None
        else:
            module, level, inner = stmt.module, stmt.level, alias.name
    file = _module_file(f, module, level, root)
    return None if file is None else (file, inner)


def _module_file(f: _File, module: str, level: int, root: Path) -> Path | None:
    if level:
        base = f.path.parent
        for _ in range(level - 1):
            base = base.parent
        candidate = base.joinpath(*module.split(".")).with_suffix(".py")
    else:
        candidate = f.path.parent.joinpath(*module.split(".")).with_suffix(".py")
        if not candidate.is_file():
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                return None
            if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                return None
            candidate = Path(spec.origin)
    candidate = candidate.resolve()
    return candidate if candidate.is_file() and candidate.parent.is_relative_to(root) else None


def _closure(roots: list[tuple[Path, str]]) -> dict[Path, set[int]]:
    """Per file (in first-visit order), the indices of the top-level statements the roots need."""
    root_folder = roots[0][0].parent
    needed: dict[Path, set[int]] = {}
    todo: deque[tuple[Path, str | None]] = deque(roots)
    while todo:
        path, name = todo.popleft()
        f = _parse(path)
        wanted = set(range(len(f.body))) if name is None else {f.defs[name]} if name in f.defs else set()
        for i in sorted(wanted - needed.setdefault(path, set())):
            needed[path].add(i)
            stmt = f.body[i]
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for bound in _defined_names(stmt):
                    if (source := _imported(f, stmt, bound, root_folder)) is not None:
                        todo.append(source)
            else:
                todo += [(path, n.id) for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id in f.defs]
    return {p: idx for p, idx in needed.items() if idx}


def _segment(f: _File, stmt: ast.stmt) -> str:
    """The statement's lines with its decorators and the comment block right above it."""
    start = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
    while start > 1 and f.lines[start - 2].lstrip().startswith("#"):
        start -= 1
    return "\n".join(f.lines[start - 1:stmt.end_lineno])


def _render(f: _File, indices: set[int], header: str) -> str:
    chosen = [f.body[i] for i in sorted(indices)]
    imports = [_segment(f, s) for s in chosen if isinstance(s, (ast.Import, ast.ImportFrom))]
    rest = [_segment(f, s) for s in chosen if not isinstance(s, (ast.Import, ast.ImportFrom))]
    parts = [f"# {header}"]
    if f.docstring is not None:
        parts.append(_segment(f, f.docstring))
    if imports:
        parts.append("\n".join(imports))
    return "\n\n".join(parts) + "\n\n\n" + "\n\n\n".join(rest)


def _roots(fns: list[Callable]) -> tuple[list[tuple[Path, str]], list[str]]:
    """(file, name) of each function that is a top-level definition; the source of those that are not."""
    roots, loose = [], []
    for fn in fns:
        try:
            path = Path(inspect.getsourcefile(fn) or "").resolve()
        except TypeError:
            path = Path()
        if path.is_file() and _parse(path).defs.get(fn.__name__) is not None:
            roots.append((path, fn.__name__))
        else:
            try:
                loose.append(inspect.getsource(fn))
            except (OSError, TypeError):
                loose.append(f"# {getattr(fn, '__qualname__', fn)!s}: no source available")
    return roots, loose


def reference_source(fns: list[Callable]) -> str:
    """The reference functions with everything they use from their folder (module docstring)."""
    roots, loose = _roots(fns)
    blocks = []
    if roots:
        folder = roots[0][0].parent
        for path, indices in _closure(roots).items():
            header = str(path.relative_to(folder)) if path.is_relative_to(folder) else path.name
            blocks.append(_render(_parse(path), indices, header))
    return "\n\n\n".join(blocks + loose).rstrip() + "\n"


def reference_files(fns: list[Callable]) -> list[Path]:
    """The files :func:`reference_source` reads, the reference's own first."""
    roots, _ = _roots(fns)
    return list(_closure(roots)) if roots else []
