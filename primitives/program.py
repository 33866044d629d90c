"""Loading a program's source as a module.

The module is registered in ``sys.modules`` under a name derived from its
source hash: quack resolves epilogues by module when it fingerprints and
compiles them, and the program's line numbers must point at its own file
(``<program:NAME>`` in tracebacks, mapped back by the verifier).
"""

from __future__ import annotations

import hashlib
import linecache
import sys
import types

from .errors import CatalogueError


def load_program(source: str, name: str = "candidate") -> types.ModuleType:
    """Execute ``source`` as a fresh module; catalogue misuse raises CatalogueError."""
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
