"""``coda-agent solve``: one task, the LLM loop (or an offline author), one run directory.

Exit status: 0 when some sample was accepted; 3 when none was but one passed
every stage this machine can run (``cpu_passed``: no GPU, so not an acceptance,
yet not a failure either: scripts can tell the two apart); 1 when none did;
2 for a problem the user must fix (no model configured, an unreachable endpoint
before any run, a bad task file), printed as one line that names the fix.
``CODA_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import importlib
import os
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from coda_agent.tasks.spec import TaskSpecError
from coda_agent.verifier.cli import EXIT_CODES

from .protocols import CodaError

EXIT_CPU_PASSED = EXIT_CODES["cpu_passed"]  # the code `coda-agent verify` gives the same outcome


class Author(str, Enum):
    llm = "llm"
    expert = "expert"
    replay = "replay"


def solve(
    task: Optional[Path] = typer.Argument(None, help="Task YAML, e.g. tasks/llama3/swiglu.yaml."),
    author: Optional[Author] = typer.Option(None, help="llm (default), expert (the task's human-written "
                                                       "program) or replay (a recorded transcript)."),
    transcript: Optional[Path] = typer.Option(None, help="replay: a run directory or its transcript.jsonl."),
    samples: Optional[int] = typer.Option(None, "--samples", "-k", help="Independent trajectories, run in parallel."),
    max_turns: Optional[int] = typer.Option(None, help="Model calls per trajectory [10]."),
    max_tokens: Optional[int] = typer.Option(None, help="Token budget (prompt + completion) of the whole run."),
    max_cost: Optional[float] = typer.Option(None, help="Money budget of the whole run, USD (needs a price)."),
    max_wall: Optional[float] = typer.Option(None, help="Wall-time budget of the whole run, seconds."),
    runs_dir: Path = typer.Option(Path("runs"), help="Where run directories go."),
    resume: Optional[Path] = typer.Option(None, help="Continue a killed or budget-stopped run directory."),
    base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible endpoint [OPENAI_BASE_URL]."),
    api_key: Optional[str] = typer.Option(None, help="API key [OPENAI_API_KEY]."),
    model: Optional[str] = typer.Option(None, help="Model name [CODA_MODEL]."),
    config: Optional[Path] = typer.Option(None, help="Config YAML [~/.config/coda-agent/config.yaml]."),
    temperature: Optional[float] = typer.Option(None),
    top_p: Optional[float] = typer.Option(None),
    max_output_tokens: Optional[int] = typer.Option(None, help="max_tokens of each reply."),
    seed: Optional[int] = typer.Option(None),
    timeout: Optional[float] = typer.Option(None, help="Seconds per model request [600]."),
    verifier: Optional[str] = typer.Option(None, hidden=True, help="module:factory of the Verifier."),
) -> None:
    """Write a program for one task with an LLM, verify it, feed failures back, until accepted."""
    flags = {"author": author.value if author else None, "transcript": str(transcript) if transcript else None,
             "verifier": verifier,
             "llm": {"base_url": base_url, "api_key": api_key, "model": model, "temperature": temperature,
                     "top_p": top_p, "max_tokens": max_output_tokens, "seed": seed, "timeout_s": timeout},
             "budget": {"samples": samples, "max_turns": max_turns, "max_tokens": max_tokens,
                        "max_cost": max_cost, "max_wall_s": max_wall}}
    try:
        summary, path = _solve(task, resume, runs_dir, config, flags)
    except (CodaError, TaskSpecError) as e:
        _fail(e)
    for r in summary["results"]:
        best = f", best attempt {r['best_attempt']:02d} ({r['best_outcome']})" if r["best_attempt"] else ""
        typer.echo(f"sample {r['sample']}: {r['stop_reason']} after {r['turns']} turns{best}")
        if r["stop_reason"] in ("model_error", "verifier_error", "format_errors"):
            typer.echo(f"  {r['detail'].strip().splitlines()[-1] if r['detail'].strip() else ''}", err=True)
    for final in ("accepted", "best"):
        report_md = sorted(path.glob(f"**/{final}/report.md"))
        if report_md:
            typer.echo(f"\n{report_md[0].read_text().split(chr(10) + chr(10), 2)[1]}")
            typer.echo(f"full report: {report_md[0]}")
            break
    cost = "unknown" if summary["cost_usd"] is None else f"${summary['cost_usd']:.4f}"
    typer.echo(f"accepted {summary['accepted']}/{summary['samples']}; tokens "
               f"{summary['prompt_tokens']}+{summary['completion_tokens']}, cost {cost}, {summary['wall_s']:.1f}s")
    if summary["accepted"]:
        raise typer.Exit(0)
    cpu_passed = any(r["stop_reason"] == "cpu_passed" for r in summary["results"])
    raise typer.Exit(EXIT_CPU_PASSED if cpu_passed else 1)


def _fail(e: Exception) -> None:
    if os.environ.get("CODA_DEBUG"):
        raise e
    typer.echo(f"Error: {e}", err=True)
    raise typer.Exit(2)


def _solve(task_path: Path | None, resume: Path | None, runs_dir: Path, config: Path | None,
           flags: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    from coda_agent.tasks import load_task

    from .config import load_config
    from .loop import solve as run_loop
    from .models import make_model
    from .prompt import load_catalogue
    from .rundir import RunDir

    if resume is not None:
        if task_path is not None:
            raise CodaError("give either TASK or --resume RUN: a resumed run keeps its task")
        run = RunDir.open(resume)
        saved = run.saved()
        task = load_task(saved["task_path"])
        if Path(task.path).read_bytes() != (run.path / "task.yaml").read_bytes():
            raise CodaError(f"{task.path} changed since the run started; resuming would mix two specs "
                            "(restore it or start a new run)")
        if flags["budget"]["samples"] not in (None, run.samples):
            raise CodaError(f"--samples: this run has {run.samples} samples; it cannot change on resume")
        cfg = load_config(flags, config, saved=saved["config"]).check()
    else:
        if task_path is None:
            raise CodaError("give a task YAML (e.g. tasks/llama3/swiglu.yaml) or --resume RUN")
        task = load_task(task_path)
        cfg = load_config(flags, config).check()
    # Everything that can fail for configuration reasons fails before a run directory exists.
    model, verifier, catalogue = make_model(cfg, task), _load_verifier(cfg.verifier), load_catalogue()
    if flags["budget"]["max_turns"] is None and resume is None:
        # Offline authors have a natural end: the expert says the same thing every turn, and a
        # replay ends where the recording did (not with a "transcript exhausted" model_error).
        if cfg.author == "expert":
            cfg.budget.max_turns = 1
        elif cfg.author == "replay":
            cfg.budget.max_turns = len(model.replies)
    if resume is None:
        label = cfg.llm.model if cfg.author == "llm" else cfg.author
        run = RunDir.create(runs_dir, task, label or "llm", cfg.model_dump(mode="json"))
    typer.echo(f"run: {run.path}")
    try:
        summary = run_loop(task, cfg, run, model, verifier, catalogue)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; continue with: coda-agent solve --resume {run.path}", err=True)
        raise typer.Exit(130) from None
    return summary, run.path


def _load_verifier(target: str):
    module, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise CodaError(f"cannot load the verifier {target!r} ({type(e).__name__}: {e}); "
                        "check the coda-agent install") from None
    return factory()
