"""Every program in tests/bad_programs/ is rejected at the stage its header names,
with a message containing its ``# expect:`` text; the expert program passes.

Static and reference cases run in CI (CPU only); reference cases run the stage
in-process for speed (the harness's child process is tested in
test_verifier_harness.py); compile cases are marked slow, GPU cases gpu.
"""

from __future__ import annotations

import pytest
import torch
from verifier_helpers import EXPERT_PATH, TASK_PATH, corpus

from coda_agent.tasks.spec import load_task
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.report import Report
from coda_agent.verifier.static import check_source

CASES = corpus()


def _id(case) -> str:
    return case.path.stem


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


def test_corpus_is_large_enough():
    assert len(CASES) >= 25
    assert {c.stage for c in CASES} >= {"static", "reference"}


def test_expert_passes_static(task):
    assert check_source(EXPERT_PATH.read_text(), task.spec) == []


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "static"], ids=_id)
def test_static_rejects(case, task):
    violations = check_source(case.source, task.spec)
    assert violations, f"{case.path.name} passed the static stage"
    text = "; ".join(str(v) for v in violations)
    assert case.expect in text
    lines = case.source.splitlines()
    assert 1 <= violations[0].line <= len(lines)


def _run_stage(task, source: str, stage: str):
    from coda_agent.verifier.stages import STAGE_FUNCTIONS, Context

    ctx = Context(task=task, source=source, seeds=[1234, 5678], shape_sets=["small", "ragged"])
    return STAGE_FUNCTIONS[stage](ctx)


def test_expert_passes_reference(task):
    res = _run_stage(task, EXPERT_PATH.read_text(), "reference")
    assert res.status == "passed", res.message


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "reference" and "timed out" not in c.expect],
                         ids=_id)
def test_reference_rejects(case, task):
    assert check_source(case.source, task.spec) == [], "reference-stage cases must pass static"
    res = _run_stage(task, case.source, "reference")
    assert res.status == "failed", f"{case.path.name}: {res.message}"
    assert case.expect in res.message
    report = Report(task=task.name, program_sha256="x", outcome="rejected", stages=[res])
    feedback = render_feedback(report, case.source)
    assert "reference" in feedback and case.expect in feedback


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.needs == "compile"], ids=_id)
def test_compile_rejects(case, task):
    res = _run_stage(task, case.source, "compile")
    assert res.status == "failed" and case.expect in res.message, res.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in CASES if c.needs == "gpu"], ids=_id)
def test_gpu_rejects(case, task):
    from coda_agent.verifier import Verifier

    report = Verifier(cache=False, fail_on_target=True, shape_sets=["small", "ragged"]).check(task, case.source)
    bad = report.failed_stage
    assert bad is not None and bad.name == case.stage, report.model_dump_json(indent=1)
    assert case.expect in bad.message
