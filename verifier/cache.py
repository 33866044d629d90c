"""Cached verdicts: one signed JSON report per key under ``storage.cache_dir("verdicts")``
(default ``~/.cache/coda-agent/verdicts``).

Fail closed.  Reusing a stale PASS is the worst bug a verifier can have, so the
key covers everything a verdict depends on: the program source; the task spec
(shapes, dtypes, tolerance, target); the reference's source, as the digest of
every ``.py`` file in its module's folder (a superset of what it imports from
there, and so of every file of its dependency closure,
``Task.reference_files``: an edited helper misses the cache too); a digest of the verifier's own
code and of the catalogue and task code it runs (:func:`code_digest`); the
catalogue and library versions; the GPU (or "cpu") and, on a GPU, the tuned
tile configurations its runners are given (:func:`tuned_configs`); and the
verifier's configuration.  If any part cannot be computed, :func:`cache_key`
raises and the caller runs uncached.  Harness errors are never cached.  Whether there is
a GPU is decided outside the key (:func:`cuda_available`): a failing version
lookup loses the cache, never the GPU.

Signed: each entry carries an HMAC-SHA256 of the report under a key kept in
``<dir>/.key`` (mode 0600, made on first use).  A file the program managed to
write (it cannot, behind the runner's walls: :mod:`.sandbox`) would need that
key to be served; an unsigned or altered entry is a miss.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import inspect
import json
import os
import secrets
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from coda_agent import storage
from coda_agent.syntax import parse
from coda_agent.verifier.report import Report
from coda_agent.versions import ABSENT, versions

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task

KEY_FORMAT = 2
# The folders of coda_agent (relative to the package root) whose code no verdict depends on: the
# agent loop, batch evaluation, benchmarks and tests.  Every other ``*.py`` file counts, top-level
# modules included (program_rules.py holds the rules, kernels/contract.py calls the program), so a
# rule that moves to a module of its own still changes the key.
NOT_JUDGING = ("agent", "eval", "bench", "tests", "runs", "scripts")


class CacheKeyError(RuntimeError):
    pass


def cache_dir() -> Path:
    return storage.cache_dir("verdicts")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_name(gpu: bool, index: int = 0) -> str:
    if not gpu:
        return "cpu"
    import torch

    p = torch.cuda.get_device_properties(index)
    return f"{p.name} sm_{p.major}{p.minor}"


def tuned_configs() -> dict[str, bytes]:
    """The tuning cache's entries, ``{file name: contents}`` (``storage.cache_dir("tuning")``:
    the tile winners ``bench/run.py`` or ``autotune()`` stored).  A GPU runner gets its own copy
    (:func:`coda_agent.verifier.remote.seed_tuned_configs`), so its ``gemm(config=None)`` calls
    run at the tuned tiles, and their digest is part of a GPU verdict's key: tuning again is a
    new verdict, never a stale one."""
    folder = storage.cache_dir("tuning")
    try:
        return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}
    except OSError:
        return {}


def tuned_digest(entries: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name, data in sorted(entries.items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def catalogue_version() -> str:
    """``primitives/version.py``'s CATALOGUE_VERSION, read from its source: the harness
    never imports the catalogue (it runs programs only in the judge's runners)."""
    import coda_agent

    path = Path(coda_agent.__file__).resolve().parent / "primitives" / "version.py"
    for node in parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CATALOGUE_VERSION" for t in node.targets):
            return ast.literal_eval(node.value)
    raise CacheKeyError(f"{path} defines no CATALOGUE_VERSION")


def library_versions() -> dict[str, str]:
    out = {"catalogue": catalogue_version(), **versions()}
    for dist, version in out.items():
        if version == ABSENT:
            raise CacheKeyError(f"cannot read the version of {dist}")
    return out


def code_files() -> tuple[Path, list[Path]]:
    """The package root and the ``*.py`` files a verdict may depend on: all but those under
    :data:`NOT_JUDGING` and hidden folders (a virtualenv, git's)."""
    import coda_agent

    root = Path(coda_agent.__file__).resolve().parent
    tops = [t for t in root.iterdir() if t.name not in NOT_JUDGING and not t.name.startswith(".")]
    files = [p for t in tops for p in ([t] if t.is_file() else t.rglob("*.py")) if p.suffix == ".py"
             and not any(x.startswith(".") or x == "__pycache__" for x in p.relative_to(root).parts)]
    return root, sorted(files)


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over :func:`code_files` (paths and contents)."""
    root, files = code_files()
    if not files:
        raise CacheKeyError(f"no source files under {root} to fingerprint")
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def reference_files(task: "Task") -> dict[str, str]:
    """{file: sha256} of every ``.py`` file beside the task's reference functions' modules."""
    fns = [task.reference_fn] + ([task.backward_reference_fn] if task.backward_reference_fn else [])
    folders = {Path(inspect.getsourcefile(fn) or "").resolve().parent for fn in fns}
    out = {}
    for folder in sorted(folders):
        files = sorted(folder.glob("*.py"))
        if not files:
            raise CacheKeyError(f"cannot find the reference's source files (looked in {folder})")
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


def cache_key(source: str, task: "Task", config: dict, versions: dict[str, str]) -> str:
    spec_json = task.spec.model_dump_json()
    for part, value in (("versions", versions), ("device", versions.get("device")), ("spec", spec_json)):
        if not value:
            raise CacheKeyError(f"cache key part {part!r} is empty")
    blob = json.dumps({"format": KEY_FORMAT, "source": source, "spec": spec_json, "config": config,
                       "versions": versions, "code": code_digest(), "reference": reference_files(task)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _secret() -> bytes:
    path = cache_dir() / ".key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
        os.link(tmp, path)  # atomic: the first process to link wins, the others read its key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path.read_bytes()


def _mac(body: str) -> str:
    return hmac.new(_secret(), body.encode(), hashlib.sha256).hexdigest()


def get(key: str) -> Report | None:
    try:
        entry = json.loads((cache_dir() / f"{key}.json").read_text())
        body, mac = entry["report"], entry["mac"]
        if not isinstance(body, str) or not hmac.compare_digest(str(mac), _mac(body)):
            return None
        report = Report.model_validate_json(body)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if report.cache_key != key:
        return None
    return report.model_copy(update={"cached": True})


def put(key: str, report: Report) -> None:
    if report.outcome == "error":
        return
    body = report.model_dump_json()
    try:
        storage.write_atomic(cache_dir() / f"{key}.json", json.dumps({"report": body, "mac": _mac(body)}))
    except OSError:
        pass  # a cache that cannot be written is no cache; the verdict stands
