"""The GPU's SM clock, power and temperature while a benchmark runs.

A time means little without the clock it ran at: the H200 lowers its SM clock
when it reaches its power cap or heats up, so the same GEMM can run several %
slower late in a long run than early in it.  :class:`ClockSampler` polls
``nvidia-smi --query-gpu`` from a background thread (it reads the GPU's state
and never sets any of it); :meth:`ClockSampler.summary` condenses the samples
taken between two wall-clock times: the median and lowest SM clock, the median
power draw, the peak temperature, and the reasons the driver gave for holding
the clock down (its power cap, a thermal slowdown, ...).

Polling, not ``nvidia-smi -lms``: a looping nvidia-smi writing to a pipe
buffers its lines, so the samples of the last seconds would arrive late or be
lost when it is stopped.  One query takes a few tens of ms of one CPU core;
the benchmark's timings are device events and do not see it.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

from coda_agent.devices import visible_gpus

FIELDS = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu"
REASONS_FIELD = "clocks_event_reasons.active"

# NVML's clock-event reason bits (nvml.h, nvmlClocksEventReason*).
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake",
           0x100: "display clocks"}


@dataclass(frozen=True)
class Sample:
    t: float  # time.time() when the query returned
    sm_mhz: float
    max_sm_mhz: float
    power_w: float
    temp_c: float
    reasons: int  # NVML bit mask; 0 when the driver does not report it


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


def parse(line: str, t: float) -> Sample | None:
    """One ``--format=csv,noheader,nounits`` line, or None if it holds no numbers
    (``[N/A]``, an error message)."""
    parts = [p.strip() for p in line.split(",")]
    try:
        sm, max_sm, power, temp = (float(p) for p in parts[:4])
        reasons = int(parts[4], 16) if len(parts) > 4 else 0
    except (ValueError, IndexError):
        return None
    return Sample(t, sm, max_sm, power, temp, reasons)


class ClockSampler:
    """Polls one GPU every ``period_s`` seconds while running (a context manager).
    Without nvidia-smi (a CPU machine) it samples nothing and summarizes to None."""

    def __init__(self, gpu: int | str | None = None, period_s: float = 0.2, command: str = "nvidia-smi"):
        if gpu is None:  # the first GPU this process may use, as nvidia-smi numbers it
            gpu = (visible_gpus() or ["0"])[0]
        self.gpu, self.period_s = str(gpu), period_s
        self.command = shutil.which(command)
        self.samples: list[Sample] = []
        self.error: str | None = None if self.command else f"{command} not found"
        self._fields = f"{FIELDS},{REASONS_FIELD}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _query(self) -> Sample | None:
        proc = subprocess.run([self.command, "-i", self.gpu, f"--query-gpu={self._fields}",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        if proc.returncode != 0 and self._fields.endswith(REASONS_FIELD):
            self._fields = FIELDS  # an older driver: no clock-event reasons, keep the rest
            return self._query()
        if proc.returncode != 0:
            raise RuntimeError((proc.stderr or proc.stdout).strip()[:200] or f"exit {proc.returncode}")
        return parse(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "", time.time())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sample = self._query()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                self.error = f"{type(e).__name__}: {e}"
                return  # a GPU that cannot be queried once will not be queried later
            if sample is not None:
                self.samples.append(sample)
            self._stop.wait(self.period_s)

    def __enter__(self) -> ClockSampler:
        if self.command:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self, t0: float, t1: float) -> dict | None:
        """What the GPU ran at between wall-clock times ``t0`` and ``t1``."""
        return self.summary_over([(t0, t1)])

    def summary_over(self, windows: list[tuple[float, float]]) -> dict | None:
        """:meth:`summary` of the samples inside any of ``windows``: one
        contender's share of a run that timed several in turns."""
        inside = [s for s in self.samples if any(t0 <= s.t <= t1 for t0, t1 in windows)]
        if not inside:
            return None
        mask = 0
        for s in inside:
            mask |= s.reasons
        return {"samples": len(inside),
                "sm_mhz_median": statistics.median(s.sm_mhz for s in inside),
                "sm_mhz_min": min(s.sm_mhz for s in inside),
                "sm_mhz_max_rated": inside[-1].max_sm_mhz,
                "power_w_median": statistics.median(s.power_w for s in inside),
                "temp_c_max": max(s.temp_c for s in inside),
                "reasons": reason_names(mask & ~0x1)}  # "idle" between reps says nothing
