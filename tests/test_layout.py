"""The shape of the code, held by its imports (ast, nothing is imported).

- The import graph between folders runs one way: primitives <- tasks <-
  kernels <- verifier <- agent <- eval, with bench and the ``coda-agent``
  command (``cli.py``) on top.  A module imports only from its own folder,
  the folders below it and the leaf modules; an import inside a function
  counts the same as one at the top (a lazy import upward is still a cycle).
- The leaf modules at the top level (``errors``, ``storage``, ``versions``,
  ``devices``, ``program_rules``) import nothing from the package but each
  other and its version string, so every folder may use them.
- No module is longer than 500 lines.
- No CLI module imports another module's private (``_name``) functions: what
  two commands share is public, in the module that owns it.

ARCHITECTURE.md states the same order, and every file or folder it names
exists; a failure names the module, the line and the import.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "coda_agent"
ORDER = ("primitives", "tasks", "kernels", "verifier", "agent", "eval", "bench", "cli")
LEAVES = ("errors", "storage", "versions", "devices", "program_rules", "syntax")
MAX_LINES = 500


def _sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def _package_modules() -> list[Path]:
    return [p for p in _sources() if p.relative_to(ROOT).parts[0] != "tests"]


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> list[tuple[int, list[str], list[str]]]:
    return _imports_in(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_in(source: str, module: list[str], is_package: bool) -> list[tuple[int, list[str], list[str]]]:
    """(line, the package-relative module imported, the names taken from it) for every import of
    the package in ``source`` (module ``module``), relative ones resolved."""
    package = module if is_package else module[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    out.append((node.lineno, parts[1:], []))
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package[:len(package) - node.level + 1]
                out.append((node.lineno, base + (node.module.split(".") if node.module else []), names))
            elif (node.module or "").split(".")[0] == PACKAGE:
                out.append((node.lineno, node.module.split(".")[1:], names))
    return sorted(out)


def _layer(parts: list[str]) -> str | None:
    """The folder (or top-level module) a package-relative module belongs to; None: the package root."""
    return parts[0] if parts else None


def test_the_import_graph_between_folders_runs_one_way():
    bad = []
    for path in _package_modules():
        mine = _layer(_module_name(path))
        if mine in LEAVES or mine not in ORDER:
            continue  # leaves have their own test; the package root imports lazily, on use
        for line, target, names in _imports(path):
            theirs = _layer(target)
            if theirs is None or theirs in LEAVES or theirs == mine:
                continue
            if theirs not in ORDER or ORDER.index(theirs) > ORDER.index(mine):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {'.'.join(target)} ({theirs})")
    assert not bad, "imports against the folder order " + " <- ".join(ORDER) + ":\n" + "\n".join(bad)


def test_leaf_modules_import_nothing_but_leaves():
    bad = []
    for leaf in LEAVES:
        path = ROOT / f"{leaf}.py"
        assert path.is_file(), f"{leaf}.py is a leaf module named in ARCHITECTURE.md"
        for line, target, names in _imports(path):
            if target and target[0] not in LEAVES:
                bad.append(f"{leaf}.py:{line} imports {'.'.join(target)}")
            if not target and set(names) - {"__version__"}:
                bad.append(f"{leaf}.py:{line} imports {names} from the package root")
    assert not bad, "leaf modules must import no folder of the package:\n" + "\n".join(bad)


def test_no_module_is_longer_than_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_the_package_parses_source_only_through_syntax_parse():
    """Verification threads parse programs side by side, and CPython 3.11's ``ast`` can fail when
    two threads parse at once (``syntax.py``): every parse goes through its lock."""
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in _package_modules() if p.name != "syntax.py"
           for n, line in enumerate(p.read_text().splitlines(), 1) if "ast.parse(" in line]
    assert not bad, "parse with coda_agent.syntax.parse, not ast.parse: " + ", ".join(bad)


def test_no_cli_module_imports_another_modules_private_names():
    bad = []
    for path in _package_modules():
        if path.name != "cli.py":
            continue
        for line, target, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {'.'.join(target)}")
    assert not bad, "make what two modules share public where it lives:\n" + "\n".join(bad)


def test_the_checks_see_violations():
    """The parser resolves what the checks rely on: relative imports, lazy ones, private names."""
    source = "import coda_agent.tasks.spec\ndef f():\n    from ..eval.summary import _private\n    from . import rundir\n"
    assert _imports_in(source, ["agent", "probe"], is_package=False) == [
        (1, ["tasks", "spec"], []), (3, ["eval", "summary"], ["_private"]), (4, ["agent"], ["rundir"])]
    assert _imports_in("from .kernel import Kernel\n", ["kernels"], is_package=True) == [
        (1, ["kernels", "kernel"], ["Kernel"])]


def _named_paths(markdown: str) -> set[str]:
    """The repository paths a document names in backticks (``agent/loop.py``, ``tests/``,
    ``tests/test_bench*.py``), leaving out placeholders (``runs/<utc>/``) and paths outside."""
    out = set()
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", markdown, flags=re.S)):
        if "<" in span or span.startswith(("../", "/", "coda::")):
            continue
        for m in re.finditer(r"(?:[\w.*-]+/)+[\w.*-]*|[\w*-]+\.(?:py|md|sh|yaml|toml|txt)\b", span):
            out.add(m.group(0))
    return out


def test_architecture_names_only_files_that_exist():
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    named = _named_paths(doc)
    assert {"agent/loop.py", "tests/bad_programs/", "tests/test_bench*.py"} <= named  # the parser sees them
    run_layout = (ROOT / "agent" / "rundir.py").read_text()  # what a run directory holds

    def exists(p: str) -> bool:  # a name a table row gives inside its folder exists somewhere below
        return bool(list(ROOT.glob(p.rstrip("/"))) or list(ROOT.glob(f"**/{p.rstrip('/')}"))) or p in run_layout
    missing = sorted(p for p in named if not exists(p))
    assert not missing, f"ARCHITECTURE.md names what is not in the tree (keep it true): {missing}"
