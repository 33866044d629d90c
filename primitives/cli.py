"""``coda-agent catalogue``: print the catalogue as Markdown."""

from pathlib import Path

import typer

from coda_agent.storage import write_atomic


def catalogue(out: Path = typer.Option(None, "--out", "-o", help="Write the Markdown here.")) -> None:
    """Render the epilogue catalogue (signatures, semantics, constraints, examples)."""
    from coda_agent.primitives import render_catalogue

    text = render_catalogue()
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(out, text)
        typer.echo(f"wrote {out}")
