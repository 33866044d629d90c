"""Shape and init expressions: tiny arithmetic over a task's shape symbols.

A task names its tensors with symbolic shapes (``[T, H]``, ``[H, 2*I]``) and its
init scales with expressions (``1 / sqrt(K)``), bound per shape set.  They are
parsed with :mod:`ast`, never ``eval``: ``+ - * / // % **``, parentheses,
integers, floats and ``sqrt``/``ceil``; :func:`eval_expr` computes one on a
binding.  :func:`evaluate` is the checked form a task file's validation uses:
the value, or a ValueError that names the field, the shape set and the fix
(an unknown symbol, a division by zero, a value that is not finite), so that a
spec that cannot be drawn fails when it loads, not in the middle of a
verification.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from coda_agent.syntax import parse

Expr = str | int | float
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}
_FUNCS = {"sqrt": math.sqrt, "ceil": math.ceil}


class ExprError(ValueError):
    pass


def parse_expr(text: str | int | float) -> ast.expr:
    """Parse and check a shape/scale expression; raises ExprError with the fix."""
    if isinstance(text, (int, float)):
        return ast.Constant(text)
    try:
        tree = parse(str(text), mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"cannot parse expression {text!r} ({e.msg})") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Call, ast.Load,
                               ast.USub, ast.UAdd, *_BINOPS))
        if not ok:
            raise ExprError(f"expression {text!r}: {type(node).__name__} is not allowed "
                            "(use + - * / // ** and sqrt/ceil over shape symbols)")
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS and len(node.args) == 1
                    and not node.keywords):
                raise ExprError(f"expression {text!r}: only sqrt(x) and ceil(x) calls are allowed")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise ExprError(f"expression {text!r}: constant {node.value!r} is not a number")
    return tree


def expr_symbols(text: str | int | float) -> set[str]:
    return expr_symbols_of(parse_expr(text))


def structural_symbols(text: str | int | float) -> set[str]:
    """The symbols ``text`` multiplies by another symbol: in ``NQ*D`` or ``(NQ + 2*NKV)*D``
    a head count and a head width, which together describe the layout of one tensor
    dimension (``2*I`` scales a size by a constant and is not structural)."""
    found: set[str] = set()
    for node in ast.walk(parse_expr(text)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = expr_symbols_of(node.left), expr_symbols_of(node.right)
            if left and right:
                found |= left | right
    return found


def expr_symbols_of(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def eval_expr(text: str | int | float, env: dict[str, float]) -> Any:
    def ev(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ExprError(f"expression {text!r}: unknown symbol {node.id!r} (the shape set binds "
                                f"{', '.join(sorted(env))}); use those, or bind {node.id} in every shape set")
            return env[node.id]
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Call):
            return _FUNCS[node.func.id](ev(node.args[0]))  # type: ignore[union-attr]
        raise ExprError(f"expression {text!r}: unsupported node")

    return ev(parse_expr(text))


def evaluate(where: str, e: Expr, env: dict[str, float], set_name: str) -> float:
    """``e`` on one shape set, or the ValueError that names the field and the fix."""
    try:
        v = eval_expr(e, env)
    except ExprError as err:
        raise ValueError(f"{where}: {err}") from None
    except (ArithmeticError, ValueError, TypeError) as err:
        raise ValueError(f"{where}: {e} cannot be evaluated on shape set {set_name} {env_text(env)} "
                         f"({type(err).__name__}: {err}); fix the expression or the set") from None
    if isinstance(v, complex) or not math.isfinite(v):
        raise ValueError(f"{where}: {e} is {v} on shape set {set_name}; fix the expression or the set")
    return float(v)


def value_text(e: Expr, v: float, set_name: str) -> str:
    """``e`` and its value, ``H/3 is 42.67 on shape set small`` (a constant only once: ``0``)."""
    return f"{v:g}" if str(e).strip() in (f"{v:g}", str(v)) else f"{e} is {v:g} on shape set {set_name}"


def env_text(env: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in env.items()) + "}"
