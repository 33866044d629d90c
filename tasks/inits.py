"""How a task's input is drawn: the ``init`` of a tensor in a task file, its checks on every
shape set, and the one function that turns it into a tensor (:func:`draw`), which the verifier's
checks and the reference's dry run (``dryrun.py``) both call.

No distribution produces all zeros (a zero input lets a program that ignores it pass), and every
init is checked on every shape set when the task loads (:meth:`Init.check`), so that a spec the
verifier cannot draw fails then, naming the field and the fix, not in the middle of a check.

``positions`` draws token positions as a training batch holds them: sequences packed one after
another, each a run of consecutive positions (``start, start + 1, ...``) of a random length, half of
them from 0 (a document's first token) and half from a random offset below ``high`` (a long
document's later chunk).  Positions drawn independently never hold a run, so a program that
tells runs apart (three consecutive positions) from the rest would pass on them.

``ignore`` gives an integer input the entries a loss skips: a fraction of them set to an
ignore_index (``-100``, PyTorch's cross-entropy's and transformers' label padding), drawn at random
positions.  Without it a task cannot hold a program to what every training batch has: a program that
counts ignored rows in the loss, or sends them a gradient, passes on targets that are all valid.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from .expr import Expr, eval_expr, evaluate, parse_expr, value_text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ignored(_Strict):
    """Entries of a ``randint`` input set to ``value`` (an ignore_index), about ``fraction`` of them."""

    value: int = -100
    fraction: float = 0.125

    @field_validator("fraction")
    @classmethod
    def _check_fraction(cls, v: float) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError(f"fraction is {v}; it is the share of entries ignored, strictly between 0 and 1 "
                             "(0.125: one in eight)")
        return v


class Init(_Strict):
    """How the verifier draws a fresh input (never zeros).

    ``normal``: ``mean + scale * N(0, 1)``; ``uniform``: ``mean + U(-scale, scale)``;
    ``ones_plus_noise``: ``1 + scale * N(0, 1)`` (a norm weight); ``randint``:
    integers in ``[0, high)`` (``high`` defaults to the last dimension), with ``ignore``
    (``{value: -100, fraction: 0.125}``) setting a share of them to an ignore_index;
    ``positions``: packed sequences' token positions below ``high`` (module docstring);
    ``arange_rows``: the row index.  ``mean`` offsets the two that take it: a
    LayerNorm's centring is only tested by inputs whose mean is not zero."""

    dist: Literal["normal", "uniform", "randint", "positions", "arange_rows", "ones_plus_noise"] = "normal"
    scale: Expr = 1.0  # std for normal, half-width for uniform, noise std for ones_plus_noise
    mean: Expr = 0.0  # offset of normal and uniform
    high: Expr | None = None  # exclusive upper bound for randint and positions
    ignore: Ignored | None = None  # randint: entries set to an ignore_index

    @field_validator("scale", "mean", "high")
    @classmethod
    def _check_expr(cls, v: Expr | None) -> Expr | None:
        if v is not None:
            parse_expr(v)
        return v

    @model_validator(mode="after")
    def _check_mean(self) -> "Init":
        if self.mean not in (0, 0.0, "0") and self.dist not in ("normal", "uniform"):
            raise ValueError(f"init.mean offsets only dist normal or uniform, not {self.dist}; remove it "
                             "(ones_plus_noise is already centred on 1)")
        if self.high is not None and self.dist not in ("randint", "positions"):
            raise ValueError(f"init.high bounds only dist randint or positions, not {self.dist}; remove it "
                             "(scale sets the spread of the others)")
        if self.ignore is not None and self.dist != "randint":
            raise ValueError(f"init.ignore marks entries of an index input (dist randint), not of dist "
                             f"{self.dist}; remove it, or draw the input with dist randint")
        return self

    def randint_high(self, shape: tuple[int, ...], env: dict[str, float]) -> int:
        """A ``randint`` draw's exclusive bound on a shape set (``env``, its binding): ``high``, else
        the last dimension."""
        return int(eval_expr(self.high, env)) if self.high is not None else (shape[-1] if shape else 1)

    def check(self, where: str, name: str, dtype: str, shape: tuple[int, ...], env: dict[str, float],
              set_name: str) -> None:
        """Raise the ValueError that names the fix if this init cannot be drawn for input ``name``
        (``dtype``, ``shape``) on shape set ``set_name``."""
        if dtype.startswith("int") and self.dist not in ("randint", "positions", "arange_rows"):
            raise ValueError(f"{where}.dist: {name} is {dtype}, which dist {self.dist} does not draw; write "
                             "init: {dist: randint, high: <exclusive bound>}, {dist: positions, high: <bound>} "
                             "or {dist: arange_rows}")
        if self.dist in ("normal", "uniform", "ones_plus_noise"):
            evaluate(f"{where}.mean", self.mean, env, set_name)
            if evaluate(f"{where}.scale", self.scale, env, set_name) == 0:
                raise ValueError(f"{where}.scale: {value_text(self.scale, 0, set_name)}: every value of {name} "
                                 "would be the same, which tests nothing; give a non-zero scale")
        if self.dist not in ("randint", "positions"):
            return
        high = (evaluate(f"{where}.high", self.high, env, set_name) if self.high is not None
                else float(shape[-1] if shape else 1))
        if self.high is not None and (high != int(high) or high < 1):
            raise ValueError(f"{where}.high: {value_text(self.high, high, set_name)}; randint draws from "
                             "[0, high), so high is a whole number >= 1")
        if self.ignore is not None and 0 <= self.ignore.value < high:
            raise ValueError(f"{where}.ignore.value: {self.ignore.value} lies in [0, {int(high)}) on shape set "
                             f"{set_name}, among the values randint draws, so an ignored entry cannot be told from "
                             "a real one; use a value outside it (-100, PyTorch's ignore_index)")


