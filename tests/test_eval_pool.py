"""The verification pool: a thread per GPU over the verifier's own isolation, CPU threads beside.

What the design guarantees, each tested here: a verification that raises is
an ``error`` for that candidate alone and the pool goes on; every candidate
is answered once, by the thread of its phase; a GPU thread's judges see its
GPU alone, and a GPU has one candidate at a time; closing ends every session.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from agent_fixtures import GOOD, WRONG
from eval_fixtures import SimVerifier, buggy

from coda_agent.agent.config import AgentConfig
from coda_agent.agent.protocols import CodaError
from coda_agent.eval.pool import VerifierPool, visible_gpus
from coda_agent.verifier.report import GPU_STAGES

SIM = AgentConfig(verifier="eval_fixtures:SimVerifier")


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 7")
    assert visible_gpus() == ["2", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_verification_that_raises_is_an_error_for_that_candidate_and_the_rest_go_on(agent_task):
    with VerifierPool(SIM, gpus=[], cpu_threads=2) as pool:
        with ThreadPoolExecutor(4) as ex:
            bug = ex.submit(pool.check, agent_task, buggy(GOOD, "cpu"))
            others = [ex.submit(pool.check, agent_task, src) for src in (GOOD, WRONG, GOOD + "# 2\n")]
            report = bug.result(timeout=30)
            outcomes = [f.result(timeout=30).outcome for f in others]
        assert report.outcome == "error" and report.versions["ran_on"] in ("cpu-0", "cpu-1")
        (stage,) = report.stages
        assert stage.status == "error" and stage.name == "static"
        assert stage.message == "the verifier raised RuntimeError: a simulated verifier bug on the cpu"
        assert "RuntimeError" in stage.log  # the traceback, for whoever fixes the verifier
        assert outcomes == ["cpu_passed", "rejected", "cpu_passed"]  # nothing else was lost or mixed up
        assert all(lane.thread.is_alive() for lane in pool.lanes)
        assert pool.check(agent_task, GOOD).outcome == "cpu_passed"  # and the pool keeps working


def test_a_gpu_phase_that_raises_keeps_the_cpu_stages_it_passed(agent_task):
    with VerifierPool(SIM, gpus=["0"], cpu_threads=1) as pool:
        report = pool.check(agent_task, buggy(GOOD, "gpu"))
        assert pool.check(agent_task, GOOD).outcome == "accepted"
    assert report.outcome == "error" and report.versions["ran_on"] == "cpu-0 + gpu-0"
    assert [(s.name, s.status) for s in report.stages] == [("static", "passed"), ("reference", "passed"),
                                                           ("compile", "passed"), ("correctness", "error")]


def test_a_verifier_that_cannot_be_made_fails_before_any_thread_starts():
    before = threading.active_count()
    with pytest.raises(CodaError, match="cannot load the verifier 'no_such_module:factory'"):
        VerifierPool(AgentConfig(verifier="no_such_module:factory"), gpus=[], cpu_threads=1)
    assert threading.active_count() == before


def test_gpu_threads_each_see_one_gpu(agent_task):
    with VerifierPool(SIM, gpus=["0", "1"], cpu_threads=1) as pool:
        with ThreadPoolExecutor(6) as ex:
            reports = list(ex.map(lambda i: pool.check(agent_task, GOOD + f"# {i}\n"), range(6)))
        wrong = pool.check(agent_task, WRONG)
    assert {r.outcome for r in reports} == {"accepted"}
    assert {r.versions["ran_on"] for r in reports} <= {"cpu-0 + gpu-0", "cpu-0 + gpu-1"}
    assert [s.name for s in reports[0].stages] == ["static", "reference", "compile", "correctness",
                                                   "launch_audit", "performance"]
    assert wrong.outcome == "rejected" and wrong.versions["ran_on"] == "cpu-0"  # never reached a GPU


_busy_lock = threading.Lock()
_busy: Counter = Counter()  # candidates in a GPU's stages now
_most: Counter = Counter()  # at most, per GPU


class CountingVerifier(SimVerifier):
    """SimVerifier whose GPU stages take 50 ms and count who else is on the same GPU meanwhile."""

    def check(self, task, program_source: str):
        if not (self.stages and set(self.stages) <= set(GPU_STAGES)):
            return super().check(task, program_source)
        with _busy_lock:
            _busy[self.device] += 1
            _most[self.device] = max(_most[self.device], _busy[self.device])
        time.sleep(0.05)
        with _busy_lock:
            _busy[self.device] -= 1
        return super().check(task, program_source)


def test_a_gpu_has_one_candidate_at_a_time_and_both_gpus_work(agent_task):
    cfg = AgentConfig(verifier=f"{__name__}:CountingVerifier")
    _most.clear()
    with VerifierPool(cfg, gpus=["0", "1"], cpu_threads=2) as pool:
        with ThreadPoolExecutor(8) as ex:
            reports = list(ex.map(lambda i: pool.check(agent_task, GOOD + f"# {i}\n"), range(8)))
    assert {r.outcome for r in reports} == {"accepted"}
    assert _most == {"0": 1, "1": 1}


def test_closing_ends_every_session_and_refuses_work(agent_task):
    pool = VerifierPool(SIM, gpus=["4"], cpu_threads=2)
    assert pool.check(agent_task, GOOD).outcome == "accepted"
    assert all(lane.verifier.in_session for lane in pool.lanes)  # judges kept between checks
    pool.close()
    assert not any(lane.thread.is_alive() or lane.verifier.in_session for lane in pool.lanes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.check(agent_task, GOOD)
    assert pool.meta() == {"cpu": 2, "gpus": ["4"]}


ENV_JUDGE = """
import json, os, sys
out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for line in sys.stdin:
    req = json.loads(line)
    for stage in req["stages"]:  # each stage passes and says what GPUs this judge sees
        out.write(json.dumps({"check": req["check"], "result": {
            "name": stage, "status": "passed", "message": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}}) + "\\n")
    out.write(json.dumps({"check": req["check"], "done": {"versions": {}}}) + "\\n")
"""


def test_the_real_verifier_pins_each_threads_judges(agent_task, monkeypatch, tmp_path):
    """The real harness on every thread, a judge that reports its CUDA_VISIBLE_DEVICES: the CPU
    stages' judges see no GPU, each GPU thread's see its own, and the report names that GPU."""
    from coda_agent.verifier import cache as verdict_cache
    from coda_agent.verifier import harness

    (tmp_path / "env_judge.py").write_text(ENV_JUDGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(harness, "JUDGE", "env_judge")
    monkeypatch.setattr(verdict_cache, "cuda_available", lambda: True)
    monkeypatch.setattr(verdict_cache, "device_name", lambda gpu, index: f"GPU {index}" if gpu else "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with VerifierPool(AgentConfig(), cpu_threads=1) as pool:
        with ThreadPoolExecutor(4) as ex:
            reports = list(ex.map(lambda i: pool.check(agent_task, GOOD + f"# {i}\n"), range(4)))
    for r in reports:
        seen = {s.name: s.message for s in r.stages if s.name != "static"}
        gpu = r.versions["ran_on"].rpartition("gpu-")[2]
        assert r.outcome == "accepted" and gpu in ("3", "5"), r
        assert seen == {"reference": "", "compile": "", **{s: gpu for s in GPU_STAGES}}
        assert r.versions["device"] == f"GPU {['3', '5'].index(gpu)}"
