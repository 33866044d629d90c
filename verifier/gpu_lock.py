"""Sharing one GPU between candidates verified side by side.

Most of a verification is CPU work (static checks, the reference lowering,
compiling for sm_90a), so several candidates are checked at once: ``solve
--samples`` gives each trajectory a judge of its own, and two commands may
share a machine.  The GPU stages then need an order.  (``eval`` gives each
GPU one verification thread, so inside a batch the lock is never contended.)  The performance stage must have the device alone,
or a neighbour's kernels would be timed with the candidate's; so must
correctness, which sizes its shape sets to the free memory (seen on the H200:
with three candidates side by side, one neighbour's 70B-shape tensors left a
candidate checking only its small sets).  The launch audit runs small shapes
and only reads its own process's kernels, so it may share.  A reader-writer
lock on one file per device does this across processes: ``flock(LOCK_SH)``
for sharing stages, ``flock(LOCK_EX)`` for the others.  The lock dies with
its process, so a crashed candidate never wedges the batch.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

EXCLUSIVE_STAGES = frozenset({"correctness", "performance"})
SHARED_STAGES = frozenset({"launch_audit"})


def lock_path() -> str:
    """``CODA_GPU_LOCK``, else one file per visible device in the temp dir."""
    if path := os.environ.get("CODA_GPU_LOCK"):
        return path
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
    return os.path.join(tempfile.gettempdir(), f"coda-agent-gpu-{device}.lock")


@contextmanager
def gpu_lock(stage: str) -> Iterator[list[float]]:
    """Hold the device lock a stage needs (none for CPU stages); yields a
    one-element list with the seconds spent waiting for it."""
    waited = [0.0]
    if stage not in EXCLUSIVE_STAGES | SHARED_STAGES:
        yield waited
        return
    mode = fcntl.LOCK_EX if stage in EXCLUSIVE_STAGES else fcntl.LOCK_SH
    t0 = time.perf_counter()
    with open(lock_path(), "a") as fh:
        fcntl.flock(fh, mode)
        waited[0] = time.perf_counter() - t0
        try:
            yield waited
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
