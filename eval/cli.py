"""``coda-agent eval``, ``report``, ``review`` and ``export``.

Exit status of ``eval``, as ``solve``'s: 0 when some trajectory was accepted,
3 when none was but one passed every stage this machine can run
(``cpu_passed``), 1 when none did (every stop reason is in the output and in
summary.md/summary.json, with its message), 2 for a problem the user must fix,
130 when interrupted (resume with ``--resume BATCH``).  ``review``, ``report``
and ``export``: 0, or 2 with one ``error:`` line naming the fix
(``coda_agent/errors.py``).

A task file in the folder that cannot be loaded is reported and skipped: one
bad YAML does not stop the batch.  Budgets are per trajectory, as in ``solve``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from coda_agent.agent.cli import (API_KEY, BASE_URL, CONFIG, MAX_COST, MAX_TOKENS, MAX_TURNS, MAX_WALL, MODEL,
                                  TEMPERATURE, VERIFIER)
from coda_agent.agent.config import Author
from coda_agent.agent.protocols import CodaError
from coda_agent.verifier.cli import EXIT_CODES


def eval_batch(
    tasks: Optional[Path] = typer.Argument(None, help="A folder of task YAMLs (e.g. tasks/llama3) or one YAML."),
    only: Optional[str] = typer.Option(None, "--only", help="Names of the folder's tasks to run, comma-separated "
                                                            "[all of them]."),
    model: Optional[str] = MODEL,
    samples: Optional[int] = typer.Option(None, "--samples", "-k", help="Trajectories per task [1]."),
    workers: Optional[int] = typer.Option(None, help="CPU verification threads (default 1-2; plus one "
                                                     "per visible GPU)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Verify on a Ray cluster: auto (the one Ray finds, "
                                                          "else a local one) or its ADDRESS; needs "
                                                          "pip install 'coda-agent\\[ray]'."),
    concurrency: int = typer.Option(8, help="Trajectories (and so LLM calls) in flight at once."),
    author: Optional[Author] = typer.Option(None, help="llm (default), expert or replay."),
    transcript: Optional[Path] = typer.Option(None, help="replay: an earlier batch directory; task T sample i "
                                                         "replays its T/sample-i."),
    resume: Optional[Path] = typer.Option(None, help="Finish a killed batch: runs/batch-<utc>/."),
    sets: Optional[str] = typer.Option(None, "--sets", help="Shape sets the verifier's GPU stages check, "
                                                            "comma-separated [each task's own]."),
    max_turns: Optional[int] = MAX_TURNS,
    max_tokens: Optional[int] = MAX_TOKENS,
    max_cost: Optional[float] = MAX_COST,
    max_wall: Optional[float] = MAX_WALL,
    runs_dir: Path = typer.Option(Path("runs"), help="Where batch directories go."),
    base_url: Optional[str] = BASE_URL,
    api_key: Optional[str] = API_KEY,
    config: Optional[Path] = CONFIG,
    temperature: Optional[float] = TEMPERATURE,
    verifier: Optional[str] = VERIFIER,
) -> None:
    """Run every task k times (LLM calls in parallel, verification on a thread per GPU or on Ray); write a summary."""
    # The transcript path is kept absolute: each run's config.json names what it replays.
    flags = {"author": author.value if author else None,
             "transcript": str(transcript.resolve()) if transcript else None, "verifier": verifier,
             "llm": {"base_url": base_url, "api_key": api_key, "model": model, "temperature": temperature},
             "budget": {"max_turns": max_turns, "max_tokens": max_tokens, "max_cost": max_cost,
                        "max_wall_s": max_wall}}
    batch, summary = _eval(tasks, only, resume, samples, workers, ray, concurrency, runs_dir, config, sets, flags)
    from .summary import markdown

    typer.echo(markdown(summary))
    typer.echo(f"batch: {batch.path}  (summary.json, summary.md; HTML: coda-agent report {batch.path})")
    s = summary["suite"]
    if s["accepted_trajectories"]:
        raise typer.Exit(0)
    raise typer.Exit(EXIT_CODES["cpu_passed"] if s["cpu_passed_trajectories"] else 1)


def _load(tasks_path: Path, only: str | None = None) -> list:
    """The tasks of a folder (each bad file reported and skipped) or of one YAML; with ``only``,
    those of the names it lists (each must be one of the folder's tasks)."""
    from coda_agent.tasks import load_task
    from coda_agent.tasks.spec import scan_suite

    if not tasks_path.is_dir():
        tasks = [load_task(tasks_path)]
    else:
        tasks, errors = scan_suite(tasks_path)
        for e in errors:
            typer.echo(f"skipped: {e}", err=True)
        if not tasks:
            raise CodaError(f"{tasks_path}: none of its task files can be used (each error is above)")
    if only is None:
        return tasks
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {t.name for t in tasks}
    if not names or (unknown := [n for n in names if n not in known]):
        raise CodaError(f"--only: {', '.join(unknown) if names else 'no names given'}: "
                        f"not a task of {tasks_path}; its tasks are {', '.join(sorted(known))}")
    return [t for t in tasks if t.name in names]


def _eval(tasks_path: Path | None, only: str | None, resume: Path | None, samples: int | None,
          workers: int | None, ray: str | None, concurrency: int, runs_dir: Path, config: Path | None, sets: str | None,
          flags: dict[str, Any]):
    from coda_agent.agent.config import load_config
    from coda_agent.agent.prompt import load_catalogue
    from coda_agent.tasks.spec import shape_set_names

    from . import summary as batch_summary
    from .batch import BatchDir
    from .runner import run_batch

    if resume is not None:
        if tasks_path is not None or only is not None:
            raise CodaError("give either TASKS (and --only) or --resume BATCH: a resumed batch keeps its tasks")
        batch = BatchDir.open(resume)
        if samples not in (None, batch.samples):
            raise CodaError(f"--samples: this batch has {batch.samples} samples; it cannot change on resume")
        tasks = batch.load_tasks()
        saved = batch.meta["config"]
        flags["shape_sets"] = shape_set_names(sets, tasks)
        cfg = load_config(flags, config, saved=saved).check()
        turns_given = batch.meta["turns_given"] or flags["budget"]["max_turns"] is not None
    else:
        if tasks_path is None:
            raise CodaError("give a folder of task YAMLs (e.g. tasks/llama3) or --resume BATCH")
        tasks = _load(tasks_path, only)
        flags["shape_sets"] = shape_set_names(sets, tasks)
        cfg = load_config(flags, config).check()
        turns_given = flags["budget"]["max_turns"] is not None
    if samples is not None and samples < 1:
        raise CodaError("--samples must be at least 1")
    if ray is not None and workers is not None:
        raise CodaError("--workers sets this machine's verification threads; with --ray the cluster's "
                        "resources decide: give one of them")
    if cfg.author == "expert":
        lacking = [f"{t.name} ({t.path})" for t in tasks if t.expert_path is None]
        if lacking:
            raise CodaError(f"--author expert: {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} "
                            "no expert program; use --author llm, or give each an `expert:` file")
    catalogue = load_catalogue()
    # A bad --verifier (or --sets it cannot take) fails in the pool's constructor, before any batch exists.
    with _pool(cfg, workers, ray) as pool:
        if resume is None:
            batch = BatchDir.create(runs_dir, tasks, samples or 1, cfg.model_dump(mode="json"), turns_given,
                                    pool.meta())
        typer.echo(f"batch: {batch.path}  ({len(tasks)} tasks x {batch.samples} samples; {pool.describe()})",
                   err=True)
        try:
            run_batch(batch, tasks, cfg, pool, catalogue, concurrency, turns_given)
        except KeyboardInterrupt:
            typer.echo(f"interrupted; continue with: coda-agent eval --resume {batch.path}", err=True)
            # Exit now, as a kill would: trajectories still on their threads would keep the process
            # alive, and every run directory is safe to abandon mid-way.  A local Ray cluster is
            # ended first: its processes would outlive this one.
            pool.close(wait=False)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    return batch, batch_summary.write(batch)


def _pool(cfg, workers: int | None, ray: str | None):
    """Where the batch is verified: threads on this machine, or Ray tasks with ``--ray``."""
    if ray is not None:
        from .ray_pool import RayPool

        return RayPool(cfg, ray)
    from .pool import VerifierPool

    return VerifierPool(cfg, cpu_threads=workers)


def report(
    batch: Optional[Path] = typer.Argument(None, help="A batch directory, runs/batch-<utc>/ [the newest "
                                                       "under --runs-dir]."),
    runs_dir: Path = typer.Option(Path("runs"), help="Where to look for the newest batch."),
    html: Optional[Path] = typer.Option(None, help="Where the HTML page goes [BATCH/report.html]."),
) -> None:
    """Print a batch's summary as Markdown and write it as one self-contained HTML page with plots."""
    from coda_agent.storage import write_atomic

    from . import summary as batch_summary
    from .batch import BatchDir, newest_batch
    from .html import render

    b = BatchDir.open(batch if batch is not None else newest_batch(runs_dir))
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

    typer.echo(f"exported: {do_export(run, to, allow_cpu_only)}")
