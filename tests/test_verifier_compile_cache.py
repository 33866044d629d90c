"""The compile-stage cache (coda_agent.verifier.compile_cache): a second verification
of the same program reuses the passed compile; anything else recompiles.

One real end-to-end pair (compile, then hit) through a judge and its runner, the first
of which is also the test of the compile stage in a runner (sm_90a with HGMMA, SASS
read, no slow-path CALL); the miss cases run the stage with the runner's compile
stubbed out, so the file costs one sm_90a compile of the tiny task's three GEMMs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from verifier_helpers import EXPERT_PATH, TASK_PATH

from coda_agent.tasks.spec import Task, load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import compile_cache, stages
from coda_agent.verifier.report import StageResult


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


@pytest.fixture(scope="module")
def twice(task, tmp_path_factory):
    """The expert compiled twice by one judge (verdict cache off) with a fresh cache root."""
    root = tmp_path_factory.mktemp("coda-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CODA_CACHE_DIR", str(root))
        with Verifier(stages=["compile"], cache=False, timeout_s=300) as v:
            first = v.check(task, EXPERT_PATH.read_text())
            second = v.check(task, EXPERT_PATH.read_text())
    return root, first, second


@pytest.fixture
def cache_root(twice, monkeypatch):
    root = twice[0]
    monkeypatch.setenv("CODA_CACHE_DIR", str(root))
    return root


@dataclass
class _Check:
    """What the compile stage reads of a check."""

    task: Task
    source: str
    compile_cache: bool = True


@pytest.fixture
def compiles(monkeypatch):
    """Stub the runner's compile: record the calls, return a passed result."""
    calls = []

    def fake(check):
        calls.append(check.source)
        return StageResult(name="compile", status="passed", seconds=7.0, message="stub compile",
                           details={"kernels": []})

    monkeypatch.setattr(stages, "_compile", fake)
    return calls


@pytest.mark.slow
def test_the_first_verification_compiles_for_sm90a_in_the_runner(twice):
    res = twice[1].stage("compile")
    assert res.status == "passed", res.message + res.log
    assert len(res.details["kernels"]) == 3 and all(k["hgmma"] > 0 for k in res.details["kernels"])
    assert "slow_calls" not in res.details and all(k["calls"] == 0 for k in res.details["kernels"])
    assert "sass_unavailable" not in res.details


@pytest.mark.slow
def test_second_verification_reuses_the_compile(twice):
    root, first, second = twice
    c1, c2 = first.stage("compile"), second.stage("compile")
    assert c1.status == "passed", c1.message + c1.log
    assert not c1.details.get("cached")
    assert c2.status == "passed" and c2.details["cached"] is True, c2.message
    assert "reused from the compile cache" in c2.message
    assert abs(c2.details["compile_seconds"] - c1.seconds) < 1.0  # the stage time, as stored
    assert c2.details["kernels"] == c1.details["kernels"] and len(c2.details["kernels"]) == 3
    assert c2.log == c1.log
    assert c2.seconds < min(1.0, c1.seconds / 5), (c1.seconds, c2.seconds)
    files = list((root / "compile").glob("*.json"))
    assert len(files) == 1 and not list((root / "compile").glob("*.tmp"))


@pytest.mark.slow
def test_changed_source_misses(task, cache_root, compiles):
    source = EXPERT_PATH.read_text()
    hit = stages.compile_stage(_Check(task, source))
    assert hit.details.get("cached") and not compiles  # the real entry from the pair above
    res = stages.compile_stage(_Check(task, source + "\n# a comment\n"))
    assert compiles and res.message == "stub compile" and not res.details.get("cached")


@pytest.mark.slow
def test_corrupt_entry_is_a_miss(task, cache_root, compiles):
    source = EXPERT_PATH.read_text()
    path = cache_root / "compile" / f"{compile_cache.compile_key(task, source)}.json"
    good = path.read_text()  # the real entry from the pair above
    entry = json.loads(good)
    wrong_key = {**entry, "key": "0" * 64}
    failed = {**entry, "result": {**entry["result"], "status": "failed"}}
    try:
        for junk in ("", good[: len(good) // 2], "[]", json.dumps(wrong_key), json.dumps(failed)):
            path.write_text(junk)
            res = stages.compile_stage(_Check(task, source))
            assert res.message == "stub compile" and not res.details.get("cached"), junk[:80]
        assert len(compiles) == 5
    finally:
        path.write_text(good)
    assert stages.compile_stage(_Check(task, source)).details["cached"]


def test_only_passed_results_are_stored(task, tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    calls = []

    def failing(check):
        calls.append(1)
        return StageResult(name="compile", status="failed", message="ptxas said no", log="the log")

    monkeypatch.setattr(stages, "_compile", failing)
    for _ in range(2):
        assert stages.compile_stage(_Check(task, "# p\n")).status == "failed"
    assert len(calls) == 2 and not (tmp_path / "compile").exists()


def test_no_key_or_switched_off_means_no_cache(task, tmp_path, monkeypatch, compiles):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))

    def broken():
        raise verdict_cache.CacheKeyError("no version")

    with monkeypatch.context() as mp:
        mp.setattr(verdict_cache, "library_versions", broken)
        for _ in range(2):
            stages.compile_stage(_Check(task, "# q\n"))
    for _ in range(2):
        stages.compile_stage(_Check(task, "# q\n", compile_cache=False))
    assert len(compiles) == 4 and not (tmp_path / "compile").exists()


def test_key_covers_task_versions_target_and_code(task, monkeypatch):
    source = EXPERT_PATH.read_text()
    base = compile_cache.compile_key(task, source)
    assert compile_cache.compile_key(task, source) == base
    other = Task(task.spec.model_copy(update={"shapes": {**task.spec.shapes, "small": {
        "M": 64, "N": 96, "K": 256}}}), task.path)
    assert compile_cache.compile_key(other, source) != base
    with monkeypatch.context() as mp:
        mp.setattr(verdict_cache, "catalogue_version", lambda: "different")
        assert compile_cache.compile_key(task, source) != base
    versions = verdict_cache.library_versions()
    with monkeypatch.context() as mp:
        mp.setattr(verdict_cache, "library_versions", lambda: {**versions, "quack-kernels": "0.0.1"})
        assert compile_cache.compile_key(task, source) != base
    with monkeypatch.context() as mp:
        mp.setattr(compile_cache, "target", lambda: {"arch": "sm_100a", "device": "cpu"})
        assert compile_cache.compile_key(task, source) != base
    with monkeypatch.context() as mp:  # coda_agent's own code (e.g. the default tile choice) changed
        mp.setattr(verdict_cache, "code_digest", lambda: "edited")
        assert compile_cache.compile_key(task, source) != base


def test_the_verifier_passes_the_switch_to_the_judge(monkeypatch):
    sent = []
    monkeypatch.setattr(Verifier, "_take_judge", lambda self, task: type("J", (), {
        "send": lambda _, req: sent.append(req) or 1, "alive": lambda _: True, "close": lambda _: None,
        "next_event": lambda _, timeout: {"check": 1, "done": {"versions": {}}}})())
    task = load_task(TASK_PATH)
    for flag in (True, False):
        Verifier(stages=["compile"], cache=False, compile_cache=flag).check(task, "# s\n")
        assert sent[-1]["compile_cache"] is flag
    assert Verifier().compile_cache is True
