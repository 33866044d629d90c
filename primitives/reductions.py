"""Reductions, per-head statistics and stateful transforms (catalogue families 4-5).

Each fold is one :class:`Reduction` subclass carrying everything the
catalogue does with it: the quack sink that folds it in the cute lowering
(with the buffer the catalogue owns, where quack writes into the caller's),
the fold of the reference lowering, and whether a paired epilogue may use it.
A per-head statistic (:class:`HeadRms`) carries its reference values; the
``HeadStat`` operand kind reads it.

Reductions (family 4) are declared per returned name; the fn returns the
per-element value to fold and the kernel folds it per output tile; the
finished value comes back from ``gemm``:

- ``col_sum()``/``col_max()``: fold across the columns of each row -> (M,) fp32
  (a column vector: one value per row; e.g. sum of squares for RMSNorm).
- ``row_sum()``: fold down the rows of each column -> (N,) fp32 (e.g. the
  gamma-gradient of RMSNorm); beside a PairedTile operand, one value per pair
  (the accumulator's columns), so a gated backward's (gate, up) bias gradients
  are two of them.
- ``col_amax()``/``row_amax()``: the largest absolute value, along each row ->
  (M,) or down each column -> (N,) fp32: an fp8 cast's current scales, per
  token and per feature, reduced where the tensor is made (``quantize_both``'s
  ``row_amax``/``col_amax``), so the cast reads the tensor once instead of
  twice.  Weigh it: a ``row_amax`` folds across the warps once per N stripe, and in
  the fp8 dSwiGLU epilogue two of them cost twice the read they saved (the FP8
  section's numbers).  The fold is PTX ``max.abs``, whose identity is the 0 of a padded
  lane: no mask, unlike ``col_max``.  In a ``pairs="acc"`` epilogue both take
  one value per pair (``row_amax``: per pair column, the extra outputs'
  width) or a Pair, whose lanes fold into it; beside a PairedTile operand one
  value per accumulator column, as ``row_sum``.
- ``col_sum(partials=True)``: the per-N-tile partials (M, ceil(N / tile_n))
  instead of the finished sum, laid out exactly as the kernel writes them.

Per-head statistics (family 4, finished in-kernel):

- ``head_rstd(eps)``: declared with ``@epilogue(head_stats={"rstd": ...})`` and
  read by a ``rstd: HeadStat`` parameter: for each row and each group of
  ``head_dim`` adjacent columns (a head), ``rsqrt(mean(acc**2) + eps)`` of the
  *raw* accumulator, computed in a pre-pass over the tile before any store, so
  QK-norm needs one GEMM.  The head width is given at the call,
  ``gemm(..., rstd=head_dim)``; it must divide N and the tile's N.  Declared
  without eps (``head_rstd()``), the call gives eps with the width,
  ``gemm(..., rstd=(head_dim, eps))``: a model's (or a task's) eps is a value
  of the call, not of the program.  The kernel still holds eps as a constant
  (quack's statistic folds it in when it finishes), so each distinct eps is a
  kernel of its own, compiled once.  With ``save=True`` gemm also returns it
  as (M, N / head_dim) fp32 (for backward).

Stateful transforms (family 5):

- ``online_lse()``: online log-sum-exp across all N tiles -> (M,) fp32.
- ``select_col("target")``: the value at column ``target[m]`` -> (M,) fp32, where
  ``target`` is an int32/int64 (M,) operand passed to ``gemm`` (never seen by
  the fn).  Rows whose target lies outside [0, N) are left untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CatalogueError


@dataclass(frozen=True)
class Reduction:
    """A declared fold of the values an epilogue returns under one name."""

    partials = False  # col_sum(partials=True): the per-N-tile partials are the result
    index = None  # select_col: the int operand naming the column per row
    # Whether the kernel folds the padded lanes of a ragged last tile too (the sums:
    # they add whatever the fn returns there), or masks them (max, LSE, select).
    folds_padded_lanes = False
    # quack writes the result into the buffer the catalogue passes it, instead of
    # returning a tensor of its own (which the cute lowering copies into the buffer)
    caller_owned = False
    # The fold's direction: one value per output row (col_sum, col_max, the LSE, a select) or,
    # for row_sum, one per output column.
    per_column = False

    @property
    def pairable(self) -> bool:
        """Whether a ``pairs="acc"`` epilogue may declare it (its two lanes fold into one value per
        row)."""
        return False

    @property
    def beside_pairs(self) -> bool:
        """Whether an epilogue with a PairedTile operand may declare it: there the accumulator
        holds one value per pair (a gated backward's d(act)), and the fold takes the fn's value
        per accumulator element as an unpaired epilogue's does."""
        return self.pairable

    def describe(self) -> str:
        raise NotImplementedError

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        """(the quack op that folds it, companion ops it reads) in the cute lowering."""
        raise NotImplementedError

    def result_buffer(self, m: int, n: int, tiles: int, device: torch.device) -> torch.Tensor:
        """The buffer gemm returns the result in, for an (M, N) fold over ``tiles`` N tiles."""
        return torch.empty(self.result_shape(m, n), dtype=torch.float32, device=device)

    def result_shape(self, m: int, n: int) -> tuple[int, ...]:
        """The finished result's shape."""
        return (m,)

    def from_quack(self, t: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        """quack's result in the catalogue's shape: one value per row comes back (1, M);
        ``pairs``: the kernel's epilogue is ``pairs="acc"``."""
        return t.reshape(-1) if t.dim() > 1 else t

    def fold_lanes(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The two lanes of a Pair folded into one value per column pair."""
        return torch.maximum(a, b)

    def lanes_of(self, v: Any) -> tuple[Any, Any]:
        """Two lanes that :meth:`fold_lanes` folds into ``v``: a paired epilogue's kernel folds a
        pair per reduction, so one value per pair (what the reference lowering takes as it is)
        goes to the kernel as these lanes."""
        return v, v

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        """The reference fold of fp32 (M, N) values."""
        raise NotImplementedError

    def trim(self, result: torch.Tensor, m: int, n: int) -> torch.Tensor:
        """A fold over whole tiles cut to the real (m, n) extent (one value per row by default)."""
        return result[:m]


def _vec_reduce(name: str, combine: str, rows: bool = False) -> tuple[Any, tuple[Any, ...]]:
    from quack.epilogue import ops

    return (ops.RowVecReduce if rows else ops.ColVecReduce)(name, combine=combine), ()


@dataclass(frozen=True)
class ColSum(Reduction):
    partials: bool = False
    folds_padded_lanes = True

    @property
    def pairable(self) -> bool:
        return not self.partials

    def describe(self) -> str:
        return f"col_sum({'partials=True' if self.partials else ''})"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        return _vec_reduce(name, "add")

    @property
    def caller_owned(self) -> bool:  # type: ignore[override]
        return self.partials

    def result_buffer(self, m: int, n: int, tiles: int, device: torch.device) -> torch.Tensor:
        shape = (m, tiles) if self.partials else (m,)
        return torch.empty(shape, dtype=torch.float32, device=device)

    def fold_lanes(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def lanes_of(self, v: Any) -> tuple[Any, Any]:
        return v, v * 0.0

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        if not self.partials:
            return values.sum(dim=1)
        m, n = values.shape
        tiles = -(-n // tile_n)
        padded = torch.zeros(m, tiles * tile_n, dtype=values.dtype, device=values.device)
        padded[:, :n] = values
        return padded.view(m, tiles, tile_n).sum(dim=-1)


@dataclass(frozen=True)
class ColMax(Reduction):
    @property
    def pairable(self) -> bool:
        return True

    def describe(self) -> str:
        return "col_max()"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        return _vec_reduce(name, "max")

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        return values.amax(dim=1)


@dataclass(frozen=True)
class ColAmax(Reduction):
    folds_padded_lanes = True  # max.abs folds them, and their 0 is its identity

    @property
    def pairable(self) -> bool:
        return True

    def describe(self) -> str:
        return "col_amax()"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        return _vec_reduce(name, "max_abs")

    def fold_lanes(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a.abs(), b.abs())

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        return values.abs().amax(dim=1)


class _DownColumns:
    """A fold down the rows: one value per output column, (N,) as quack returns it."""

    per_column = True

    def trim(self, result: torch.Tensor, m: int, n: int) -> torch.Tensor:
        return result[:n]

    def result_shape(self, m: int, n: int) -> tuple[int, ...]:
        return (n,)

    def from_quack(self, t: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        return t


@dataclass(frozen=True)
class RowAmax(_DownColumns, ColAmax):
    def describe(self) -> str:
        return "row_amax()"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        return _vec_reduce(name, "max_abs", rows=True)

    def from_quack(self, t: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        # A pairs="acc" kernel folds each lane into its own accumulator column (2j, 2j+1):
        # the pair's value is the larger of the two, as fold_lanes gives it.
        return t.view(-1, 2).amax(dim=1) if pairs else t

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        return values.abs().amax(dim=0)


@dataclass(frozen=True)
class RowSum(_DownColumns, Reduction):
    folds_padded_lanes = True
    beside_pairs = True  # one value per accumulator column: per pair, e.g. a gate's bias gradient

    def describe(self) -> str:
        return "row_sum()"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        return _vec_reduce(name, "add", rows=True)

    def fold_lanes(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def lanes_of(self, v: Any) -> tuple[Any, Any]:
        return v, v * 0.0

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        return values.sum(dim=0)


@dataclass(frozen=True)
class OnlineLse(Reduction):
    def describe(self) -> str:
        return "online_lse()"

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        from quack.epilogue import ops

        return ops.OnlineLSEReduce(name), ()

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        return torch.logsumexp(values, dim=1)


@dataclass(frozen=True)
class SelectCol(Reduction):
    index: str
    caller_owned = True

    def describe(self) -> str:
        return f"select_col({self.index!r})"

    def fold_lanes(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise CatalogueError(f"select_col({self.index!r}) picks one value per row: return a single "
                             "value for it, not a Pair")

    def quack_sink(self, name: str) -> tuple[Any, tuple[Any, ...]]:
        from quack.epilogue import ops

        idx = ops.ColVecLoad(self.index)
        return ops.ColVecSelect(name, idx_op=idx), (idx,)

    def result_buffer(self, m: int, n: int, tiles: int, device: torch.device) -> torch.Tensor:
        # quack writes only the rows whose target lies in [0, N); the rest keep the pre-fill.
        return torch.zeros(m, dtype=torch.float32, device=device)

    def fold(self, values: torch.Tensor, operands: dict[str, Any], tile_n: int) -> torch.Tensor:
        n = values.shape[1]
        idx = operands[self.index].long()
        ok = (idx >= 0) & (idx < n)
        picked = values.gather(1, idx.clamp(0, n - 1).view(-1, 1)).view(-1)
        return torch.where(ok, picked, torch.zeros_like(picked))


def _check_identity(kind: str, identity: float | None, want: float) -> None:
    # The kernel zero-fills out-of-bounds lanes of a ragged last tile; that is the
    # identity of a sum but not of a max, so max folds mask those lanes to -inf.
    # A caller asking for another identity would get wrong answers at ragged edges.
    if identity is not None and identity != want:
        raise CatalogueError(
            f"{kind} folds out-of-bounds lanes of a ragged edge with identity {want}; "
            f"identity={identity!r} would corrupt rows/columns at the edge. Drop identity= "
            f"(or pass {want}).")


def col_sum(*, partials: bool = False, identity: float | None = None) -> Reduction:
    """Sum across the columns of each row -> (M,) fp32 (or per-N-tile partials)."""
    _check_identity("col_sum", identity, 0.0)
    return ColSum(partials=partials)


def col_max(*, identity: float | None = None) -> Reduction:
    """Max across the columns of each row -> (M,) fp32 (ragged lanes masked to -inf)."""
    _check_identity("col_max", identity, -math.inf)
    return ColMax()


def col_amax() -> Reduction:
    """Max of the absolute values across the columns of each row -> (M,) fp32 (an fp8 row scale's amax)."""
    return ColAmax()


def row_amax() -> Reduction:
    """Max of the absolute values down the rows of each column -> (N,) fp32 (a per-feature fp8 scale's amax)."""
    return RowAmax()


def row_sum(*, identity: float | None = None) -> Reduction:
    """Sum down the rows of each column -> (N,) fp32."""
    _check_identity("row_sum", identity, 0.0)
    return RowSum()


def online_lse() -> Reduction:
    """Online log-sum-exp across all columns of each row -> (M,) fp32."""
    return OnlineLse()


def select_col(index: str) -> Reduction:
    """The returned value at column ``index[m]`` of each row -> (M,) fp32."""
    if not isinstance(index, str) or not index.isidentifier():
        raise CatalogueError("select_col needs the name of the int index operand, e.g. "
                             "select_col('target'), and gemm(..., target=targets)")
    return SelectCol(index=index)


@dataclass(frozen=True)
class HeadRms:
    """A declared per-head inverse RMS of the raw accumulator (see the module doc)."""

    eps: float | None  # None: given at each call with the head width
    save: bool = False

    def values(self, acc: torch.Tensor, head_dim: int) -> torch.Tensor:
        """(M, N / head_dim) inverse RMS of each row's heads, from the raw fp32 accumulator."""
        assert self.eps is not None, "a launch declares an eps given at the call first (Epilogue.with_head_eps)"
        m, n = acc.shape
        return torch.rsqrt(acc.view(m, n // head_dim, head_dim).pow(2).mean(-1) + self.eps)


def positive_eps(eps: object, where: str) -> float:
    """``eps`` as a float, or a CatalogueError naming ``where`` it was given."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise CatalogueError(f"{where}: eps must be a positive number; got {eps!r}")
    return float(eps)


def head_rstd(eps: float | None = None, *, save: bool = False) -> HeadRms:
    """Per-(row, head) ``rsqrt(mean(acc**2 over the head's columns) + eps)``, read by a
    ``HeadStat`` parameter.  With ``eps`` the head width alone is given at the call
    (``gemm(..., rstd=128)``); without it, width and eps (``gemm(..., rstd=(128, eps))``).
    ``save=True`` also returns it (M, N / head_dim) fp32."""
    return HeadRms(None if eps is None else positive_eps(eps, "head_rstd"), save)
