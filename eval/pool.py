"""A pool of verification worker processes behind the ``Verifier`` protocol.

``VerifierPool.check(task, source) -> Report`` is what the agent loop calls
from its trajectory threads.  The call queues a job and blocks until a worker
process has judged it, so many trajectories (and their LLM calls) run at once
while verification is bounded by the workers:

- GPU workers: one per visible GPU, each started with ``CUDA_VISIBLE_DEVICES``
  set to that one GPU, running the GPU stages (correctness, launch audit,
  performance).
- CPU workers: ``cpu_workers`` of them with ``CUDA_VISIBLE_DEVICES=""``,
  running the CPU stages (static, reference, compile) beside the GPU workers.
  A candidate that passes them moves on to a GPU worker, and the two partial
  reports are merged into one (outcome recomputed over all stages).  On a
  machine without CUDA there are only CPU workers and they run the whole check
  (the GPU stages come back ``skipped``: ``cpu_passed``, never ``accepted``).

Each worker process (:mod:`.worker`) builds the verifier from the same
``module:factory`` the agent uses, with the same ``options`` (``shape_sets``
from ``--sets``), plus ``stages=...`` when the stages are split between CPU and
GPU workers, and answers one JSON line per job on a pipe.
Every report says where it ran: ``report.versions["ran_on"]`` is e.g.
``"cpu-0"``, ``"cpu-1 + gpu-3"`` (GPU ids as in the parent's
``CUDA_VISIBLE_DEVICES``) or ``"cpu-0 (died) + cpu-1"`` after a retry.

A killed worker: its manager thread sees the pipe close, puts the job back at
the front of its queue, and restarts the process; it takes jobs again only once
the new process says it is ready (its imports take a second or two), so an idle
worker elsewhere takes the retry first.  A job is retried at most
``max_retries`` times; after
that the job's report is an ``error`` (the loop stops that trajectory with
``verifier_error``; the candidate is not blamed).  A job is answered exactly
once, so no trajectory is lost or judged twice.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coda_agent.agent.protocols import CodaError
from coda_agent.devices import visible_gpus
from coda_agent.verifier.report import GPU_STAGES, STAGES, Report, StageResult

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task

CPU_STAGES = tuple(s for s in STAGES if s not in GPU_STAGES)


def default_cpu_workers(gpus: int) -> int:
    """Two CPU workers where there are cores to spare (the verifier's child compiles hog one), else one."""
    cores = os.cpu_count() or 1
    return 2 if cores >= 4 or gpus else 1


@dataclass
class _Job:
    task_path: str
    task_name: str
    source: str
    phase: str  # "all" (CPU-only machine), "cpu" or "gpu"
    ran_on: list[str] = field(default_factory=list)  # the workers that answered, in order
    future: Future = field(default_factory=Future)
    tries: int = 0


class _Worker:
    """One worker process and the thread that feeds it jobs from its queue."""

    def __init__(self, pool: "VerifierPool", name: str, cuda_visible: str, jobs: "queue.Queue[_Job | None]"):
        self.pool, self.name, self.cuda_visible, self.jobs = pool, name, cuda_visible, jobs
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.thread = threading.Thread(target=self._serve, name=f"verifier-{name}", daemon=True)

    def start(self) -> None:
        self.proc = self._spawn()

    def serve(self) -> None:
        if not self._ready():
            raise CodaError(f"verifier worker {self.name} failed to start {self.pool.verifier_target!r} "
                            f"(exit {self._exit_code()}); its error is above")
        self.thread.start()

    def _ready(self) -> bool:
        """Wait for the worker's hello line: it has imported the verifier and can take jobs."""
        assert self.proc is not None and self.proc.stdout
        return self.proc.stdout.readline().strip() == "ready"

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.cuda_visible)
        # The worker imports what the parent can (a test's verifier or task reference may live in tests/).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        return subprocess.Popen([sys.executable, "-m", "coda_agent.eval.worker", self.pool.verifier_target,
                                 json.dumps(self.pool.stage_split), json.dumps(self.pool.options)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                start_new_session=True)  # a Ctrl-C in the terminal is the parent's to handle

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                reply = self._ask(job)
            except (OSError, ValueError):  # a broken pipe or a half line: the process died under this job
                reply = None
            if reply is None:
                self._died(job)
                continue
            try:
                report = Report.model_validate(reply)
            except ValueError as e:  # a worker bug; the job must still be answered, or its trajectory hangs
                self.pool._give_up(job, f"{self.name} answered something that is not a Report: {e}")
                continue
            self.pool._finish(job, report, self.name)
        self._close()

    def _ask(self, job: _Job) -> dict | None:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"task_path": job.task_path, "source": job.source,
                                          "phase": job.phase}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def _died(self, job: _Job) -> None:
        job.tries += 1
        job.ran_on.append(f"{self.name} (died)")
        if job.tries > self.pool.max_retries:
            self.pool._give_up(job, f"the verifier worker process died {job.tries} times on this candidate "
                                    f"(last on {self.name}, exit {self._exit_code()})")
        else:
            self.pool._retry(job)
        self._close()
        if not self.pool.closed:
            # Only a started worker takes jobs again, so an idle worker elsewhere takes the retry first.
            # If it cannot start, the next job's write fails and counts against that job's retries.
            self.restarts += 1
            self.proc = self._spawn()
            self._ready()

    def _exit_code(self) -> int | None:
        return self.proc.wait() if self.proc else None

    def _close(self) -> None:
        if self.proc is None:
            return
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class VerifierPool:
    """A ``Verifier`` whose ``check`` runs in worker processes (module docstring)."""

    def __init__(self, verifier_target: str = "coda_agent.verifier:Verifier", gpus: list[str] | None = None,
                 cpu_workers: int | None = None, max_retries: int = 2, options: dict | None = None):
        self.verifier_target, self.max_retries, self.options = verifier_target, max_retries, options or {}
        self.gpus = visible_gpus() if gpus is None else gpus
        n_cpu = default_cpu_workers(len(self.gpus)) if cpu_workers is None else cpu_workers
        if n_cpu < 1:
            raise CodaError("--workers must be at least 1: the CPU stages need a worker")
        # With GPUs the stages are split; the worker builds its verifier with these stages.
        self.stage_split = {"cpu": list(CPU_STAGES), "gpu": list(GPU_STAGES)} if self.gpus else {}
        self.closed = False
        self._queues = {"cpu": queue.Queue(), "gpu": queue.Queue()}
        self.workers = [_Worker(self, f"cpu-{i}", "", self._queues["cpu"]) for i in range(n_cpu)]
        self.workers += [_Worker(self, f"gpu-{g}", g, self._queues["gpu"]) for g in self.gpus]
        for w in self.workers:  # start all, then wait for all: their imports overlap
            w.start()
        try:
            for w in self.workers:
                w.serve()
        except CodaError:
            self.close()
            raise

    def describe(self) -> str:
        cpu = sum(w.name.startswith("cpu") for w in self.workers)
        return f"{cpu} CPU worker(s)" + (f" + {len(self.gpus)} GPU worker(s) ({','.join(self.gpus)})"
                                         if self.gpus else " (no CUDA: GPU stages skipped)")

    # ------------------------------------------------------------------ the Verifier protocol

    def check(self, task: "Task", program_source: str) -> Report:
        if self.closed:
            raise RuntimeError("the verifier pool is closed")
        first = "cpu" if self.gpus else "all"
        job = _Job(str(task.path), task.name, program_source, first)
        self._queues["cpu"].put(job)
        cpu_report = job.future.result()
        if first == "all" or cpu_report.outcome in ("rejected", "error"):
            return self._stamp(job, cpu_report)
        gpu_job = _Job(job.task_path, job.task_name, program_source, "gpu", ran_on=job.ran_on)
        self._queues["gpu"].put(gpu_job)
        return self._stamp(gpu_job, merge(cpu_report, gpu_job.future.result()))

    # ------------------------------------------------------------------ called by the workers

    def _finish(self, job: _Job, report: Report, worker: str) -> None:
        job.ran_on.append(worker)
        job.future.set_result(report)

    def _retry(self, job: _Job) -> None:
        q = self._queues["gpu" if job.phase == "gpu" else "cpu"]
        with q.mutex:  # to the front: it has waited longest
            q.queue.appendleft(job)
            q.not_empty.notify()

    def _give_up(self, job: _Job, why: str) -> None:
        stage = "correctness" if job.phase == "gpu" else "reference"
        job.future.set_result(Report(task=job.task_name, program_sha256="", outcome="error",
                                     stages=[StageResult(name=stage, status="error", message=why)]))

    def _stamp(self, job: _Job, report: Report) -> Report:
        return report.model_copy(update={"versions": {**report.versions, "ran_on": " + ".join(job.ran_on)}})

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            if w.thread.is_alive():
                w.jobs.put(None)
            else:  # never served: close its process here
                w._close()
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(timeout=30)

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge(cpu: Report, gpu: Report) -> Report:
    """One report from the CPU-stage and GPU-stage halves of a check."""
    stages = [*cpu.stages, *gpu.stages]
    return Report(task=cpu.task, program_sha256=cpu.program_sha256 or gpu.program_sha256,
                  outcome=Report.outcome_of(stages), stages=stages, versions={**cpu.versions, **gpu.versions},
                  cache_key=None, cached=cpu.cached and gpu.cached, created_utc=gpu.created_utc or cpu.created_utc)
