"""Timing contenders: one way for the verifier, the tuner and the benchmark.

- :func:`measure_each` times several contenders one flushed call at a time,
  interleaved in rounds (a rested GPU, each contender at the same clock);
- :func:`measure_steady` times one contender back to back (the regime of a
  training step, where each kernel runs at the clock its own power allows);
- :func:`enqueue_ms` is the host's side: how long one call takes to enqueue;
- :class:`FlushedCall` is one timed call, which :func:`measure_each`, the
  verifier's performance stage and its runner all time the same way.

``device="cpu"`` runs the same rounds and loops on the host's clock: the
benchmark's dry run (``bench/run.py --dry-run``) checks its plumbing with it
and measures nothing.
"""

from __future__ import annotations

import random
import time
from collections import deque
from functools import lru_cache
from typing import Any, Callable, Mapping, NamedTuple

import torch

# The spin before each timed call: a multiple of the measured host enqueue time
# plus a floor, so a launch never trails it (that would time an idle gap).  The
# spin itself is never timed.  1.5x holds with every CPU core busy: rope_bwd at
# 70B (0.27 ms of GPU work, 0.25-0.34 ms of host work) times 0.274 ms alone and
# under load, at 1.5x and at 3x, on the H200
# (bench/results/h200-2026-11-29-c/sweep-contention.json).
SPIN_FACTOR, SPIN_FLOOR_MS = 1.5, 0.05
FLUSH_BYTES = 256 << 20  # written before each timed call: the H200's L2 is 60 MiB


def spin_ms(host_ms: float, cap_ms: float) -> float:
    """The spin before a timed call whose host enqueues it in ``host_ms``, at most ``cap_ms``."""
    return min(SPIN_FACTOR * host_ms + SPIN_FLOOR_MS, cap_ms)


class FlushedCall:
    """Times one call on a rested GPU, the way every contender is timed: the device
    synchronized, the L2 flushed, a spin of ``spin`` ms (:func:`spin_ms`) so that the
    call's launches are all queued before the start event fires, CUDA events around
    the call, the device synchronized after it.  ``timer(fn, spin) -> (ms, fn())``."""

    def __init__(self) -> None:
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], Any], spin: float) -> tuple[float, Any]:
        torch.cuda.synchronize()
        self.flush.fill_(1)
        torch.cuda._sleep(int(spin * _cycles_per_ms()))
        self.start.record()
        result = fn()
        self.end.record()
        torch.cuda.synchronize()
        return self.start.elapsed_time(self.end), result


def measure_each(fns: Mapping[str, Callable[[], Any]], reps: int = 20, warmup: int = 3, device: str = "cuda"
                 ) -> dict[str, tuple[list[float], float]]:
    """Device times of several contenders, interleaved: ``{name: (sorted ms of
    ``reps`` calls, host ms to enqueue one call)}``.  Round ``r`` times each
    contender once, in a fresh (seeded) random order, before round ``r + 1``
    starts.

    Each call is timed with CUDA events, after a 256 MiB buffer written to flush
    the L2 and a spin kernel longer than the host needs to enqueue the call
    (SPIN_FACTOR x :func:`enqueue_ms`), so the call's launches are all queued
    before the start event fires: what is timed is the GPU's work, not the
    host's launch overhead, and every contender (program, plain GEMM, eager,
    compiled) is timed the same way.

    Why interleave: the H200 runs its big GEMMs at its 700 W power cap, and its
    SM clock follows power and temperature over a run; a comparison timed in
    blocks can give one contender the cool GPU and the next the throttled one
    (timed in blocks at LLaMA-3 70B, one contender's p10-p90 spread is 30%,
    bench/results/h200-2026-11-29-d).  Interleaved, drift lands on every
    contender alike.  Why a random order: the clock a call gets also depends on
    the power its predecessor drew, and a fixed or rotating order would give
    each contender the same predecessor every round.  The device is
    synchronized after every call, so no contender's work (a stray side stream
    included) runs inside another's timing window.
    """
    if device != "cuda":
        return _measure_each_on_host(fns, reps, warmup)
    names = list(fns)
    timer = FlushedCall()
    spin: dict[str, float] = {}
    host: dict[str, float] = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        host[name] = enqueue_ms(fns[name])
        spin[name] = spin_ms(host[name], 200.0)
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(reps):
        for name in order.sample(names, len(names)):
            times[name].append(timer(fns[name], spin[name])[0])
    return {name: (sorted(times[name]), host[name]) for name in names}


def _measure_each_on_host(fns: Mapping[str, Callable[[], Any]], reps: int, warmup: int
                          ) -> dict[str, tuple[list[float], float]]:
    """:func:`measure_each`'s rounds on the host's clock: all of a call is the host's."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(reps):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (sorted(t), sorted(t)[len(t) // 2]) for name, t in times.items()}


class Steady(NamedTuple):
    """What :func:`measure_steady` saw."""

    ms: float  # device ms per call over the timed window
    calls: int  # calls inside that window
    wall: tuple[float, float]  # time.time() at the window's ends, for a clock sampler's summary


def measure_steady(fn: Callable[[], Any], seconds: float = 1.5, settle: float = 0.5, depth: int = 4,
                   device: str = "cuda") -> Steady:
    """Device ms per call of ``fn`` run back to back, as a training step runs
    its kernels: no L2 flush, no spin, ``depth`` calls kept queued so the GPU
    does not idle while the host enqueues.  The first ``settle`` seconds are
    run but not timed: the SM clock needs them to come down to what the power
    cap allows for this work (bench/results/h200-2026-11-29-e, ``power``).

    :func:`measure_each` times one call on a rested GPU, fairly against its
    rivals; this times the regime a call lives in during training, where each
    kernel pays for its own power draw.  When the host needs longer to enqueue
    a call than the GPU needs to run it, the GPU idles between calls and the
    time is the host's: compare with :func:`enqueue_ms`.  On the host's clock
    there is no clock to settle: the window starts at once.
    """
    if device != "cuda":
        calls, t0 = 0, time.time()
        while not calls or time.time() - t0 < seconds:
            fn()
            calls += 1
        return Steady((time.time() - t0) * 1e3 / calls, calls, (t0, time.time()))
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    queued: deque[Any] = deque()
    t0, started, calls = time.time(), None, 0
    while True:
        now = time.time()
        if started is None and now - t0 >= settle:
            start.record()
            started = now
        if started is not None and calls and now - started >= seconds:
            break
        fn()
        calls += started is not None
        queued.append(torch.cuda.Event())
        queued[-1].record()
        if len(queued) > depth:
            queued.popleft().synchronize()
    end.record()
    torch.cuda.synchronize()
    return Steady(start.elapsed_time(end) / calls, calls, (started, time.time()))


def enqueue_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """Median host wall time (ms) for ``fn`` to enqueue its work, GPU idle
    before each call.  When it exceeds the device time, the program is
    launch-bound in eager mode (a CUDA graph or fewer launches would help)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


@lru_cache(maxsize=1)
def _cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(cycles)
    e.record()
    torch.cuda.synchronize()
    return cycles / max(s.elapsed_time(e), 1e-3)
