"""Candidates verified side by side share the GPU for correctness but never
while one of them is being timed (verifier/gpu_lock.py)."""

from __future__ import annotations

import threading
import time

from coda_agent.verifier.gpu_lock import gpu_lock


def _hold(stage: str, seconds: float, started: threading.Event) -> None:
    with gpu_lock(stage):
        started.set()
        time.sleep(seconds)


def test_performance_waits_for_sharers_and_blocks_them(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_GPU_LOCK", str(tmp_path / "gpu.lock"))
    started = threading.Event()
    t = threading.Thread(target=_hold, args=("performance", 0.6, started))
    t.start()
    started.wait()
    with gpu_lock("correctness") as waited:
        assert waited[0] > 0.4  # blocked while the other candidate was timed
    t.join()

    started.clear()
    t = threading.Thread(target=_hold, args=("launch_audit", 0.6, started))
    t.start()
    started.wait()
    with gpu_lock("launch_audit") as waited:
        assert waited[0] < 0.3  # sharing stages run together
    with gpu_lock("performance") as waited:
        assert waited[0] > 0.2  # timing waits for the sharer to finish
    t.join()


def test_cpu_stages_take_no_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_GPU_LOCK", str(tmp_path / "gpu.lock"))
    started = threading.Event()
    t = threading.Thread(target=_hold, args=("performance", 0.5, started))
    t.start()
    started.wait()
    for stage in ("static", "reference", "compile"):
        with gpu_lock(stage) as waited:
            assert waited[0] == 0.0
    t.join()
