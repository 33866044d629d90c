"""``coda-agent solve``: one task, the LLM loop (or an offline author), one run directory.

Exit status: 0 when some sample was accepted; 3 when none was but one passed
every stage this machine can run (``cpu_passed``: no GPU, so not an acceptance,
yet not a failure either: scripts can tell the two apart); 1 when none did;
2 for a problem the user must fix (no model configured, a bad task file or
flag), printed as one ``error:`` line that names the fix (``coda_agent/errors.py``).

Each turn is shown as it happens (``display.py``); the run directory has
everything.  Budgets (``--max-tokens``, ``--max-cost``, ``--max-wall``) are per
trajectory, as in ``eval``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from coda_agent.verifier.cli import EXIT_CODES

from .config import Author
from .protocols import CodaError

EXIT_CPU_PASSED = EXIT_CODES["cpu_passed"]  # the code `coda-agent verify` gives the same outcome


# The options `solve` and `eval` share (eval/cli.py takes them from here), so they mean and say the same.
MAX_TURNS = typer.Option(None, help="Model calls per trajectory [10].")
MAX_TOKENS = typer.Option(None, help="Token budget (prompt + completion) of each trajectory.")
MAX_COST = typer.Option(None, help="Money budget of each trajectory, USD (needs a price).")
MAX_WALL = typer.Option(None, help="Wall-time budget of each trajectory, seconds (retries of a failing "
                                   "endpoint included).")
BASE_URL = typer.Option(None, help="OpenAI-compatible endpoint [OPENAI_BASE_URL].")
API_KEY = typer.Option(None, help="API key [OPENAI_API_KEY].")
MODEL = typer.Option(None, help="Model name [CODA_MODEL].")
CONFIG = typer.Option(None, help="Config YAML [~/.config/coda-agent/config.yaml].")
TEMPERATURE = typer.Option(None)
VERIFIER = typer.Option(None, hidden=True, help="module:factory of the Verifier.")


def solve(
    task: Optional[Path] = typer.Argument(None, help="Task YAML, e.g. tasks/llama3/swiglu_fwd.yaml."),
    author: Optional[Author] = typer.Option(None, help="llm (default), expert (the task's human-written "
                                                       "program) or replay (a recorded transcript)."),
    transcript: Optional[Path] = typer.Option(None, help="replay: a run directory or its transcript.jsonl."),
    samples: Optional[int] = typer.Option(None, "--samples", "-k", help="Independent trajectories, run in parallel."),
    sets: Optional[str] = typer.Option(None, "--sets", help="Shape sets the verifier's GPU stages check, "
                                                            "comma-separated [the task's own]."),
    max_turns: Optional[int] = MAX_TURNS,
    max_tokens: Optional[int] = MAX_TOKENS,
    max_cost: Optional[float] = MAX_COST,
    max_wall: Optional[float] = MAX_WALL,
    runs_dir: Path = typer.Option(Path("runs"), help="Where run directories go."),
    resume: Optional[Path] = typer.Option(None, help="Continue a killed or budget-stopped run directory."),
    base_url: Optional[str] = BASE_URL,
    api_key: Optional[str] = API_KEY,
    model: Optional[str] = MODEL,
    config: Optional[Path] = CONFIG,
    temperature: Optional[float] = TEMPERATURE,
    top_p: Optional[float] = typer.Option(None),
    max_output_tokens: Optional[int] = typer.Option(None, help="max_tokens of each reply."),
    seed: Optional[int] = typer.Option(None),
    timeout: Optional[float] = typer.Option(None, help="Seconds per model request [600]."),
    verifier: Optional[str] = VERIFIER,
) -> None:
    """Write a program for one task with an LLM, verify it, feed failures back, until accepted."""
    flags = {"author": author.value if author else None, "transcript": str(transcript) if transcript else None,
             "verifier": verifier,
             "llm": {"base_url": base_url, "api_key": api_key, "model": model, "temperature": temperature,
                     "top_p": top_p, "max_tokens": max_output_tokens, "seed": seed, "timeout_s": timeout},
             "budget": {"samples": samples, "max_turns": max_turns, "max_tokens": max_tokens,
                        "max_cost": max_cost, "max_wall_s": max_wall}}
    summary, path = _solve(task, resume, runs_dir, config, sets, flags)
    for r in summary["results"]:
        best = f", best attempt {r['best_attempt']:02d} ({r['best_outcome']})" if r["best_attempt"] else ""
        typer.echo(f"sample {r['sample']}: {r['stop_reason']} after {r['turns']} turns{best}")
        if r["stop_reason"] in ("model_error", "verifier_error", "format_errors", "wall_time"):
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


def _solve(task_path: Path | None, resume: Path | None, runs_dir: Path, config: Path | None,
           sets: str | None, flags: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    from coda_agent.tasks import load_task
    from coda_agent.tasks.spec import shape_set_names

    from .config import load_config
    from .display import TurnDisplay
    from .loop import solve as run_loop
    from .models import make_model
    from .prompt import load_catalogue
    from .rundir import RunDir
    from .verdict import AUTHOR as VERIFY_AUTHOR

    if resume is not None:
        if task_path is not None:
            raise CodaError("give either TASK or --resume RUN: a resumed run keeps its task")
        run = RunDir.open(resume)
        saved = run.saved()
        if saved["config"].get("author") == VERIFY_AUTHOR:
            raise CodaError(f"--resume {resume}: this is a `coda-agent verify` verdict, not a solve run; "
                            "there is nothing to resume")
        task = load_task(saved["task_path"])
        if Path(task.path).read_bytes() != (run.path / "task.yaml").read_bytes():
            raise CodaError(f"{task.path} changed since the run started; resuming would mix two specs "
                            "(restore it or start a new run)")
        if flags["budget"]["samples"] not in (None, run.samples):
            raise CodaError(f"--samples: this run has {run.samples} samples; it cannot change on resume")
        flags["shape_sets"] = shape_set_names(sets, [task])
        cfg = load_config(flags, config, saved=saved["config"]).check()
    else:
        if task_path is None:
            raise CodaError("give a task YAML (e.g. tasks/llama3/swiglu_fwd.yaml) or --resume RUN")
        task = load_task(task_path)
        flags["shape_sets"] = shape_set_names(sets, [task])
        cfg = load_config(flags, config).check()
    # Everything that can fail for configuration reasons fails before a run directory exists.
    model, verifier, catalogue = make_model(cfg, task), cfg.load_verifier(), load_catalogue()
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
        with TurnDisplay(cfg.budget.samples) as display:
            summary = run_loop(task, cfg, run, model, verifier, catalogue, on_event=display)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; continue with: coda-agent solve --resume {run.path}", err=True)
        raise typer.Exit(130) from None
    return summary, run.path
