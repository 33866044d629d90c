"""``coda-agent tasks [DIR]``: list task specs with their families and shape sets."""

from pathlib import Path

import typer


def tasks(directory: Path = typer.Argument(None, help="A folder of task YAMLs (default: the "
                                                        "packaged LLaMA-3 suite).")) -> None:
    """List the tasks in DIR: name, families, gradients, shape sets."""
    from rich.console import Console
    from rich.table import Table

    from coda_agent.tasks import SUITE_DIR, TaskSpecError, load_suite

    try:
        suite = load_suite(directory or SUITE_DIR)
    except TaskSpecError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    table = Table(title=f"tasks in {directory or SUITE_DIR}")
    for col in ("task", "families", "backward", "shape sets", "summary"):
        table.add_column(col)
    for t in suite:
        s = t.spec
        table.add_row(s.name, ", ".join(s.families), "yes" if s.has_backward else "-",
                      ", ".join(s.shapes), s.summary.strip().splitlines()[0][:70])
    Console(width=200).print(table)
