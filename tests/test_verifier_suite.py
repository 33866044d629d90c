"""Every packaged suite's expert programs (LLaMA-3, GPT-2, LLaMA-3 FP8) through the real
verifier: on the CPU every one passes the static and reference stages on every CPU shape set
(small, ragged, the beyond set, each with two fresh draws and edge rows), and a one-token slip
of an expert fails, all judged by one judge."""

from __future__ import annotations

import pytest
from test_suite_fp8 import SUITE as FP8_SUITE

from coda_agent.tasks import SUITES, load_suite
from coda_agent.verifier import Verifier

FOLDERS = {**SUITES, "llama3_fp8": FP8_SUITE}
SUITE = {f"{suite}/{t.name}": t for suite, folder in FOLDERS.items() for t in load_suite(folder)}


@pytest.fixture(scope="module")
def judged():
    with Verifier(stages=["static", "reference"], cache=False, timeout_s=300) as v:
        yield v


@pytest.mark.parametrize("name", sorted(SUITE))
def test_expert_passes_every_cpu_shape_set(name, judged):
    task = SUITE[name]
    report = judged.check(task, task.expert_path.read_text())
    bad = [f"{s.name}: {s.message}" for s in report.stages if s.status != "passed"]
    assert report.outcome == "cpu_passed" and not bad, f"{name}: {report.outcome} {bad}"
    sets = report.stage("reference").details["shape_sets"]
    assert {"small", "ragged", "ragged+256"} <= set(sets), sets


def test_an_fp8_expert_that_drops_a_scale_is_rejected(judged):
    task = SUITE["llama3_fp8/swiglu_fwd_fp8"]
    source = task.expert_path.read_text()
    mutant = source.replace("acc * x_scale * w_scale", "acc * x_scale")
    assert mutant != source
    res = judged.check(task, mutant).stage("reference")
    assert res.status == "failed" and "differs from the reference" in res.message
