"""GPU tier: every expert program of the LLaMA-3 suite through the whole
verifier on a Hopper GPU (all six stages), twice: the first check compiles
(cold), the second finds quack's compile cache warm and the verdict cache
disabled, which is the cost of verifying a new candidate of a known shape.
With CODA_GPU_RESULTS set, each report and the timings are written there for
the repo's records (bench/results/)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from coda_agent.tasks import SUITE_DIR, load_suite
from coda_agent.verifier import Verifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SUITE = {t.name: t for t in load_suite(SUITE_DIR)}
SHAPE_SETS = tuple(os.environ.get("CODA_GPU_SHAPE_SETS", "small,ragged,llama3-1b,llama3-8b").split(","))


@pytest.mark.parametrize("name", sorted(SUITE))
def test_expert_is_accepted_on_hopper(name):
    task = SUITE[name]
    source = task.expert_path.read_text()
    verifier = Verifier(cache=False, shape_sets=SHAPE_SETS)
    t0 = time.perf_counter()
    cold = verifier.check(task, source)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = verifier.check(task, source)
    t_warm = time.perf_counter() - t0
    out = os.environ.get("CODA_GPU_RESULTS")
    if out:
        os.makedirs(os.path.join(out, "reports"), exist_ok=True)
        with open(os.path.join(out, "reports", f"{name}.json"), "w") as fh:
            fh.write(warm.model_dump_json(indent=1))
        with open(os.path.join(out, "verify_times.jsonl"), "a") as fh:
            fh.write(json.dumps({"task": name, "cold_s": round(t_cold, 1), "warm_s": round(t_warm, 1),
                                 "stages_s": {s.name: round(s.seconds, 1) for s in warm.stages}}) + "\n")
    for report in (cold, warm):
        failed = report.failed_stage
        assert report.outcome == "accepted", (failed.name, failed.message) if failed else report.outcome
