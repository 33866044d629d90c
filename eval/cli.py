"""``coda-agent eval``, ``report``, ``review`` and ``export``.

Exit status: ``eval`` 0 when the batch finished (whatever was accepted: it is
a measurement, read summary.md), 2 for a problem the user must fix, 130 when
interrupted (resume with ``--resume BATCH``); ``review``/``report``/``export``
0, or 2 with one line naming the fix.  ``CODA_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from coda_agent.agent.cli import Author, _fail, _load_verifier
from coda_agent.agent.protocols import CodaError
from coda_agent.tasks.spec import TaskSpecError


def eval_batch(
    tasks: Optional[Path] = typer.Argument(None, help="A folder of task YAMLs (e.g. tasks/llama3) or one YAML."),
    model: Optional[str] = typer.Option(None, help="Model name [CODA_MODEL]."),
    samples: Optional[int] = typer.Option(None, "--samples", "-k", help="Trajectories per task [1]."),
    workers: Optional[int] = typer.Option(None, help="CPU verification workers (default 1-2; plus one "
                                                     "GPU worker per visible GPU)."),
    concurrency: int = typer.Option(8, help="Trajectories (and so LLM calls) in flight at once."),
    author: Optional[Author] = typer.Option(None, help="llm (default), expert or replay."),
    transcript: Optional[Path] = typer.Option(None, help="replay: an earlier batch directory; task T sample i "
                                                         "replays its T/sample-i."),
    resume: Optional[Path] = typer.Option(None, help="Finish a killed batch: runs/batch-<utc>/."),
    max_turns: Optional[int] = typer.Option(None, help="Model calls per trajectory [10]."),
    max_tokens: Optional[int] = typer.Option(None, help="Token budget of each trajectory."),
    max_cost: Optional[float] = typer.Option(None, help="Money budget of each trajectory, USD (needs a price)."),
    runs_dir: Path = typer.Option(Path("runs"), help="Where batch directories go."),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint [OPENAI_BASE_URL]."),
    api_key: Optional[str] = typer.Option(None, help="API key [OPENAI_API_KEY]."),
    config: Optional[Path] = typer.Option(None, help="Config YAML [~/.config/coda-agent/config.yaml]."),
    temperature: Optional[float] = typer.Option(None),
    verifier: Optional[str] = typer.Option(None, hidden=True, help="module:factory of the Verifier."),
) -> None:
    """Run every task k times (LLM calls in parallel, verification in a worker pool); write a summary."""
    # The transcript path is kept absolute: each run's config.json names what it replays.
    flags = {"author": author.value if author else None,
             "transcript": str(transcript.resolve()) if transcript else None, "verifier": verifier,
             "llm": {"base_url": base_url, "api_key": api_key, "model": model, "temperature": temperature},
             "budget": {"max_turns": max_turns, "max_tokens": max_tokens, "max_cost": max_cost}}
    try:
        batch, summary = _eval(tasks, resume, samples, workers, concurrency, runs_dir, config, flags)
    except (CodaError, TaskSpecError) as e:
        _fail(e)
    from .summary import markdown

    typer.echo(markdown(summary))
    typer.echo(f"batch: {batch.path}  (summary.json, summary.md; HTML: coda-agent report {batch.path})")


def _eval(tasks_path: Path | None, resume: Path | None, samples: int | None, workers: int | None,
          concurrency: int, runs_dir: Path, config: Path | None, flags: dict[str, Any]):
    from coda_agent.agent.config import load_config
    from coda_agent.agent.prompt import load_catalogue
    from coda_agent.tasks import load_suite, load_task

    from . import summary as batch_summary
    from .batch import BatchDir
    from .pool import VerifierPool
    from .runner import run_batch

    if resume is not None:
        if tasks_path is not None:
            raise CodaError("give either TASKS or --resume BATCH: a resumed batch keeps its tasks")
        batch = BatchDir.open(resume)
        if samples not in (None, batch.samples):
            raise CodaError(f"--samples: this batch has {batch.samples} samples; it cannot change on resume")
        tasks = batch.load_tasks()
        saved = batch.meta["config"]
        cfg = load_config(flags, config, saved=saved).check()
        turns_given = batch.meta["turns_given"] or flags["budget"]["max_turns"] is not None
    else:
        if tasks_path is None:
            raise CodaError("give a folder of task YAMLs (e.g. tasks/llama3) or --resume BATCH")
        tasks = load_suite(tasks_path) if tasks_path.is_dir() else [load_task(tasks_path)]
        cfg = load_config(flags, config).check()
        turns_given = flags["budget"]["max_turns"] is not None
    if samples is not None and samples < 1:
        raise CodaError("--samples must be at least 1")
    _load_verifier(cfg.verifier)  # a bad --verifier fails here, not in every worker process
    catalogue = load_catalogue()
    with VerifierPool(cfg.verifier, cpu_workers=workers) as pool:
        workers_meta = {"cpu": sum(w.name.startswith("cpu") for w in pool.workers), "gpus": pool.gpus}
        if resume is None:
            batch = BatchDir.create(runs_dir, tasks, samples or 1, cfg.model_dump(mode="json"), turns_given,
                                    workers_meta)
        typer.echo(f"batch: {batch.path}  ({len(tasks)} tasks x {batch.samples} samples; {pool.describe()})",
                   err=True)
        try:
            run_batch(batch, tasks, cfg, pool, catalogue, concurrency, turns_given)
        except KeyboardInterrupt:
            typer.echo(f"interrupted; continue with: coda-agent eval --resume {batch.path}", err=True)
            # Exit now, as a kill would: trajectories still on their threads would keep the process
            # alive, and every run directory is safe to abandon mid-way.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    return batch, batch_summary.write(batch)


def report(
    batch: Path = typer.Argument(..., help="A batch directory (runs/batch-<utc>/)."),
    html: Optional[Path] = typer.Option(None, help="Where the HTML page goes [BATCH/report.html]."),
) -> None:
    """Print a batch's summary as Markdown and write it as one self-contained HTML page with plots."""
    from coda_agent.storage import write_atomic

    from . import summary as batch_summary
    from .batch import BatchDir
    from .html import render

    try:
        b = BatchDir.open(batch)
    except CodaError as e:
        _fail(e)
    summary = batch_summary.write(b)
    out = html or b.path / "report.html"
    write_atomic(out, render(summary))
    typer.echo(batch_summary.markdown(summary))
    typer.echo(f"HTML: {out}")


