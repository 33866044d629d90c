"""The harness around the stages: child process, time limit, crashes, cache, CLI, feedback."""

from __future__ import annotations

import time

import pytest
import torch
from typer.testing import CliRunner
from verifier_helpers import CORPUS, EXPERT_PATH, TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier.compare import compare, pattern_of
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.inputs import make_inputs
from coda_agent.verifier.report import Report
from coda_agent.tasks.spec import Tolerance

CPU_STAGES = ["static", "reference"]


@pytest.fixture(autouse=True)
def verdict_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "verdicts"))
    return tmp_path / "verdicts"


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


def test_expert_cpu_passed_in_child(task):
    report = Verifier(stages=CPU_STAGES, cache=False, timeout_s=120).check(task, EXPERT_PATH.read_text())
    assert report.outcome == "cpu_passed", report.model_dump_json(indent=1)
    assert [s.status for s in report.stages] == ["passed", "passed"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip")
def test_gpu_stages_skipped_never_passed(task):
    report = Verifier(stages=["static", "reference", "correctness", "launch_audit", "performance"],
                      cache=False, timeout_s=120).check(task, EXPERT_PATH.read_text())
    assert report.outcome == "cpu_passed"
    gpu = [s for s in report.stages if s.name in ("correctness", "launch_audit", "performance")]
    assert [s.status for s in gpu] == ["skipped"] * 3
    assert all("no CUDA device: GPU stages skipped" in s.message for s in gpu)


def test_hang_becomes_timeout_verdict(task):
    source = (CORPUS / "reference_infinite_loop.py").read_text()
    limit = 45.0
    t0 = time.perf_counter()
    report = Verifier(stages=CPU_STAGES, cache=False, timeout_s=limit).check(task, source)
    elapsed = time.perf_counter() - t0
    assert elapsed < limit + 10
    bad = report.failed_stage
    assert report.outcome == "rejected" and bad.name == "reference" and bad.status == "failed"
    assert "timed out after 45 s" in bad.message


def test_crash_becomes_verdict(task):
    # A program cannot kill the process itself (static bans os/sys), so simulate a
    # native crash the way an aborting illegal memory access ends: SIGSEGV mid-stage.
    from coda_agent.verifier.harness import _read_results

    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d, "r.jsonl")
        p.write_text(json.dumps({"start": "correctness"}) + "\n")
        res = _read_results(p, "CUDA error: an illegal memory access was encountered", -6, False, 60, 1.0)
    assert res[-1].name == "correctness" and res[-1].status == "failed"
    assert "illegal memory access" in res[-1].message
    res = _read_results(p if p.exists() else Path("/nonexistent"), "", -11, False, 60, 1.0)
    assert res[-1].status == "error"  # never started: the harness's problem, not the candidate's


def test_cache_hit_and_misses(task, verdict_dir, monkeypatch):
    source = EXPERT_PATH.read_text()
    v = Verifier(stages=["static"], cache=True)
    first = v.check(task, source)
    assert not first.cached and first.cache_key
    again = v.check(task, source)
    assert again.cached and again.outcome == first.outcome
    # a different source misses
    assert not v.check(task, source + "\n# changed\n").cached
    # a different catalogue version misses
    import coda_agent.primitives.version as version

    monkeypatch.setattr(version, "CATALOGUE_VERSION", "different")
    assert not v.check(task, source).cached


def test_cache_fails_closed(task, monkeypatch):
    def broken():
        raise verdict_cache.CacheKeyError("no version")

    monkeypatch.setattr(verdict_cache, "library_versions", broken)
    v = Verifier(stages=["static"], cache=True)
    r1 = v.check(task, EXPERT_PATH.read_text())
    r2 = v.check(task, EXPERT_PATH.read_text())
    assert r1.cache_key is None and not r2.cached


def test_static_failure_feedback_quotes_line(task):
    source = (CORPUS / "static_try_except.py").read_text()
    report = Verifier(stages=CPU_STAGES, cache=False).check(task, source)
    assert report.outcome == "rejected" and len(report.stages) == 1
    text = render_feedback(report, source)
    assert "REJECTED at stage `static`" in text and ">" in text and "try:" in text


def test_make_inputs_fresh_and_never_zero(task):
    a = make_inputs(task.spec, "small", 1)
    b = make_inputs(task.spec, "small", 2)
    assert all(v.abs().sum() > 0 for v in a.values())
    assert not torch.equal(a["x"], b["x"])
    assert a["w"].shape == (128, 96) and a["w"].dtype == torch.bfloat16


