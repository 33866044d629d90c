"""Python source to its syntax tree, one parse at a time across threads.

CPython 3.11 keeps the ``ast`` module's recursion depth for turning a parse into Python objects in
state the threads share (CPython issue 106905, fixed in later releases), so two threads parsing
at once can fail with ``SystemError: AST constructor recursion depth mismatch``.  The batch's
verification threads each run the static stage on a program, and the loop's threads read task
files and sources, so every parse in the package goes through :func:`parse` (CI saw the error in
``tests/test_eval_ray.py``: one trajectory raised it and the batch closed its verifier pool on the
other).
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """``ast.parse(source, mode=mode)``, serialised across threads."""
    with _LOCK:
        return ast.parse(source, mode=mode)
