"""GPU tier: every expert program of the packaged suites (LLaMA-3, GPT-2) through the whole
verifier on a Hopper GPU, every shape set of its task that fits (on an H200: all of them),
speed targets included: each must be *accepted*.  Twice, by one judge: the first check
compiles (cold), the second finds the program's kernel cache warm (the verdict cache is off),
the cost of verifying a candidate again.  CODA_GPU_SHAPE_SETS (comma-separated) narrows the
sets for a quicker pass.  With CODA_GPU_RESULTS set, each report and every stage's cost,
cold and warm, are written there for the repo's records (bench/results/)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from coda_agent.tasks import SUITES, load_suite
from coda_agent.verifier import Verifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SUITE = {f"{suite}/{t.name}": t for suite, folder in SUITES.items() for t in load_suite(folder)}
SHAPE_SETS = os.environ.get("CODA_GPU_SHAPE_SETS")


def _details(report, stage: str) -> dict:
    """A stage's details; {} for a stage that did not run."""
    found = report.stage(stage)
    return (found.details or {}) if found is not None else {}


@pytest.fixture(scope="module")
def judged():
    sets = tuple(SHAPE_SETS.split(",")) if SHAPE_SETS else None
    with Verifier(cache=False, shape_sets=sets) as v:
        yield v


@pytest.mark.parametrize("name", sorted(SUITE))
def test_expert_is_accepted_on_hopper(name, judged):
    task = SUITE[name]
    source = task.expert_path.read_text()
    t0 = time.perf_counter()
    cold = judged.check(task, source)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = judged.check(task, source)
    t_warm = time.perf_counter() - t0
    out = os.environ.get("CODA_GPU_RESULTS")
    if out:
        os.makedirs(os.path.join(out, "reports"), exist_ok=True)
        with open(os.path.join(out, "reports", f"{name.replace('/', '-')}.json"), "w") as fh:
            fh.write(warm.model_dump_json(indent=1))
        with open(os.path.join(out, "verify_times.jsonl"), "a") as fh:
            fh.write(json.dumps({"task": name, "cold_s": round(t_cold, 1), "warm_s": round(t_warm, 1),
                                 "cold_stages_s": {s.name: s.seconds for s in cold.stages},
                                 "warm_stages_s": {s.name: s.seconds for s in warm.stages},
                                 "shape_sets": _details(warm, "correctness").get("shape_sets"),
                                 "performance": _details(warm, "performance"),
                                 "sandbox": warm.versions.get("sandbox")}) + "\n")
    for report in (cold, warm):
        failed = next((s for s in report.stages if s.status != "passed"), None)
        assert report.outcome == "accepted", (failed.name, failed.status, failed.message) if failed else report
        if not SHAPE_SETS:
            assert not _details(report, "correctness").get("skipped_shape_sets")
    assert t_warm < 90, f"{name}: a warm verification took {t_warm:.0f} s"
