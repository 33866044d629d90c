"""``coda-agent verify TASK PROGRAM.py``: the same checks the agent's candidates get.

Exit status: 0 accepted (correct and fast: every stage passed on a Hopper
GPU, the speed targets included); 4 correct_slow (correct on the GPU, slower
than a target: not an acceptance); 3 cpu_passed (every stage that ran passed,
GPU stages skipped: not an acceptance); 1 rejected (a stage failed: the program
is wrong, cheats, or is impossibly fast); 2 error (the verifier could not
judge, or the task file / arguments are unusable).  Missing a speed target is
never a pass: there is no switch that makes it one.

The verdict is also written as a run directory (unless ``--no-save``), so
``coda-agent review`` and ``export`` work on a hand-written program.  Run
directories belong to the agent layer above the verifier, so the writer is
handed to this command through typer's context object by the top-level CLI
(``cli.py``: ``ctx.obj["record_verdict"]``, agent/verdict.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from coda_agent.errors import CodaError

EXIT_CODES = {"accepted": 0, "rejected": 1, "error": 2, "cpu_passed": 3, "correct_slow": 4}


def verify(
    ctx: typer.Context,
    task: Path = typer.Argument(..., help="task YAML, e.g. tasks/llama3/swiglu_fwd.yaml"),
    program: Path = typer.Argument(..., help="the epilogue program (a .py file)"),
    stages: str = typer.Option("", help="comma-separated subset of "
                               "static,reference,compile,correctness,launch_audit,performance (without "
                               "static the program also runs with Python's full builtins)"),
    sets: Optional[str] = typer.Option(None, "--sets", help="shape sets the GPU stages check, comma-separated "
                                                            "(default: the task's own); the CPU reference stage "
                                                            "checks every CPU-sized one and a size drawn past "
                                                            "them"),
    runs_dir: Path = typer.Option(Path("runs"), help="where the verdict's run directory goes"),
    save: bool = typer.Option(True, "--save/--no-save", help="write the verdict as a run directory "
                                                             "(for review and export)"),
    json_out: bool = typer.Option(False, "--json", help="print the Report as JSON"),
    timeout: float = typer.Option(600.0, help="seconds the program may run (waiting for the GPU not counted)"),
    load_timeout: float = typer.Option(60.0, help="seconds each load of the program may take"),
    no_cache: bool = typer.Option(False, "--no-cache", help="ignore and do not write cached verdicts"),
    no_compile_cache: bool = typer.Option(False, "--no-compile-cache",
                                          help="recompile even if an identical compile passed before"),
) -> None:
    """Verify PROGRAM against TASK. Exit 0 accepted, 4 correct_slow, 3 cpu_passed (GPU stages skipped),
    1 rejected, 2 error."""
    from coda_agent.tasks.spec import load_task, shape_set_names
    from coda_agent.verifier import Verifier
    from coda_agent.verifier.feedback import render_feedback
    from coda_agent.verifier.report import headline

    loaded = load_task(task)
    if not program.is_file():
        raise CodaError(f"{program}: no such program file (give the .py file of the epilogue program)")
    source = program.read_text()
    try:
        verifier = Verifier(stages=[s.strip() for s in stages.split(",") if s.strip()] or None,
                            timeout_s=timeout, load_timeout_s=load_timeout, cache=not no_cache,
                            compile_cache=not no_compile_cache, shape_sets=shape_set_names(sets, [loaded]))
    except ValueError as e:  # an unknown stage
        raise CodaError(f"--stages: {e}") from None
    report = verifier.check(loaded, source)
    if json_out:
        typer.echo(report.model_dump_json(indent=2))
    elif sys.stdout.isatty():
        _print_table(report)
        typer.echo(render_feedback(report, source))
    else:
        for s in report.stages:
            typer.echo(f"{s.name:13s} {s.status:8s} {s.seconds:7.1f}s  {headline(s.message)}")
        typer.echo(f"outcome: {report.outcome}{' (cached)' if report.cached else ''}")
        typer.echo(render_feedback(report, source))
    if save:
        run = ctx.obj["record_verdict"](runs_dir, loaded, program, source, report, verifier.config())
        typer.echo(f"run: {run}  (coda-agent review {run})", err=json_out)
    raise typer.Exit(EXIT_CODES[report.outcome])


def _print_table(report) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from coda_agent.verifier.report import headline

    colour = {"passed": "green", "slow": "yellow", "failed": "red", "skipped": "yellow", "error": "magenta"}
    table = Table(title=f"{report.task}: {report.outcome}{' (cached)' if report.cached else ''}")
    for col in ("stage", "status", "s", "message"):
        table.add_column(col)
    for s in report.stages:
        table.add_row(s.name, f"[{colour[s.status]}]{s.status}[/]", f"{s.seconds:.1f}", escape(headline(s.message)))
    Console().print(table)
