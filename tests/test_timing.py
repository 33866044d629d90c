"""Timing contenders (primitives/timing.py), the one way the verifier, the
tuner and the benchmark time: interleaved rounds, and back to back.  On the
host's clock (the benchmark's dry run) on CPU; on the GPU the drift and
host-bound cases the design is for."""

from __future__ import annotations

import time

import pytest
import torch

from coda_agent.primitives import timing


def test_rounds_on_the_host_time_every_contender_once_per_round_in_a_fresh_order():
    seen: list[str] = []
    fns = {name: (lambda name=name: seen.append(name)) for name in "abcd"}
    got = timing.measure_each(fns, reps=6, warmup=1, device="cpu")
    assert seen[:4] == list("abcd")  # one warm-up call each, in order
    rounds = [seen[4 + 4 * r: 8 + 4 * r] for r in range(6)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds
    for times, host in got.values():
        assert len(times) == 6 and times == sorted(times) and host == times[3]


def test_back_to_back_on_the_host_fills_its_window():
    run = timing.measure_steady(lambda: time.sleep(0.002), seconds=0.05, device="cpu")
    assert run.calls >= 5 and run.wall[1] - run.wall[0] >= 0.05
    assert 2.0 <= run.ms < 10.0, run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_each_interleaves_so_drift_lands_on_every_contender():
    """Two identical contenders on a GPU that "slows down" with every call (each
    call sleeps longer than the last, as a heating GPU's clock would make it):
    timed one after the other, the second would read ~1.7x the first; interleaved
    in a random order each round, they read the same."""
    calls = [0]

    def drifting() -> None:
        calls[0] += 1
        torch.cuda._sleep(20_000 * calls[0])

    measured = timing.measure_each({"a": drifting, "b": drifting}, reps=20)
    (a, host_a), (b, host_b) = measured["a"], measured["b"]
    assert len(a) == len(b) == 20 and a == sorted(a) and host_a > 0 and host_b > 0
    assert 0.93 < b[10] / a[10] < 1.07, (a[10], b[10])
    # and a real difference still shows: twice the sleep reads about twice the time
    short, long = (lambda: torch.cuda._sleep(200_000)), (lambda: torch.cuda._sleep(400_000))
    got = timing.measure_each({"short": short, "long": long}, reps=10)
    assert 1.8 < got["long"][0][5] / got["short"][0][5] < 2.2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_steady_keeps_the_gpu_busy_and_shows_a_host_bound_call():
    """Back to back, a call's time is its kernel's: a 0.5 ms spin reads 0.5 ms
    per call with no gaps between calls.  A call whose host takes longer than
    its kernel leaves the GPU idle, and the time says so (the host's 3 ms)."""
    cycles = int(0.5 * timing._cycles_per_ms())
    run = timing.measure_steady(lambda: torch.cuda._sleep(cycles), seconds=0.4, settle=0.1)
    assert 0.45 < run.ms < 0.6 and run.calls > 500, run
    assert run.wall[1] - run.wall[0] >= 0.4

    def host_bound() -> None:
        time.sleep(0.003)
        torch.cuda._sleep(cycles // 10)

    slow = timing.measure_steady(host_bound, seconds=0.2, settle=0.05)
    assert slow.ms > 2.8 and slow.ms > 0.9 * timing.enqueue_ms(host_bound), slow
