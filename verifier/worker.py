"""The child process that runs a candidate: ``python -m coda_agent.verifier.worker REQUEST RESULTS``.

REQUEST is a JSON file (task path, program source, stages, secret seeds,
config); RESULTS a JSONL file the worker appends to as it goes: a
``{"start": stage}`` line before each stage and the StageResult after it.  If
the candidate hangs or kills the process (a segfault, an illegal memory access
that aborts), the harness reads the last ``start`` without a result and blames
that stage: the verdict survives the process.
"""

from __future__ import annotations

import json
import sys
import traceback

from coda_agent.verifier.report import GPU_STAGES, StageResult


def _append(path: str, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()


def _release_gpu_memory(stage: str) -> None:
    """Hand the caching allocator's blocks back before giving up the GPU lock:
    a candidate waiting for its next GPU stage must not hold the memory that a
    neighbour's correctness stage sizes its shape sets by."""
    import torch

    if stage in GPU_STAGES and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(request_path: str, results_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    from coda_agent.tasks.spec import load_task
    from coda_agent.verifier.gpu_lock import gpu_lock
    from coda_agent.verifier.stages import STAGE_FUNCTIONS, Context

    task = load_task(req["task_path"])
    ctx = Context(task=task, source=req["source"], seeds=req["seeds"], shape_sets=req["shape_sets"],
                  reps=req["reps"], fail_on_target=req["fail_on_target"],
                  compile_cache=req.get("compile_cache", False))
    for stage in req["stages"]:
        _append(results_path, {"start": stage})
        try:
            with gpu_lock(stage) as waited:  # other candidates may be verified side by side
                res = STAGE_FUNCTIONS[stage](ctx)
                _release_gpu_memory(stage)
            if waited[0] > 0.01:
                res.details["gpu_wait_s"] = round(waited[0], 2)
        except Exception as e:  # noqa: BLE001 - an escape from a stage is the harness's bug
            res = StageResult(name=stage, status="error",
                              message=f"verifier error in stage {stage}: {type(e).__name__}: {e}",
                              log=traceback.format_exc()[-4000:])
        _append(results_path, {"result": res.model_dump()})
        if res.status in ("failed", "error"):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