def draw(init: Init, shape: tuple[int, ...], dtype: torch.dtype, env: dict[str, float], gen: torch.Generator,
         device: str = "cpu") -> torch.Tensor:
    """One tensor of ``shape`` and ``dtype`` drawn as ``init`` says, its expressions evaluated in
    ``env`` (a shape set's binding), from ``gen`` on ``device``."""
    kw = dict(generator=gen, device=device)
    if init.dist == "randint":
        x = torch.randint(0, max(init.randint_high(shape, env), 1), shape, **kw)
        if init.ignore is not None:
            x = torch.where(torch.rand(shape, **kw) < init.ignore.fraction, init.ignore.value, x)
        return x.to(dtype)
    if init.dist == "positions":
        return _positions(shape, init.randint_high(shape, env), gen, device).to(dtype)
    if init.dist == "arange_rows":
        rows = torch.arange(shape[0] if shape else 1, device=device).reshape(-1, *([1] * (len(shape) - 1)))
        return rows.expand(shape).to(dtype).contiguous()
    scale, mean = float(eval_expr(init.scale, env)), float(eval_expr(init.mean, env))
    if init.dist == "uniform":
        return (mean + (torch.rand(shape, **kw) * 2 - 1) * scale).to(dtype)
    base = 1.0 if init.dist == "ones_plus_noise" else mean
    return (base + torch.randn(shape, **kw) * scale).to(dtype)


def _positions(shape: tuple[int, ...], high: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Token positions of packed sequences below ``high`` (the module docstring), drawn on the CPU
    from ``gen``'s seed so that every device draws the same ones."""
    n = max(1, math.prod(shape))
    cpu = torch.Generator().manual_seed(int(torch.randint(0, 1 << 62, (1,), generator=gen, device=gen.device)))
    longest = max(1, min(n, high, 128))  # runs of 64 on average: a boundary every few dozen rows
    out, filled = torch.empty(n, dtype=torch.int64), 0
    while filled < n:
        length = min(int(torch.randint(1, longest + 1, (1,), generator=cpu)), n - filled, high)
        offset = int(torch.randint(0, high - length + 1, (1,), generator=cpu))
        start = 0 if torch.rand(1, generator=cpu) < 0.5 else offset
        out[filled:filled + length] = torch.arange(start, start + length)
        filled += length
    return out.reshape(shape).to(device)
