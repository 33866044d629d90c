"""``coda-agent tasks``: list task specs, write a new one from its reference, check them.

- ``coda-agent tasks [list [DIR]]``: the tasks in DIR (the packaged LLaMA-3 suite
  by default) as a table as wide as the terminal; a file that does not load is
  reported under the table and skipped.
- ``coda-agent tasks new NAME --reference ref.py:fn --shapes small=T:256,H:128
  --input x=T,H ...``: write ``NAME.yaml`` from the reference (``skeleton.py``),
  never over an existing file.
- ``coda-agent tasks check [PATH ...]``: load each task file (or every file of a
  folder) as the verifier would, and list every problem, TODOs included; exit 1
  while any is left.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from coda_agent.errors import CodaError, handle_errors
from coda_agent.storage import write_atomic

tasks_app = typer.Typer(help="List, write and check task specs.", no_args_is_help=False)


@tasks_app.callback(invoke_without_command=True)
def tasks(ctx: typer.Context) -> None:
    """The tasks of the packaged LLaMA-3 suite (see `tasks list DIR`, `tasks new`, `tasks check`)."""
    if ctx.invoked_subcommand is None:
        show(None)


@tasks_app.command("list")
@handle_errors
def show(directory: Optional[Path] = typer.Argument(None, help="A folder of task YAMLs [the packaged "
                                                               "LLaMA-3 suite].")) -> None:
    """List the tasks in DIR: name, families, gradients, shape sets."""
    from rich.console import Console
    from rich.table import Table

    from coda_agent.tasks import SUITE_DIR
    from coda_agent.tasks.spec import scan_suite

    folder = directory or SUITE_DIR
    found, errors = scan_suite(folder)
    table = Table(title=f"tasks in {folder}")
    table.add_column("task", no_wrap=True)
    for col in ("families", "backward", "shape sets", "summary"):
        table.add_column(col, overflow="fold")
    for t in found:
        s = t.spec
        table.add_row(s.name, ", ".join(s.families), "yes" if s.has_backward else "-",
                      ", ".join(s.shapes), _first_sentence(s.summary))
    Console().print(table)
    for e in errors:
        typer.echo(f"skipped: {e}", err=True)


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[:end + 1]


@tasks_app.command("new")
@handle_errors
def new(
    name: str = typer.Argument(..., help="The task's name (the file is NAME.yaml)."),
    reference: str = typer.Option(..., help="The PyTorch reference: FILE.py:FUNCTION (relative to the current "
                                            "folder) or MODULE:FUNCTION."),
    shapes: List[str] = typer.Option(..., "--shapes", help="A shape set, NAME=SYMBOL:INT,...; repeat it (two "
                                                           "sets that differ pin the symbolic shapes down)."),
    inputs: List[str] = typer.Option([], "--input", help="A tensor input, NAME=DIM,...[:DTYPE] (DIMs are "
                                                         "expressions of the symbols; dtype bf16 by default)."),
    params: List[str] = typer.Option([], "--param", help="A param, NAME=VALUE [the reference's defaults]."),
    gradients: str = typer.Option("", help="Inputs that get gradients, comma-separated [none: forward only]."),
    out: Path = typer.Option(Path("."), help="The folder the task file goes into."),
) -> None:
    """Write a task file from its reference: call it on each shape set to fill in the outputs."""
    import yaml

    from .skeleton import parse_inputs, parse_params, parse_shapes, skeleton
    from .messages import task_name_problem, todo_fields
    from .spec import reference_problem

    problem = task_name_problem(name)
    if problem:  # NAME is also the file's name: a path here would write somewhere else than --out
        raise CodaError(f"NAME {problem}" if problem.startswith("is") else f"NAME: {problem}")
    if out.exists() and not out.is_dir():
        raise CodaError(f"--out {out} is a file; give the folder the task file goes into")
    path = out / f"{name}.yaml"
    if path.exists():
        raise CodaError(f"{path} exists; remove it or give another NAME or --out (nothing is overwritten)")
    if reference_problem(reference):
        raise CodaError(f"--reference {reference_problem(reference)}")
    where, _, fn = reference.rpartition(":")
    if where.endswith(".py"):  # given relative to here; the task file names it relative to itself
        file = Path(where).resolve()
        if not file.is_file():
            raise CodaError(f"--reference {reference}: {file} does not exist")
        reference = f"{_relative(file, out.resolve())}:{fn}"
    text = skeleton(name, reference, out.resolve(), parse_shapes(shapes), parse_inputs(inputs),
                    parse_params(params), [g.strip() for g in gradients.split(",") if g.strip()])
    write_atomic(path, text)
    todos = [field for field, _ in todo_fields(yaml.safe_load(text))]
    typer.echo(f"wrote {path}; fill in {', '.join(todos)} (the TODOs), then: coda-agent tasks check {path}")


def _relative(file: Path, folder: Path) -> str:
    import os

    return Path(os.path.relpath(file, folder)).as_posix()


def _task_folders(paths: list[Path]) -> list[Path]:
    """``paths`` with a folder that holds no task file replaced by its subfolders that do (a user's
    folder of task folders), run directories aside."""
    out = []
    for path in paths:
        subs = sorted(p for p in path.iterdir() if p.is_dir() and p.name != "runs" and any(p.glob("*.yaml"))) \
            if path.is_dir() and not any(path.glob("*.yaml")) else []
        out += subs or [path]
    return out


@tasks_app.command("check")
@handle_errors
def check(paths: List[Path] = typer.Argument(None, help="Task YAMLs or folders of them [the packaged "
                                                        "LLaMA-3 suite].")) -> None:
    """Load each task as the verifier would and list every problem (TODOs included); exit 1 while any is left."""
    from coda_agent.tasks import SUITE_DIR
    from coda_agent.tasks.lint import (kinks_on_the_default_rule, parameters_as_activations, unstorable_results,
                                       undrawn_values, unvaried_params, whole_number_floats)
    from coda_agent.tasks.spec import TaskSpecError, load_task, scan_suite

    problems = 0
    for path in _task_folders(paths or [SUITE_DIR]):
        if path.is_dir():
            found, errors = scan_suite(path)
        else:
            try:
                found, errors = [load_task(path)], []
            except TaskSpecError as e:
                found, errors = [], [e]
        for t in found:
            found_here = (undrawn_values(t) + unvaried_params(t) + whole_number_floats(t) + unstorable_results(t)
                          + parameters_as_activations(t) + kinks_on_the_default_rule(t))
            for problem in found_here:
                typer.echo(f"{t.path}: {problem}")
            problems += bool(found_here)
            if not found_here:
                typer.echo(f"ok: {t.name} ({t.path})")
        for e in errors:
            typer.echo(str(e))
        problems += len(errors)
    if problems:
        typer.echo(f"{problems} task file{'s' if problems != 1 else ''} to fix", err=True)
        raise typer.Exit(1)
