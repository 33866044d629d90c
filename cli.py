"""The ``coda-agent`` command: a typer app; each command group lives in its own folder.

Every command goes through one error handler (``coda_agent/errors.py``): a
problem the user fixes is one ``error: ...`` line and exit 2, the same in every
command; ``CODA_DEBUG=1`` shows the traceback instead.
"""

import typer

from coda_agent.agent.cli import solve
from coda_agent.errors import handle_errors
from coda_agent.eval.cli import eval_batch, export, report, review
from coda_agent.primitives.cli import catalogue
from coda_agent.tasks.cli import tasks_app
from coda_agent.verifier.cli import verify

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="LLM-written GEMM-epilogue programs for Hopper, verified against PyTorch.")


@app.callback()
def main(ctx: typer.Context) -> None:
    """coda-agent: solve, verify, eval, review."""
    from coda_agent.agent.verdict import record_verdict

    # `verify` records its verdict as a run directory; that code lives in the agent layer,
    # above the verifier, so it is handed down here rather than imported there.
    ctx.obj = {"record_verdict": record_verdict}


app.command()(handle_errors(solve))
app.command("verify")(handle_errors(verify))
app.command()(handle_errors(catalogue))
app.command("eval")(handle_errors(eval_batch))
app.command()(handle_errors(report))
app.command()(handle_errors(review))
app.command()(handle_errors(export))
app.add_typer(tasks_app, name="tasks")

if __name__ == "__main__":
    app()
