"""Cached verdicts: one JSON report per key under ``$CODA_CACHE_DIR`` (default
``~/.cache/coda-agent/verdicts``).

Fail closed.  Reusing a stale PASS is the worst bug a verifier can have, so the
key covers everything a verdict depends on: the program source, the catalogue
version, the library versions (coda_agent, quack, cutlass, torch), the GPU (or
"cpu"), the task spec (shapes, dtypes, tolerance, target) and the verifier's
own configuration.  If any part cannot be computed, :func:`cache_key` raises
and the caller runs uncached.  Harness errors are never cached.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from coda_agent.verifier.report import Report

KEY_FORMAT = 1


class CacheKeyError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("CODA_CACHE_DIR") or Path.home() / ".cache" / "coda-agent" / "verdicts")


def library_versions() -> dict[str, str]:
    from coda_agent.primitives.version import CATALOGUE_VERSION

    out = {"catalogue": CATALOGUE_VERSION}
    for dist in ("coda-agent", "quack-kernels", "nvidia-cutlass-dsl", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            if dist != "coda-agent":
                raise CacheKeyError(f"cannot read the version of {dist}") from None
            import coda_agent

            out[dist] = coda_agent.__version__
    return out


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} sm_{p.major}{p.minor}"


def cache_key(source: str, spec_json: str, config: dict, versions: dict[str, str], device: str) -> str:
    for part, value in (("versions", versions), ("device", device), ("spec", spec_json)):
        if not value:
            raise CacheKeyError(f"cache key part {part!r} is empty")
    blob = json.dumps({"format": KEY_FORMAT, "source": source, "spec": spec_json, "config": config,
                       "versions": versions, "device": device}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def get(key: str) -> Report | None:
    path = cache_dir() / f"{key}.json"
    try:
        report = Report.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None
    if report.cache_key != key:
        return None
    return report.model_copy(update={"cached": True})


def put(key: str, report: Report) -> None:
    if report.outcome == "error":
        return
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(report.model_dump_json(indent=1))
    tmp.replace(d / f"{key}.json")