def review(
    runs: Path = typer.Argument(Path("runs"), help="A trajectory directory to show (or decide on), or a "
                                                  "folder to list the kernels awaiting review under."),
    approve: bool = typer.Option(False, "--approve", help="Approve RUN's program."),
    reject: bool = typer.Option(False, "--reject", help="Reject RUN's program (with --why)."),
    why: str = typer.Option("", help="The reason, recorded with the decision."),
    who: Optional[str] = typer.Option(None, help="Reviewer [$USER, else git user.name]."),
    allow_cpu_only: bool = typer.Option(False, "--allow-cpu-only",
                                        help="Allow approving a cpu_passed program (GPU stages never ran)."),
    all_: bool = typer.Option(False, "--all", help="List reviewed kernels too."),
) -> None:
    """List kernels awaiting review, show one (program, report, diff to the expert, transcript), decide."""
    from . import review as rv

    try:
        c = rv.candidate(runs)
        if approve or reject:
            if approve and reject:
                raise CodaError("give --approve or --reject, not both")
            if c is None:
                raise CodaError(f"{runs}: not a trajectory directory with an accepted/ (or cpu_passed best/) "
                                "program; list them with: coda-agent review runs")
            rec = rv.decide(c, "approved" if approve else "rejected", who or rv.default_who(), why, allow_cpu_only)
            typer.echo(f"{rec['decision']} by {rec['who']} at {rec['when']}: {c.path / 'review.json'}")
            return
        if c is not None:
            typer.echo(rv.show(c))
            return
        if not runs.is_dir():
            raise CodaError(f"{runs}: no such directory")
    except CodaError as e:
        _fail(e)
    _list(rv, runs, all_)


def _list(rv, root: Path, show_all: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    found = [c for c in rv.find_candidates(root) if show_all or c.review() is None]
    if not found:
        typer.echo(f"nothing awaiting review under {root}" + ("" if show_all else " (--all lists reviewed ones)"))
        return
    table = Table(title=f"kernels {'under' if show_all else 'awaiting review under'} {root}")
    for col in ("run", "task", "status", "turns", "review"):
        table.add_column(col, overflow="fold")
    for c in found:
        task = c.report()["task"]
        table.add_row(str(c.path), task, "accepted" if not c.cpu_only else "NOT accepted: CPU stages only",
                      str(c.result["turns"]), rv.status(c))
    Console(width=200).print(table)


def export(
    run: Path = typer.Argument(..., help="An approved trajectory directory."),
    to: Path = typer.Option(..., "--to", help="Folder to write the module into."),
    allow_cpu_only: bool = typer.Option(False, "--allow-cpu-only",
                                        help="Export a cpu_passed program approved with --allow-cpu-only."),
) -> None:
    """Write an approved kernel as an importable module (a torch.autograd.Function) with its report."""
    from .export import export as do_export

    try:
        path = do_export(run, to, allow_cpu_only)
    except CodaError as e:
        _fail(e)
    typer.echo(f"exported: {path}")
