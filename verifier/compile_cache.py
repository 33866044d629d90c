"""Cached compile-stage results: one JSON file per key under ``storage.cache_dir("compile")``.

Why: the compile stage recompiles every GEMM of a program for sm_90a in-process
(5-26 s; quack's own disk cache cannot be used because the SASS gate needs the
cubin).  The verdict cache (:mod:`.cache`) only helps when the *whole* verdict
repeats; a second pass over the same program (the GPU pass after a CPU pass, a
re-check with other shape sets or stages) would recompile the same kernels.
This cache keeps the compile stage's passed :class:`StageResult` so that pass
reuses it.

Fail closed, like verdict keys.  The key covers everything the stage's result
depends on: the program source; the task (name and its whole spec, hence the
``cpu_shape_set`` shapes and dtypes the stage compiles for); the catalogue and
library versions (:func:`.cache.library_versions`) plus the cuobjdump wheel
(whether the SASS gate can run); the target (the architecture the compile
path will use and the device, "cpu" without CUDA); and a digest of
coda_agent's own code in ``primitives/``, ``verifier/`` and ``tasks/``: the
tile configuration a GEMM compiles with is chosen there
(``primitives.tile_config.default_config``; the compile lowering never reads the
tuning cache), and that code changes without a version bump.  If any part
cannot be computed, :func:`compile_key` raises and the stage runs uncached.
The stage's random input values are not part of the key: under the compile
lowering, kernels depend on shapes and dtypes only.

Only passed results are stored (a failure is cheap to reproduce, and its log
is the point).  A hit is marked in the result: ``details["cached"]``,
``details["compile_seconds"]`` (the original compile time) and a note in the
message; the stage's ``seconds`` is the time the hit took.  The kernels a
result describes are the runner's report (:mod:`.runner`), so a program that
took over its runner could store a passed compile under its own source: it
can fake its own compile stage, a diagnostic, never its correctness or speed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

from coda_agent import storage
from coda_agent.tasks.spec import Task
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier.report import StageResult
from coda_agent.versions import versions as installed_versions

KEY_FORMAT = 2


def cache_dir() -> Path:
    return storage.cache_dir("compile")


def target() -> dict[str, str]:
    """The architecture the compile path targets, and the device it runs on."""
    import torch

    from coda_agent.primitives import compile_target

    return {"arch": compile_target(), "device": verdict_cache.device_name(torch.cuda.is_available())}


def compile_key(task: Task, source: str) -> str:
    """The fail-closed key of the compile stage's result; raises if a part is unknown."""
    # An absent cuobjdump skips the SASS gate, and the result says so.
    versions = {**verdict_cache.library_versions(), **installed_versions(("nvidia-cuda-cuobjdump",))}
    spec = task.spec
    blob = json.dumps({"format": KEY_FORMAT, "stage": "compile", "source": source, "task": task.name,
                       "spec": spec.model_dump_json(), "shape_set": spec.cpu_shape_set,
                       "shapes": spec.shapes[spec.cpu_shape_set], "versions": versions,
                       "target": target(), "code": verdict_cache.code_digest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def get(key: str) -> StageResult | None:
    """The stored passed result for ``key``, marked as a hit; None on a miss or an unreadable file."""
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        if data.get("format") != KEY_FORMAT or data.get("key") != key:
            return None
        res = StageResult.model_validate(data["result"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if res.name != "compile" or res.status != "passed":
        return None
    details = {**res.details, "cached": True, "compile_seconds": res.seconds,
               "cached_utc": data.get("created_utc", "")}
    return res.model_copy(update={
        "details": details, "seconds": 0.0,
        "message": f"{res.message} (reused from the compile cache: identical source, task, libraries "
                   f"and target; the compile took {res.seconds:.1f} s)"})


def put(key: str, result: StageResult) -> None:
    """Store a passed result atomically; any failure to write just means no cache."""
    if result.name != "compile" or result.status != "passed":
        return
    try:
        payload = json.dumps({"format": KEY_FORMAT, "key": key,
                              "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
                              "result": result.model_dump()}, indent=1)
        storage.write_atomic(cache_dir() / f"{key}.json", payload)
    except (OSError, TypeError, ValueError):
        pass
