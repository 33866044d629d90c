"""The user-facing error family and the one handler every ``coda-agent`` command goes through.

:class:`CodaError` is a problem the *user* fixes: a task file, a flag, a
configuration, an endpoint, a file that is not there.  Its message names the
fix, and the CLI prints it as one line, ``error: <message>``, and exits 2.
Every other exception is a bug and keeps its traceback.

The family, each defined where its concept lives and subclassing this one:
``TaskSpecError`` (``tasks/spec.py``: a task file that cannot be used),
``CatalogueError`` (``primitives/errors.py``: a program that misuses the
catalogue, with its line) and ``ModelError`` (``agent/protocols.py``: the model
endpoint failed for good).  What is wrong with a *candidate program* is not an
exception at all once the verifier has judged it: it is data in a Report.

``CODA_DEBUG=1`` re-raises instead, so the traceback shows, in every command.

This module imports nothing from the package, so every folder may use it.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

EXIT_USER_ERROR = 2

Command = TypeVar("Command", bound=Callable[..., Any])


class CodaError(Exception):
    """A problem the user fixes (a file, a flag, a configuration, an endpoint); the message says how."""


def handle_errors(command: Command) -> Command:
    """Wrap a typer command: a :class:`CodaError` becomes ``error: ...`` on stderr and exit 2.

    ``functools.wraps`` keeps the signature and docstring typer builds the
    command's options and help from."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CodaError as e:
            if os.environ.get("CODA_DEBUG"):
                raise
            import typer

            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None

    return run  # type: ignore[return-value]
