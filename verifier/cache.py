"""Cached verdicts: one JSON report per key under ``storage.cache_dir("verdicts")``
(default ``~/.cache/coda-agent/verdicts``).

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
from pathlib import Path

from coda_agent import storage
from coda_agent.verifier.report import Report
from coda_agent.versions import ABSENT, versions

KEY_FORMAT = 1


class CacheKeyError(RuntimeError):
    pass


def cache_dir() -> Path:
    return storage.cache_dir("verdicts")


def library_versions() -> dict[str, str]:
    from coda_agent.primitives.version import CATALOGUE_VERSION

    out = {"catalogue": CATALOGUE_VERSION, **versions()}
    for dist, version in out.items():
        if version == ABSENT:
            raise CacheKeyError(f"cannot read the version of {dist}")
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
    storage.write_atomic(cache_dir() / f"{key}.json", report.model_dump_json(indent=1))