@pytest.mark.parametrize("mutate,want", [
    (lambda o: o.__setitem__((slice(None), slice(1, None, 2)), 0), "odd columns"),
    (lambda o: o.__setitem__((slice(None), slice(0, None, 2)), 0), "even columns"),
    (lambda o: o.__setitem__((slice(128, None), slice(None)), 0), "last rows (ragged edge)"),
    (lambda o: o.__setitem__((slice(None), slice(128, None)), 0), "last columns (ragged edge)"),
    (lambda o: o.__setitem__((3, 5), float("nan")), "NaN"),
    (lambda o: o.zero_(), "all zeros"),
])
def test_mismatch_patterns(mutate, want):
    g = torch.Generator().manual_seed(0)
    hi = torch.randn(200, 136, generator=g, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    out = lo.clone()
    mutate(out)
    m = compare("y", "ragged", out, hi, lo, Tolerance())
    assert m is not None and want in m.pattern, m


def test_compare_passes_rounding_only():
    hi = torch.randn(64, 96, dtype=torch.float64)
    assert compare("y", "small", hi.to(torch.bfloat16), hi, hi.to(torch.bfloat16), Tolerance()) is None


def test_poisoned_nan_is_called_unwritten():
    hi = torch.randn(64, 96, dtype=torch.float64)
    out = hi.to(torch.bfloat16)
    out[:, 64:] = float("nan")
    m = compare("y", "small", out, hi, hi.to(torch.bfloat16), Tolerance(), poisoned=True)
    assert m.unwritten_count == 64 * 32 and "unwritten (NaN poison survived)" in m.pattern


def test_cli_verify_exit_codes(tmp_path):
    from coda_agent.cli import app

    runner = CliRunner()
    runs = ["--runs-dir", str(tmp_path / "runs")]
    r = runner.invoke(app, ["verify", str(TASK_PATH), str(EXPERT_PATH), "--stages", "static,reference",
                            "--no-cache", *runs], catch_exceptions=False)
    assert r.exit_code == 3, r.output  # cpu_passed is not an acceptance
    bad = CORPUS / "static_import_torch.py"
    r = runner.invoke(app, ["verify", str(TASK_PATH), str(bad), "--json", *runs], catch_exceptions=False)
    assert r.exit_code == 1, r.output
    assert Report.model_validate_json(r.stdout).outcome == "rejected"
    r = runner.invoke(app, ["verify", str(tmp_path / "nope.yaml"), str(bad)], catch_exceptions=False)
    assert r.exit_code == 2


def test_patterns_small_helper():
    bad = torch.zeros(4, 6, dtype=torch.bool)
    bad[:, 1::2] = True
    assert pattern_of(bad, torch.zeros_like(bad), torch.zeros(4, 6), None, False).startswith("odd columns")


@pytest.mark.slow
def test_expert_compiles_for_sm90a(task):
    from coda_agent.verifier.stages import STAGE_FUNCTIONS, Context

    res = STAGE_FUNCTIONS["compile"](Context(task=task, source=EXPERT_PATH.read_text(), seeds=[1],
                                             shape_sets=["small"]))
    assert res.status == "passed", res.message + res.log
    assert len(res.details["kernels"]) == 3 and all(k["hgmma"] > 0 for k in res.details["kernels"])
    assert "slow_calls" not in res.details and all(k["calls"] == 0 for k in res.details["kernels"])


@pytest.mark.slow
def test_compile_stage_names_slow_path_division(task):
    """`a / b` in an epilogue compiles (it is correct) but to an IEEE division with a
    slow-path CALL per element; the compile stage says so and names the fix."""
    from coda_agent.verifier.stages import STAGE_FUNCTIONS, Context

    source = EXPERT_PATH.read_text().replace("acc + residual", "acc + residual / (acc * acc + 1.0)")
    res = STAGE_FUNCTIONS["compile"](Context(task=task, source=source, seeds=[1], shape_sets=["small"]))
    assert res.status == "passed", res.message + res.log
    assert res.details["slow_calls"]["add_residual"] > 0
    assert "slow-path CALLs in add_residual" in res.message and "reciprocal(b)" in res.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_accepted_on_gpu(task):
    report = Verifier(cache=False, shape_sets=["small", "ragged"]).check(task, EXPERT_PATH.read_text())
    assert report.outcome == "accepted", report.model_dump_json(indent=1)
    perf = report.stage("performance").details
    assert perf["ms"]["program"] > 0 and "vs_gemm" in perf
