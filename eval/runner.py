"""Running a batch: every (task, sample) is one agent trajectory, run on a thread.

The trajectories' LLM calls run concurrently (``concurrency`` threads; their
time goes into the endpoint and the verifier, not Python) and every one calls
the same pool (:class:`~.pool.VerifierPool`, a thread per GPU, or
:class:`~.ray_pool.RayPool`), which bounds verification by its threads or
the cluster's resources.  Each trajectory is ``agent.loop.solve`` on its own run
directory (``samples=1``), so budgets, stop reasons, logging and resume are the
agent's own; this module only decides what to run and shows progress.

Resume: a trajectory whose ``result.json`` has a stop reason is finished and
skipped, except ``model_error`` (an endpoint outage), which is asked again;
any other (never started, or killed mid-way) is run, and the loop continues it
from its transcript without repeating a judged attempt.

Authors: ``llm``; ``expert`` (one turn: the task's program); ``replay`` of a
previous *batch*: task T sample i replays ``BATCH/T/sample-(i mod n)``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda_agent.agent.config import AgentConfig
from coda_agent.agent.loop import DONE
from coda_agent.agent.protocols import CodaError, Verifier

from .batch import BatchDir

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task


def trajectory_config(cfg: AgentConfig, task: "Task", sample: int, turns_given: bool) -> AgentConfig:
    """The config of one trajectory: one sample; replay's transcript; the offline authors' natural end."""
    t = cfg.model_copy(deep=True)
    t.budget.samples = 1
    if cfg.author == "replay":
        t.transcript = str(replay_source(Path(cfg.transcript or ""), task.name, sample))
    if not turns_given:  # as in `solve`: the expert says the same thing every turn, a replay ends where it did
        if cfg.author == "expert":
            t.budget.max_turns = 1
        elif cfg.author == "replay":
            from coda_agent.agent.models import ReplayModel

            t.budget.max_turns = len(ReplayModel(t.transcript or "").replies)
    return t


def replay_source(batch_path: Path, task: str, sample: int) -> Path:
    folder = batch_path / task
    runs = sorted(folder.glob("sample-*"), key=lambda p: int(p.name.split("-")[1])) if folder.is_dir() else []
    if not runs:
        raise CodaError(f"--transcript {batch_path}: no {task}/sample-*/ run to replay; give a batch directory "
                        "of an earlier `coda-agent eval` over the same tasks")
    return runs[sample % len(runs)]


def finished(batch: BatchDir, task: str, sample: int) -> bool:
    result = batch.result(task, sample) or {}
    # model_error (the endpoint was down or refused) is worth asking again; every other stop is final.
    return result.get("stop_reason") not in (None, "model_error")


def trajectory_line(task: str, sample: int, result: dict[str, Any]) -> str:
    """One finished trajectory: its stop reason, and the message of a stop that passed nothing."""
    line = f"{task} sample {sample}: {result['stop_reason']} after {result['turns']} turns"
    detail = result.get("detail", "").strip()
    if detail and result["stop_reason"] not in DONE:
        line += f": {detail.splitlines()[-1]}"
    return line


class Progress:
    """Counts for the live display, read from each trajectory's result.json (rewritten after
    every turn, so tokens and cost move while trajectories run)."""

    def __init__(self, batch: BatchDir):
        self.batch, self.started = batch, time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        b = self.batch
        results = {t: [b.result(t, i) or {} for i in range(b.samples)]
                   for t in b.task_names()}
        flat = [r for rs in results.values() for r in rs]
        costs = [r.get("cost_usd", 0.0) for r in flat]
        return {"tasks_done": sum(all(r.get("stop_reason") for r in rs) for rs in results.values()),
                "tasks": len(results), "done": sum(bool(r.get("stop_reason")) for r in flat), "total": len(flat),
                "accepted": sum(bool(r.get("accepted")) for r in flat),
                "cpu_passed": sum(r.get("stop_reason") == "cpu_passed" for r in flat),
                "tokens": sum(r.get("prompt_tokens", 0) + r.get("completion_tokens", 0) for r in flat),
                "cost": None if None in costs else sum(costs), "elapsed": time.monotonic() - self.started}

    @staticmethod
    def line(s: dict[str, Any]) -> str:
        cost = "unknown" if s["cost"] is None else f"${s['cost']:.4f}"
        return (f"tasks {s['tasks_done']}/{s['tasks']} | trajectories {s['done']}/{s['total']} | "
                f"accepted {s['accepted']} | cpu_passed {s['cpu_passed']} | tokens {s['tokens']} | "
                f"cost {cost} | {s['elapsed']:.0f}s")


def run_batch(batch: BatchDir, tasks: list["Task"], cfg: AgentConfig, verifier: Verifier, catalogue: str,
              concurrency: int, turns_given: bool) -> None:
    """Run every unfinished trajectory of the batch; returns when all have stopped."""
    from coda_agent.agent.loop import solve as run_loop
    from coda_agent.agent.models import make_model

    label = cfg.llm.model if cfg.author == "llm" else cfg.author
    todo = [(t, i) for t in tasks for i in range(batch.samples) if not finished(batch, t.name, i)]
    skipped = len(tasks) * batch.samples - len(todo)
    batch.clean_staging()
    # Everything that can fail for configuration reasons fails before any trajectory runs.
    plans = []
    for task, i in todo:
        tcfg = trajectory_config(cfg, task, i, turns_given)
        plans.append((task, i, tcfg, make_model(tcfg, task)))

    def one(plan) -> None:
        task, i, tcfg, model = plan
        run = batch.run(task, i, label or "llm", tcfg.model_dump(mode="json"))
        summary = run_loop(task, tcfg, run, model, verifier, catalogue)
        display.print(trajectory_line(task.name, i, summary["results"][0]))

    with _Display(Progress(batch)) as display:
        if skipped:
            display.print(f"resuming: {skipped} finished trajectories kept, {len(todo)} to run")
        ex = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="trajectory")
        try:
            for f in [ex.submit(one, p) for p in plans]:
                f.result()
        except BaseException:
            # Ctrl-C (or a crash): do not wait for running trajectories; their run directories are
            # safe to abandon at any point and `--resume` continues them.
            ex.shutdown(wait=False, cancel_futures=True)
            raise
        ex.shutdown()
    batch.clean_staging()


class _Display:
    """On a terminal, a rich progress bar over the batch's counts, refreshed every second;
    elsewhere (logs, CI) the per-trajectory lines and a final counts line are the progress."""

    def __init__(self, progress: Progress):
        from rich.console import Console

        self.progress, self.console = progress, Console(stderr=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "_Display":
        if self.console.is_terminal:
            from rich.console import Group
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn
            from rich.text import Text

            self._bar = Bar(TextColumn("trajectories"), BarColumn(), MofNCompleteColumn(), console=self.console)
            self._id = self._bar.add_task("batch", total=self.batch_size())
            self._counts = Text(no_wrap=True, overflow="ellipsis")
            self._live = Live(Group(self._bar, self._counts), console=self.console, refresh_per_second=2)
            self._live.start()
            self._thread = threading.Thread(target=self._refresh, daemon=True)
            self._thread.start()
        return self

    def batch_size(self) -> int:
        return len(self.progress.batch.task_names()) * self.progress.batch.samples

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def _update(self) -> None:
        s = self.progress.snapshot()
        self._bar.update(self._id, completed=s["done"])
        self._counts.plain = self.progress.line(s)

    def _refresh(self) -> None:
        while not self._stop.wait(1.0):
            self._update()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._update()
            self._live.stop()
        else:
            self.print(self.progress.line(self.progress.snapshot()))
