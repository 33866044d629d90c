"""Loading a program's source as a module.

The module is registered in ``sys.modules`` under a name derived from its
source hash: quack resolves epilogues by module when it fingerprints and
compiles them, and the program's line numbers must point at its own file
(``<program:NAME>`` in tracebacks, mapped back by the verifier).

The module runs with the builtins a program may name and no others
(``program_rules.BUILTINS``), and an ``__import__`` that finds only the
catalogue and ``math``: the verifier's static stage refuses the rest, and
this is the same rule where the code runs, so a construct the static stage
misreads (a name it resolves in the wrong scope) still finds no ``eval``,
``getattr`` or ``vars`` to escape with.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import linecache
import math
import sys
import types

from coda_agent.program_rules import BUILTINS, CATALOGUE_MODULE, MATH_MODULE, MESSAGE_BUILTINS, PROGRAM_API

from .errors import CatalogueError


def _import(name: str, globals=None, locals=None, fromlist=(), level: int = 0) -> types.ModuleType:  # noqa: A002
    """The ``import`` statement inside a program: the catalogue and ``math``, nothing else."""
    if level == 0 and name == MATH_MODULE:
        return math
    if level == 0 and name == CATALOGUE_MODULE and fromlist:
        return _catalogue_view()
    if level == 0 and isinstance(fromlist, list) and name in sys.modules:
        # C code fetching a module through the running frame's builtins (PyImport_Import passes a
        # list; an import statement, a tuple or None): PyTorch's operators on a Python number
        # look up `torch`.  Only what the process has loaded already; nothing new runs.
        return sys.modules[name]
    raise ImportError(f"import of `{'.' * level}{name}`: programs may import only `from {CATALOGUE_MODULE} "
                      f"import ...` and `{MATH_MODULE}`")


@functools.cache
def _catalogue_view() -> types.ModuleType:
    """What ``from coda_agent.primitives import NAME`` finds in a program: the program API, not
    the package (whose submodules and harness entry points are the verifier's)."""
    catalogue = sys.modules[CATALOGUE_MODULE]
    view = types.ModuleType(f"{CATALOGUE_MODULE} (as programs see it)")
    for name in PROGRAM_API:
        setattr(view, name, getattr(catalogue, name))
    return view


PROGRAM_BUILTINS = types.MappingProxyType({**{n: getattr(builtins, n) for n in BUILTINS | MESSAGE_BUILTINS},
                                           "__import__": _import})


def load_program(source: str, name: str = "candidate", python_rules: bool = True) -> types.ModuleType:
    """Execute ``source`` as a fresh module; catalogue misuse raises CatalogueError.
    ``python_rules=False`` gives it Python's own builtins: a verifier run without its static
    stage, whose tests stand in for a program that got past every Python rule."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"coda_program_{digest}"
    filename = f"<program:{name}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as e:
        raise CatalogueError(f"syntax error: {e.msg}", line=e.lineno) from None
    # inspect.getsource (used to validate and fingerprint epilogue fns) reads linecache.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(mod_name)
    module.__file__ = filename
    if python_rules:
        module.__builtins__ = dict(PROGRAM_BUILTINS)  # a copy per program: one cannot edit another's
    sys.modules[mod_name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - the verifier's static stage vetted the source
    except CatalogueError as e:
        del sys.modules[mod_name]
        e.line = e.line or _program_line(e, filename)
        raise
    except Exception as e:  # noqa: BLE001 - report any load-time failure with its line
        del sys.modules[mod_name]
        raise CatalogueError(f"loading the program failed: {type(e).__name__}: {e}",
                             line=_program_line(e, filename)) from None
    return module


def _program_line(exc: BaseException, filename: str) -> int | None:
    """The innermost line of the program's own file in the traceback."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
