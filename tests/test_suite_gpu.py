"""GPU tier: every expert program of the packaged suites (LLaMA-3, GPT-2)
through the whole verifier on a Hopper GPU (all six stages), twice: the first check compiles
(cold), the second finds quack's compile cache warm and the verdict cache
disabled, which is the cost of verifying a new candidate of a known shape.
Shape sets: CODA_GPU_SHAPE_SETS (comma-separated; a set a task lacks is
skipped), by default small, ragged and each suite's two smallest benchmark
sets.  With CODA_GPU_RESULTS set, each report and the timings are written there
for the repo's records (bench/results/)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from coda_agent.tasks import BENCH_SETS, SUITES, load_suite
from coda_agent.verifier import Verifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TASKS = {f"{suite}/{t.name}": t for suite, folder in SUITES.items() for t in load_suite(folder)}
SHAPE_SETS = os.environ.get("CODA_GPU_SHAPE_SETS")


def _shape_sets(suite: str) -> tuple[str, ...]:
    return tuple(SHAPE_SETS.split(",")) if SHAPE_SETS else ("small", "ragged", *BENCH_SETS[suite][:2])


@pytest.mark.parametrize("name", sorted(TASKS))
def test_expert_is_accepted_on_hopper(name):
    task = TASKS[name]
    source = task.expert_path.read_text()
    verifier = Verifier(cache=False, shape_sets=_shape_sets(name.split("/")[0]))
    t0 = time.perf_counter()
    cold = verifier.check(task, source)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = verifier.check(task, source)
    t_warm = time.perf_counter() - t0
    out = os.environ.get("CODA_GPU_RESULTS")
    if out:
        os.makedirs(os.path.join(out, "reports"), exist_ok=True)
        with open(os.path.join(out, "reports", f"{name.replace('/', '-')}.json"), "w") as fh:
            fh.write(warm.model_dump_json(indent=1))
        with open(os.path.join(out, "verify_times.jsonl"), "a") as fh:
            fh.write(json.dumps({"task": name, "cold_s": round(t_cold, 1), "warm_s": round(t_warm, 1),
                                 "stages_s": {s.name: round(s.seconds, 1) for s in warm.stages}}) + "\n")
    for report in (cold, warm):
        failed = report.failed_stage
        assert report.outcome == "accepted", (failed.name, failed.message) if failed else report.outcome
