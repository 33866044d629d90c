"""Helpers for the eval tests: small task folders and verifiers the verification pool can build.

The verifiers are real judges with simple rules (``agent_fixtures.RuleVerifier``),
built by the pool from ``module:factory`` like the real one, with the
pool's ``stages=`` and ``device=``, and used as a session (``with``):

- :class:`SimVerifier` takes ``stages=`` like ``coda_agent.verifier.Verifier``.
  Its GPU stages pretend to run on the GPU its thread was given (``device``)
  and report performance numbers read from a
  ``# perf: vs_gemm=.. compile_speedup=..`` line in the program, ``slow``
  (correct_slow) when they miss the task's targets, so a CPU machine can test
  the CPU/GPU split, the speedup metrics and both pass rates.  Without ``stages`` it is
  a machine without CUDA (``cpu_passed``).
- A program with a ``# verifier bug on: cpu`` (or ``gpu``) line makes that
  phase's verification raise, as a verifier bug would (a machine without CUDA
  counts as ``cpu``).
- :func:`reference_verifier` is the real verifier on two CPU stages.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent_fixtures import GOOD, WRONG, RuleVerifier, write_task

from coda_agent.verifier.report import GPU_STAGES, Report, StageResult


def buggy(program: str, phase: str) -> str:
    """``program`` with a line that makes SimVerifier raise on ``phase`` (cpu or gpu)."""
    return program + f"# verifier bug on: {phase}\n"


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
    def __init__(self, stages: list[str] | None = None, shape_sets: list[str] | None = None,
                 device: str | None = None):
        self.stages, self.shape_sets, self.device = stages, shape_sets, device
        self.in_session = False

    def __enter__(self) -> "SimVerifier":
        self.in_session = True
        return self

    def __exit__(self, *exc) -> None:
        self.in_session = False

    def check(self, task, program_source: str) -> Report:
        bug = re.search(r"# verifier bug on: (\w+)", program_source)
        if bug and bug[1] == ("gpu" if self.stages and set(self.stages) <= set(GPU_STAGES) else "cpu"):
            raise RuntimeError(f"a simulated verifier bug on the {bug[1]}")
        if self.stages is None:  # the whole check on a machine without CUDA
            return RuleVerifier("cpu_passed", self.shape_sets).check(task, program_source)
        if not set(self.stages) <= set(GPU_STAGES):  # the CPU half
            assert self.device == "", f"the CPU stages' judges see no GPU, not {self.device!r}"
            report = RuleVerifier("cpu_passed", self.shape_sets).check(task, program_source)
            stages = [s for s in report.stages if s.name in self.stages]
            return report.model_copy(update={"stages": stages, "outcome": Report.outcome_of(stages)})
        gpu = self.device
        assert gpu and "," not in gpu, f"a GPU thread's judges see exactly one GPU, not {gpu!r}"
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


def reference_verifier(stages: list[str] | None = None, device: str | None = None,
                       shape_sets: list[str] | None = None):
    """The real verifier on the CPU stages that need no compiler: static and the reference lowering
    (whatever ``stages`` the pool asks for: on a GPU host both phases run these, ``cpu_passed``)."""
    from coda_agent.verifier import Verifier

    return Verifier(stages=["static", "reference"], cache=False, device=device, shape_sets=shape_sets)
