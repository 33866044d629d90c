"""A task's params: what they may be, which ones the judge varies, their values on a shape set.

A param is one scalar the reference and the program take by name.  What is written decides
what the verifier does with it:

- **a float** (an eps, a soft-cap, Granite's residual multiplier) is a value of the call.  The
  judge varies it between draws (``verifier/inputs.py``, ``drawn_params``), so a program that
  writes the value in instead of taking it from the call fails; ``fixed_params`` lists the floats
  a reference takes only as written (a rate bounded to [0, 1]).  Write a real number with a
  decimal point or an exponent (``30.0``, ``1e-5``): ``30`` is an int.
- **an int, a bool or a plain string** (an ignore index, a causal switch, an activation's name)
  is a count, a switch or a name, kept as written.
- **a shape expression** (``head_dim: D``, ``n_rep: NQ // NKV``) is a string of the shape
  symbols, evaluated on each shape set to a whole number (:func:`at`): a GQA reference that
  needs its head width or group size gets them as ints.  A loaded kernel works it out from its
  inputs' shapes (``kernels/kernel.py``).

YAML 1.1 reads ``1e-5`` (an exponent without a decimal point) as a string; a param written as
a number is taken as one (:func:`coerce`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from .expr import ExprError, eval_expr, expr_symbols

Scalar = bool | int | float | str  # a param: any scalar a reference takes (eps, causal, activation name)
# A varied param is scaled by 2**u with |u| uniform in this range; where the reference refuses the
# values, u is halved down to the smallest spread, below which the values stay as written.
PARAM_SPREAD = (0.25, 4.0)

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")  # what YAML 1.1 leaves a string: 1e-5


def coerce(raw: Any) -> Any:
    """The params mapping as written, with numbers YAML left as strings made numbers; a value
    that is no scalar is the ValueError naming the fix."""
    if not isinstance(raw, dict):
        return raw
    params = {k: float(v) if isinstance(v, str) and _NUMBER.fullmatch(v.strip()) else v for k, v in raw.items()}
    for k, value in params.items():
        if not isinstance(value, (bool, int, float, str)):
            # Without this a list or null param is four errors, one per member of the Scalar union.
            what = "empty (null)" if value is None else f"a {type(value).__name__} ({value!r})"
            raise ValueError(f"{k} is {what}; a param is one number, true/false or string (give "
                             "a list's parts as separate params, or a tensor as an input)")
    return params


def varies(value: Scalar) -> bool:
    """Whether the judge varies a param of this value: a float (an int, a bool or a string is a
    count, a switch or a name, whose meaning a nearby value would change)."""
    return isinstance(value, float)


def shape_expressions(params: Mapping[str, Scalar], symbols: set[str]) -> dict[str, str]:
    """The params written as expressions of the shape symbols (``D``, ``NQ // NKV``)."""
    out = {}
    for name, value in params.items():
        if not isinstance(value, str):
            continue
        try:
            used = expr_symbols(value)
        except Exception:  # noqa: BLE001 - not an expression: a plain string param
            continue
        if used and used <= symbols:
            out[name] = value
    return out


def check(params: Mapping[str, Scalar], fixed: list[str], shapes: Mapping[str, Mapping[str, int]]) -> None:
    """``fixed_params`` names float params; a shape expression is a whole number on every set."""
    for name in fixed:
        if name not in params:
            raise ValueError(f"fixed_params: {name!r} is not a param of this task (params: "
                             f"{', '.join(params) or 'none'})")
        if not varies(params[name]):
            raise ValueError(f"fixed_params: {name!r} is {params[name]!r}; only float params are "
                             "varied by the judge, so it needs no entry: remove it")
    symbols = {s for binding in shapes.values() for s in binding}
    for name, text in shape_expressions(params, symbols).items():
        for set_name, binding in shapes.items():
            try:
                value = eval_expr(text, {k: float(v) for k, v in binding.items()})
            except ExprError as e:
                raise ValueError(f"params.{name}: {e}") from None
            except ArithmeticError as e:
                raise ValueError(f"params.{name}: {text!r} cannot be evaluated on shape set {set_name} "
                                 f"({type(e).__name__}); make it a size on every set") from None
            if value != int(value):
                raise ValueError(f"params.{name}: {text!r} is {value:g} on shape set {set_name}, not a whole "
                                 "number; a shape param is a size or a count (use // for floor division)")


def at(params: Mapping[str, Scalar], binding: Mapping[str, int]) -> dict[str, Scalar]:
    """The params on one shape set: each shape expression evaluated to its int there."""
    exprs = shape_expressions(params, set(binding))
    env = {k: float(v) for k, v in binding.items()}
    return {k: int(eval_expr(v, env)) if k in exprs else v for k, v in params.items()}


def from_shapes(exprs: Mapping[str, str], declared: Mapping[str, list], shapes: Mapping[str, tuple[int, ...]]
                ) -> dict[str, int]:
    """Shape expressions (:func:`shape_expressions`) evaluated on the sizes tensors give
    (``declared``: each input's symbolic shape; ``shapes``: the actual ones): a symbol is known
    where a dimension is linear in it and its other symbols are known (``I`` from a dimension
    ``2*I``, ``D`` from ``NQ*D`` once ``NQ`` is known).  A KeyError names a symbol no input gives."""
    dims = [(e, float(size)) for name, shape in declared.items() for e, size in zip(shape, shapes.get(name, ()))]
    env: dict[str, float] = {}
    solved = True
    while solved:  # each pass solves the dimensions with one unknown symbol left
        solved = False
        for e, size in dims:
            unknown = expr_symbols(e) - set(env)
            if len(unknown) == 1:
                (sym,) = unknown
                at0, at1 = eval_expr(e, {**env, sym: 0.0}), eval_expr(e, {**env, sym: 1.0})
                if at1 != at0 and eval_expr(e, {**env, sym: (size - at0) / (at1 - at0)}) == size:
                    env[sym] = (size - at0) / (at1 - at0)
                    solved = True
    out = {}
    for name, text in exprs.items():
        unknown = expr_symbols(text) - set(env)
        if unknown:
            raise KeyError(f"params.{name} is {text!r}, and no input has {', '.join(sorted(unknown))} as a whole "
                           f"dimension; pass {name}= explicitly")
        out[name] = int(eval_expr(text, env))
    return out
