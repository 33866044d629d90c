"""Candidates verified side by side share the GPU for correctness but never
while one of them is being timed (verifier/gpu_lock.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from coda_agent.verifier.gpu_lock import gpu_lock


@contextmanager
def _held_elsewhere(stage: str, seconds: float) -> Iterator[None]:
    """Another candidate holds the lock for ``stage`` for ``seconds``, from entry on."""
    started = threading.Event()

    def hold() -> None:
        with gpu_lock(stage):
            started.set()
            time.sleep(seconds)

    t = threading.Thread(target=hold)
    t.start()
    started.wait()
    try:
        yield
    finally:
        t.join()


def test_performance_waits_for_sharers_and_blocks_them(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_GPU_LOCK", str(tmp_path / "gpu.lock"))
    with _held_elsewhere("performance", 0.6), gpu_lock("correctness") as waited:
        assert waited[0] > 0.4  # blocked while the other candidate was timed

    with _held_elsewhere("launch_audit", 0.6):
        with gpu_lock("launch_audit") as waited:
            assert waited[0] < 0.3  # sharing stages run together
        with gpu_lock("performance") as waited:
            assert waited[0] > 0.2  # timing waits for the sharer to finish


def test_cpu_stages_take_no_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_GPU_LOCK", str(tmp_path / "gpu.lock"))
    with _held_elsewhere("performance", 0.5):
        for stage in ("static", "reference", "compile"):
            with gpu_lock(stage) as waited:
                assert waited[0] == 0.0
