"""Verification for a batch: the ``Verifier`` protocol over a thread per GPU and a few CPU threads.

``VerifierPool.check(task, source) -> Report`` is what the agent loop calls
from its trajectory threads.  The call queues the candidate and blocks until
a verification thread has judged it, so many trajectories (and their LLM
calls) run at once while verification is bounded by the threads:

- CPU threads: ``cpu_threads`` of them, each with its own verifier whose
  judges see no GPU (``device=""``), running the CPU stages (static,
  reference, compile).
- GPU threads: one per visible GPU, each with its own verifier whose judges
  see that GPU alone (``device="3"``: ``CUDA_VISIBLE_DEVICES`` of the judges
  it starts), running the GPU stages (correctness, launch audit,
  performance).  One thread per GPU means one candidate per GPU at a time,
  so the judge's GPU lock (:mod:`coda_agent.verifier.gpu_lock`) is never
  contended inside a batch; it stays for what shares a GPU across threads or
  processes (``solve --samples``, two commands on one machine).

A candidate that passes the CPU stages moves on to a GPU thread, and the two
partial reports become one (outcome recomputed over all stages).  On a
machine without CUDA the CPU threads run the whole check (the GPU stages come
back ``skipped``: ``cpu_passed``, never ``accepted``).  Every report says
where it ran: ``report.versions["ran_on"]`` is e.g. ``"cpu-0"`` or
``"cpu-1 + gpu-3"`` (GPU ids as in this process's ``CUDA_VISIBLE_DEVICES``).

Isolation is the verifier's: each check runs the program in a sandboxed
runner behind a judge process, and a runner or judge that dies or hangs is a
stage's verdict.  So the threads need no restart logic.  A verification that
raises (a verifier bug, a task that cannot load) is an ``error`` report for
that candidate (the loop stops its trajectory with ``verifier_error``; the
candidate is not blamed) and the thread takes the next one.

The verifier of each thread is ``factory(stages=..., device=..., **options)``
from the same ``module:factory`` and options the agent uses
(``AgentConfig.load_verifier``; ``stages`` only when the stages are split
between CPU and GPU threads), entered as a session
(``with verifier:``) so that its judges are kept between checks.
:mod:`.ray_pool` runs the same phases as Ray tasks (:func:`check_in_phases`).
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from coda_agent.agent.protocols import CodaError
from coda_agent.devices import visible_gpus
from coda_agent.verifier.report import GPU_STAGES, STAGES, Report, StageResult

if TYPE_CHECKING:
    from coda_agent.agent.config import AgentConfig
    from coda_agent.tasks.spec import Task

CPU_STAGES = tuple(s for s in STAGES if s not in GPU_STAGES)
PHASE_STAGES = {"cpu": CPU_STAGES, "gpu": GPU_STAGES}  # "all": the verifier's own (no GPU: CPU stages)


def default_cpu_threads(gpus: int) -> int:
    """Two CPU threads where there are cores to spare (a check's compiles hog one), else one."""
    cores = os.cpu_count() or 1
    return 2 if cores >= 4 or gpus else 1


def build_verifier(cfg: "AgentConfig", phase: str, device: str | None) -> Any:
    """The verifier of one phase: ``factory(stages=..., device=..., **options)`` (no ``stages`` for "all")."""
    stages = {} if phase == "all" else {"stages": list(PHASE_STAGES[phase])}
    return cfg.load_verifier(**stages, device=device)


def error_report(task_name: str, phase: str, why: str, log: str = "") -> Report:
    """The report of a verification that raised instead of answering: an ``error``, not the candidate's."""
    stage = PHASE_STAGES.get(phase, CPU_STAGES)[0]
    return Report(task=task_name, program_sha256="", outcome="error",
                  stages=[StageResult(name=stage, status="error", message=why, log=log[-4000:])])


def check_in_phases(run: Callable[[str], tuple[Report, str]], split: bool) -> Report:
    """One check as its phases: ``run(phase) -> (report, where)``; "cpu" then "gpu" when ``split``,
    else "all".  The GPU phase runs only for a candidate the CPU stages did not reject."""
    if not split:
        report, where = run("all")
        return _stamp(report, [where])
    cpu, cpu_where = run("cpu")
    if cpu.outcome in ("rejected", "error"):
        return _stamp(cpu, [cpu_where])
    gpu, gpu_where = run("gpu")
    return _stamp(merge(cpu, gpu), [cpu_where, gpu_where])


def merge(cpu: Report, gpu: Report) -> Report:
    """One report from the CPU-stage and GPU-stage halves of a check."""
    stages = [*cpu.stages, *gpu.stages]
    return Report(task=cpu.task, program_sha256=cpu.program_sha256 or gpu.program_sha256,
                  outcome=Report.outcome_of(stages), stages=stages, versions={**cpu.versions, **gpu.versions},
                  cache_key=None, cached=cpu.cached and gpu.cached, created_utc=gpu.created_utc or cpu.created_utc)


def _stamp(report: Report, ran_on: list[str]) -> Report:
    return report.model_copy(update={"versions": {**report.versions, "ran_on": " + ".join(ran_on)}})


@dataclass
class _Job:
    task: "Task"
    source: str
    future: Future = field(default_factory=Future)


class _Lane:
    """One verification thread, its verifier and the queue it takes candidates from."""

    def __init__(self, name: str, phase: str, verifier: Any, jobs: "queue.Queue[_Job | None]"):
        self.name, self.phase, self.verifier, self.jobs = name, phase, verifier, jobs
        self.thread = threading.Thread(target=self._serve, name=f"verifier-{name}", daemon=True)

    def _serve(self) -> None:
        with self.verifier:  # a session: the verifier keeps its judges between checks
            while (job := self.jobs.get()) is not None:
                try:
                    report = self.verifier.check(job.task, job.source)
                except Exception as e:  # noqa: BLE001 - the candidate must be answered, and the batch go on
                    report = error_report(job.task.name, self.phase, f"the verifier raised {type(e).__name__}: "
                                                                     f"{e}", traceback.format_exc())
                job.future.set_result((report, self.name))


class VerifierPool:
    """A ``Verifier`` whose ``check`` runs on verification threads (module docstring)."""

    def __init__(self, cfg: "AgentConfig", gpus: list[str] | None = None, cpu_threads: int | None = None):
        self.gpus = visible_gpus() if gpus is None else gpus
        n_cpu = default_cpu_threads(len(self.gpus)) if cpu_threads is None else cpu_threads
        if n_cpu < 1:
            raise CodaError("--workers must be at least 1: the CPU stages need a thread")
        self.split = bool(self.gpus)
        self.closed = False
        self._queues: dict[str, queue.Queue] = {"cpu": queue.Queue(), "gpu": queue.Queue()}
        first = "cpu" if self.split else "all"
        # Built here, so that a verifier that cannot be made fails the command, not a thread.
        self.lanes = [_Lane(f"cpu-{i}", first, build_verifier(cfg, first, "" if self.split else None),
                            self._queues["cpu"]) for i in range(n_cpu)]
        self.lanes += [_Lane(f"gpu-{g}", "gpu", build_verifier(cfg, "gpu", g), self._queues["gpu"])
                       for g in self.gpus]
        for lane in self.lanes:
            lane.thread.start()

    def describe(self) -> str:
        cpu = len(self.lanes) - len(self.gpus)
        return f"{cpu} CPU verification thread(s)" + (
            f" + one per GPU ({','.join(self.gpus)})" if self.gpus else " (no CUDA: GPU stages skipped)")

    def meta(self) -> dict[str, Any]:
        """Where the batch is verified, for batch.json."""
        return {"cpu": len(self.lanes) - len(self.gpus), "gpus": self.gpus}

    def check(self, task: "Task", program_source: str) -> Report:
        if self.closed:
            raise RuntimeError("the verifier pool is closed")

        def run(phase: str) -> tuple[Report, str]:
            job = _Job(task, program_source)
            self._queues["gpu" if phase == "gpu" else "cpu"].put(job)
            return job.future.result()

        return check_in_phases(run, self.split)

    def close(self, wait: bool = True) -> None:
        """Stop the threads once they finish what they hold (each closes its verifier's judges);
        ``wait``: until they have."""
        if self.closed:
            return
        self.closed = True
        for lane in self.lanes:
            lane.jobs.put(None)
        for lane in self.lanes:
            if wait:
                lane.thread.join(timeout=30)

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
