"""The catalogue's one error type, a member of the user-facing family (``coda_agent/errors.py``).

A program that misuses the catalogue (an undeclared operand, a wrong kind or
shape, a Python ``if`` on a traced value) raises :class:`CatalogueError` with a
message that names the fix, as early as possible: at decoration time when the
program is loaded, else at the ``gemm`` call, always before compiling.  The
verifier quotes the message and ``line`` back to the LLM.
"""

from __future__ import annotations

from coda_agent.errors import CodaError


class CatalogueError(CodaError, ValueError):
    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line
