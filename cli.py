"""The ``coda-agent`` command: a typer app; each command group lives in its own folder."""

import typer

from coda_agent.agent.cli import solve
from coda_agent.eval.cli import eval_batch, export, report, review
from coda_agent.primitives.cli import catalogue
from coda_agent.tasks.cli import tasks
from coda_agent.verifier.cli import verify

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="LLM-written GEMM-epilogue programs for Hopper, verified against PyTorch.")


@app.callback()
def main() -> None:
    """coda-agent: solve, verify, eval, review."""


app.command()(solve)
app.command("verify")(verify)
app.command()(catalogue)
app.command()(tasks)
app.command("eval")(eval_batch)
app.command()(report)
app.command()(review)
app.command()(export)

if __name__ == "__main__":
    app()
