"""The verifier pool: workers per GPU, a killed worker restarted, its candidate retried elsewhere."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from agent_fixtures import GOOD, WRONG

from coda_agent.eval.pool import VerifierPool, visible_gpus

SIM = "eval_fixtures:SimVerifier"


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 7")
    assert visible_gpus() == ["2", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_killed_worker_is_restarted_and_the_candidate_retried(agent_task, tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_TEST_CRASH_FLAG", str(tmp_path / "crashed"))
    with VerifierPool(SIM, gpus=[], cpu_workers=2) as pool:
        with ThreadPoolExecutor(4) as ex:
            crash = ex.submit(pool.check, agent_task, GOOD + "# CRASH_ONCE\n")
            others = [ex.submit(pool.check, agent_task, src) for src in (GOOD, WRONG, GOOD + "# 2\n")]
            report = crash.result(timeout=60)
            outcomes = [f.result(timeout=60).outcome for f in others]
        # judged once, by a live worker, after the one that took it first died
        assert report.outcome == "cpu_passed"
        died, _, judged = report.versions["ran_on"].partition(" + ")
        assert died.endswith("(died)") and judged in ("cpu-0", "cpu-1"), report.versions["ran_on"]
        assert (tmp_path / "crashed").is_file()
        assert outcomes == ["cpu_passed", "rejected", "cpu_passed"]  # nothing else was lost or mixed up
        assert sum(w.restarts for w in pool.workers) == 1
        assert pool.check(agent_task, GOOD).outcome == "cpu_passed"  # the restarted pool keeps working


def test_the_retry_goes_to_another_worker_while_the_killed_one_restarts(agent_task, tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_TEST_CRASH_FLAG", str(tmp_path / "crashed"))
    with VerifierPool(SIM, gpus=[], cpu_workers=2) as pool:
        report = pool.check(agent_task, GOOD + "# CRASH_ONCE\n")
    died, _, judged = report.versions["ran_on"].partition(" + ")
    assert report.outcome == "cpu_passed" and judged != died.removesuffix(" (died)"), report.versions["ran_on"]


def test_a_verifier_that_cannot_start_is_a_clean_error():
    from coda_agent.agent.protocols import CodaError

    with pytest.raises(CodaError, match="failed to start 'no_such_module:factory'"):
        VerifierPool("no_such_module:factory", gpus=[], cpu_workers=1)


def test_an_externally_killed_idle_worker_does_not_lose_the_next_job(agent_task):
    with VerifierPool(SIM, gpus=[], cpu_workers=1) as pool:
        assert pool.check(agent_task, GOOD).outcome == "cpu_passed"
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        report = pool.check(agent_task, GOOD)
        assert report.outcome == "cpu_passed" and report.versions["ran_on"] == "cpu-0 (died) + cpu-0"


def test_a_candidate_that_kills_every_worker_is_a_verifier_error(agent_task):
    with VerifierPool(SIM, gpus=[], cpu_workers=1, max_retries=1) as pool:
        report = pool.check(agent_task, GOOD + "# CRASH_ALWAYS\n")
        assert report.outcome == "error" and "died 2 times" in report.stages[0].message
        assert pool.check(agent_task, GOOD).outcome == "cpu_passed"


def test_gpu_workers_each_see_one_gpu(agent_task):
    with VerifierPool(SIM, gpus=["0", "1"], cpu_workers=1) as pool:
        with ThreadPoolExecutor(6) as ex:
            reports = list(ex.map(lambda i: pool.check(agent_task, GOOD + f"# {i}\n"), range(6)))
    assert {r.outcome for r in reports} == {"accepted"}
    assert {r.versions["ran_on"] for r in reports} <= {"cpu-0 + gpu-0", "cpu-0 + gpu-1"}
    assert [s.name for s in reports[0].stages] == ["static", "reference", "compile", "correctness",
                                                   "launch_audit", "performance"]


def test_a_closed_pool_refuses_work(agent_task):
    pool = VerifierPool(SIM, gpus=[], cpu_workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.check(agent_task, GOOD)
    assert all(w.proc.poll() is not None for w in pool.workers)
