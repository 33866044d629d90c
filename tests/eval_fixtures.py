"""Helpers for the eval tests: small task folders and verifiers the worker pool can build.

The verifiers are real judges with simple rules (``agent_fixtures.RuleVerifier``),
built in the pool's worker processes from ``module:factory`` like the real one:

- :class:`SimVerifier` takes ``stages=`` like ``coda_agent.verifier.Verifier``.
  Its GPU stages pretend to run on the GPU the worker was given
  (``CUDA_VISIBLE_DEVICES``) and report performance numbers read from a
  ``# perf: vs_gemm=.. compile_speedup=..`` line in the program, ``slow``
  (correct_slow) when they miss the task's targets, so a CPU machine can test
  the CPU/GPU split, the speedup metrics and both pass rates.  Without ``stages`` it is
  a machine without CUDA (``cpu_passed``).
- A program holding ``CRASH_ONCE`` kills its worker process the first time
  any worker sees it (a flag file in ``$CODA_TEST_CRASH_FLAG`` remembers);
  ``CRASH_ALWAYS`` kills every worker that tries it.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from agent_fixtures import GOOD, WRONG, RuleVerifier, write_task

from coda_agent.verifier.report import GPU_STAGES, Report, StageResult


def perf_program(vs_gemm: float, compile_speedup: float) -> str:
    return GOOD + f"# perf: vs_gemm={vs_gemm} compile_speedup={compile_speedup}\n"


def write_tasks(folder: Path, experts: dict[str, str]) -> Path:
    """One task per name (the scale-add task under that name) with the given expert program."""
    for name, expert in experts.items():
        write_task(folder, name, expert=expert)
    return folder


def three_tasks(folder: Path) -> Path:
    return write_tasks(folder, {"alpha": GOOD, "beta": WRONG, "gamma": GOOD})


class SimVerifier:
    def __init__(self, stages: list[str] | None = None, shape_sets: list[str] | None = None):
        self.stages, self.shape_sets = stages, shape_sets

    def check(self, task, program_source: str) -> Report:
        _maybe_crash(program_source)
        if self.stages is None:  # the whole check on a machine without CUDA
            return RuleVerifier("cpu_passed", self.shape_sets).check(task, program_source)
        if not set(self.stages) <= set(GPU_STAGES):  # the CPU half
            report = RuleVerifier("cpu_passed", self.shape_sets).check(task, program_source)
            stages = [s for s in report.stages if s.name in self.stages]
            return report.model_copy(update={"stages": stages, "outcome": Report.outcome_of(stages)})
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        assert gpu and "," not in gpu, f"a GPU worker sees exactly one GPU, not {gpu!r}"
        m = re.search(r"# perf: vs_gemm=([\d.]+) compile_speedup=([\d.]+)", program_source)
        vs_gemm, speedup = (float(m[1]), float(m[2])) if m else (1.0, 1.25)  # no line: fast
        ms = {"program": vs_gemm, "gemm": 1.0, "compile": speedup * vs_gemm}  # as verifier/timing.py keys them
        target = task.spec.target
        details = {"shape_set": "llama3-8b", "ms": ms, "vs_gemm": vs_gemm, "compile_speedup": speedup,
                   "tflops": 500.0, "target_vs_gemm": target.vs_gemm, "target_vs_compile": target.vs_compile}
        slow = vs_gemm > target.vs_gemm or speedup < target.vs_compile
        stages = [StageResult(name=s, status="slow" if s == "performance" and slow else "passed",
                              details=details if s == "performance" else {}) for s in self.stages]
        return Report(task=task.name, program_sha256="", outcome=Report.outcome_of(stages), stages=stages,
                      versions={"device": f"simulated H200 (CUDA_VISIBLE_DEVICES={gpu})"})


def _maybe_crash(source: str) -> None:
    if "CRASH_ALWAYS" in source:
        os.kill(os.getpid(), signal.SIGKILL)
    flag = os.environ.get("CODA_TEST_CRASH_FLAG")
    if "CRASH_ONCE" in source and flag and not os.path.exists(flag):
        Path(flag).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def reference_verifier():
    """The real verifier, CPU-only stages that need no compiler: static and the reference lowering."""
    from coda_agent.verifier import Verifier

    return Verifier(stages=["static", "reference"], cache=False)
