"""The judge: the trusted process that decides every stage after the static one.

``python -m coda_agent.verifier.judge FD [--compiles]`` reads check requests from the
harness (:mod:`.harness`), one JSON line each on stdin, and writes a JSON line
per event on file descriptor FD: ``{"check": n, "start": stage}``, ``{"check": n,
"waiting": stage}`` / ``{"check": n, "waited": seconds}`` around a wait for
the GPU lock, ``{"check": n, "result": StageResult}``, and ``{"check": n,
"done": {...}}``.  It never executes candidate code: it loads the task and
its reference, draws inputs from seeds it draws itself, runs the reference,
asks the check's runner (:mod:`.remote`, :mod:`.runner`) to call the program,
compares, times the baselines and decides.

Time: a check's ``timeout_s`` is what the runner may spend answering (its
calls, compiles and timed loops), not what the judge spends on references,
baselines or waiting for the GPU lock; each program load has its own
``load_timeout_s``.  A runner past either is killed and the stage fails with
the reason.  The judge is non-dumpable: a runner that keeps the judge's uid
still cannot read or write its memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

_PR_SET_DUMPABLE = 4


def _machine_has_gpu() -> bool:
    """The judge's first guess, before torch is imported (the same test the catalogue makes)."""
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x")) and os.path.exists("/dev/nvidia0")


def allocator_settings() -> None:
    """The judge's CUDA allocator grows its segments in place (PyTorch's expandable segments),
    unless the user chose otherwise: a fixed-segment cache fragments under the references'
    logits-sized fp32 tensors (an H100's judge for lm_head_xent_softcap at llama3-8b ran out of
    memory holding 11.8 GiB reserved but unallocated, with 52.5 GiB allocated).  The judge only
    imports runner memory over CUDA IPC and exports none (:mod:`.cuda_ipc`), which is what an
    expandable segment cannot do; runners keep fixed segments (``sandbox.runner_env``).  Read
    when CUDA starts: called before torch is imported."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main(events_fd: int, compiles: bool) -> int:
    """``compiles``: the checks may run the compile stage, so the runner zygote loads the compile
    lowering's libraries once (:mod:`.zygote`)."""
    from coda_agent.verifier import sandbox, strays

    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    strays.adopt()  # no process a runner starts leaves the judge's tree (strays.py)
    allocator_settings()
    sandbox.prune_kernel_caches(time.time())
    zygote = None
    if not _machine_has_gpu():  # its imports overlap the judge's own
        from coda_agent.verifier.zygote import Zygote

        zygote = Zygote(compiles)
        zygote.start()
    import torch

    from coda_agent.verifier.check import Judge

    torch.set_num_threads(1)  # see sandbox.RUNNER_ENV: judge and runner take turns on the CPU
    events = os.fdopen(events_fd, "w", buffering=1)

    def emit(obj: dict[str, Any]) -> None:
        events.write(json.dumps(obj) + "\n")
        events.flush()

    judge = Judge(emit, zygote, compiles)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            judge.check(req["check"], req)
            if judge.broken:
                return 3
    finally:
        judge.close()
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]), "--compiles" in sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written; an interpreter holding torch and CUDA takes seconds to tear down
