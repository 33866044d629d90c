"""The compile-stage cache (coda_agent.verifier.compile_cache): a second verification
of the same program reuses the passed compile; anything else recompiles.

One real end-to-end pair (compile, then hit) through the worker child; the miss
cases run the stage in-process with the compiler stubbed out, so the file costs
one sm_90a compile of the tiny task's three GEMMs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verifier_helpers import EXPERT_PATH, TASK_PATH

from coda_agent.tasks.spec import Task, load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import compile_cache, stages
from coda_agent.verifier.report import StageResult

STAGES = ["static", "reference", "compile"]  # the CPU pass; reference imports the catalogue first


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


@pytest.fixture(scope="module")
def twice(task, tmp_path_factory):
    """The expert verified twice (verdict cache off) with a fresh CODA_CACHE_DIR."""
    root = tmp_path_factory.mktemp("coda-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CODA_CACHE_DIR", str(root))
        v = Verifier(stages=STAGES, cache=False, timeout_s=300)
        first = v.check(task, EXPERT_PATH.read_text())
        second = v.check(task, EXPERT_PATH.read_text())
    return root, first, second


@pytest.fixture
def cache_root(twice, monkeypatch):
    root = twice[0]
    monkeypatch.setenv("CODA_CACHE_DIR", str(root))
    return root


def _ctx(task, source, **kw):
    return stages.Context(task=task, source=source, seeds=[11, 12, 13, 14], shape_sets=["small"],
                          compile_cache=True, **kw)


@pytest.fixture
def compiles(monkeypatch):
    """Stub the real compile: record the calls, return a passed result."""
    calls = []

    def fake(ctx):
        calls.append(ctx.source)
        ctx.next_seed()
        return StageResult(name="compile", status="passed", seconds=7.0, message="stub compile",
                           details={"kernels": []})

    monkeypatch.setattr(stages, "_compile_uncached", fake)
    return calls


@pytest.mark.slow
def test_second_verification_reuses_the_compile(twice):
    root, first, second = twice
    c1, c2 = first.stage("compile"), second.stage("compile")
    assert c1.status == "passed", c1.message + c1.log
    assert not c1.details.get("cached")
    assert c2.status == "passed" and c2.details["cached"] is True, c2.message
    assert "reused from the compile cache" in c2.message
    assert c2.details["compile_seconds"] == c1.seconds
    assert c2.details["kernels"] == c1.details["kernels"] and len(c2.details["kernels"]) == 3
    assert c2.log == c1.log
    assert c2.seconds < min(1.0, c1.seconds / 5), (c1.seconds, c2.seconds)
    assert second.outcome == first.outcome == "cpu_passed"
    files = list((root / "compile").glob("*.json"))
    assert len(files) == 1 and not list((root / "compile").glob("*.tmp"))
    print(f"\ncompile stage: first {c1.seconds:.2f} s, cached {c2.seconds:.3f} s")


@pytest.mark.slow
def test_changed_source_misses(task, cache_root, compiles):
    source = EXPERT_PATH.read_text()
    hit = stages.STAGE_FUNCTIONS["compile"](_ctx(task, source))
    assert hit.details.get("cached") and not compiles  # the real entry from the pair above
    res = stages.STAGE_FUNCTIONS["compile"](_ctx(task, source + "\n# a comment\n"))
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
            res = stages.STAGE_FUNCTIONS["compile"](_ctx(task, source))
            assert res.message == "stub compile" and not res.details.get("cached"), junk[:80]
        assert len(compiles) == 5
    finally:
        path.write_text(good)
    assert stages.STAGE_FUNCTIONS["compile"](_ctx(task, source)).details["cached"]


def test_hit_draws_the_compile_seed(task, tmp_path, monkeypatch, compiles):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    source = EXPERT_PATH.read_text()
    a, b = _ctx(task, source), _ctx(task, source)
    stages.STAGE_FUNCTIONS["compile"](a)
    hit = stages.STAGE_FUNCTIONS["compile"](b)
    assert hit.details["cached"] and hit.details["compile_seconds"] == 7.0 and len(compiles) == 1
    assert a.next_seed() == b.next_seed()  # later stages draw the same seeds with or without a hit


def test_only_passed_results_are_stored(task, tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    calls = []

    def failing(ctx):
        calls.append(1)
        return StageResult(name="compile", status="failed", message="ptxas said no", log="the log")

    monkeypatch.setattr(stages, "_compile_uncached", failing)
    for _ in range(2):
        assert stages.STAGE_FUNCTIONS["compile"](_ctx(task, "# p\n")).status == "failed"
    assert len(calls) == 2 and not (tmp_path / "compile").exists()


def test_no_key_or_switched_off_means_no_cache(task, tmp_path, monkeypatch, compiles):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))

    def broken():
        raise verdict_cache.CacheKeyError("no version")

    with monkeypatch.context() as mp:
        mp.setattr(verdict_cache, "library_versions", broken)
        for _ in range(2):
            stages.STAGE_FUNCTIONS["compile"](_ctx(task, "# q\n"))
    for _ in range(2):  # Context's compile_cache defaults off (the Verifier turns it on)
        stages.STAGE_FUNCTIONS["compile"](stages.Context(task=task, source="# q\n", seeds=[1],
                                                         shape_sets=["small"]))
    assert len(compiles) == 4 and not (tmp_path / "compile").exists()


def test_key_covers_task_versions_target_and_code(task, monkeypatch):
    import coda_agent.primitives.version as version

    source = EXPERT_PATH.read_text()
    base = compile_cache.compile_key(task, source)
    assert compile_cache.compile_key(task, source) == base
    other = Task(task.spec.model_copy(update={"shapes": {**task.spec.shapes, "small": {
        "M": 64, "N": 96, "K": 256}}}), task.path)
    assert compile_cache.compile_key(other, source) != base
    with monkeypatch.context() as mp:
        mp.setattr(version, "CATALOGUE_VERSION", "different")
        assert compile_cache.compile_key(task, source) != base
    versions = verdict_cache.library_versions()
    with monkeypatch.context() as mp:
        mp.setattr(verdict_cache, "library_versions", lambda: {**versions, "quack-kernels": "0.0.1"})
        assert compile_cache.compile_key(task, source) != base
    with monkeypatch.context() as mp:
        mp.setattr(compile_cache, "target", lambda: {"arch": "sm_100a", "device": "cpu"})
        assert compile_cache.compile_key(task, source) != base
    with monkeypatch.context() as mp:  # coda_agent's own code (e.g. the default tile choice) changed
        mp.setattr(compile_cache, "code_digest", lambda: "edited")
        assert compile_cache.compile_key(task, source) != base


def test_verifier_passes_the_switch_to_the_worker(monkeypatch):
    sent = {}

    def fake_popen(cmd, **kw):
        sent.update(json.loads(Path(cmd[-2]).read_text()))
        raise OSError("stop here")

    monkeypatch.setattr("subprocess.Popen", fake_popen)
    task = load_task(TASK_PATH)
    for flag in (True, False):
        with pytest.raises(OSError):
            Verifier(stages=["compile"], cache=False, compile_cache=flag)._run_child(task, "# s\n", ["compile"])
        assert sent["compile_cache"] is flag
    assert Verifier().compile_cache is True
