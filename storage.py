"""Where coda-agent keeps files, and how it writes them.

A leaf module: it imports nothing from the package, so any layer may use it.

- :func:`write_atomic` / :func:`write_json`: a temp file in the target's
  directory, fsynced, then ``os.replace``: a reader (or a run resumed after a
  kill) sees the old file or the new one, never half of one.
- :func:`cache_dir`: one root for every cache, ``$CODA_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/coda-agent``, else ``~/.cache/coda-agent``, with one folder
  per kind under it (``verdicts``, ``compile``, ``tuning``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (its folder is made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """:func:`write_atomic` of ``data`` as indented JSON (anything else as its ``str``)."""
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def cache_dir(kind: str, environ: Mapping[str, str] | None = None) -> Path:
    """The folder of one kind of cache (see the module doc) for the process whose environment is
    ``environ`` (default: this one's); not created here."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    root = env.get("CODA_CACHE_DIR") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                                                     "coda-agent")
    return Path(root) / kind
