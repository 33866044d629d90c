"""Operand kinds, output dtypes and reduction declarations (catalogue families 2-5).

Every operand an epilogue reads is *declared* with a kind annotation; nothing
is inferred from shapes (M == N happens, and a silent row/col mix-up is the
worst kind of wrong answer).  Kinds and their shapes, for a GEMM C = A @ B
with A (M, K), B (K, N):

=============  ===================  ==============================================
kind           tensor shape         what the epilogue fn sees per element (m, n)
=============  ===================  ==============================================
``Tile``       (M, N)               t[m, n], promoted to fp32 (family 3)
``RowVec``     (N,)                 v[n]: one value per output column (family 2)
``ColVec``     (M,)                 v[m]: one value per output row (family 2)
``Scalar``     python float         the value, baked into the kernel
``PairedTile`` (M, 2N), 16-bit      a Pair (t[m, 2n], t[m, 2n+1]): the saved
                                    pre-activation of a gated unit (family 1)
=============  ===================  ==============================================

Reductions (family 4) are declared per returned name; the fn returns the
per-element value to fold and the kernel folds it per output tile; the
finished value comes back from ``gemm``:

- ``col_sum()``/``col_max()``: fold across the columns of each row -> (M,) fp32
  (a column vector: one value per row; e.g. sum of squares for RMSNorm).
- ``row_sum()``: fold down the rows of each column -> (N,) fp32 (e.g. the
  gamma-gradient of RMSNorm).
- ``col_sum(partials=True)``: the per-N-tile partials (M, ceil(N / tile_n))
  instead of the finished sum, laid out exactly as the kernel writes them.

Per-head statistics (family 4, finished in-kernel):

- ``head_rstd(eps)``: declared with ``@epilogue(head_stats={"rstd": ...})`` and
  read by a ``rstd: HeadStat`` parameter: for each row and each group of
  ``head_dim`` adjacent columns (a head), ``rsqrt(mean(acc**2) + eps)`` of the
  *raw* accumulator, computed in a pre-pass over the tile before any store, so
  QK-norm needs one GEMM.  The head width is given at the call,
  ``gemm(..., rstd=head_dim)``; it must divide N and the tile's N.  With
  ``save=True`` gemm also returns it as (M, N / head_dim) fp32 (for backward).

Stateful transforms (family 5):

- ``online_lse()``: online log-sum-exp across all N tiles -> (M,) fp32.
- ``select_col("target")``: the value at column ``target[m]`` -> (M,) fp32, where
  ``target`` is an int32/int64 (M,) operand passed to ``gemm`` (never seen by
  the fn).  Rows whose target lies outside [0, N) are left untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import CatalogueError

OUTPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_TO_NAME = {v: k for k, v in OUTPUT_DTYPES.items()}
INPUT_DTYPES = (torch.bfloat16, torch.float16)


class Kind:
    """An operand kind: used as an annotation, ``def fn(acc, r: Tile)``."""

    name = ""
    port = ""  # how the fn sees it: "tile" | "row" | "col" | "scalar" | "paired"

    def __init_subclass__(cls) -> None:
        cls.name = cls.__name__

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...] | None:
        raise NotImplementedError

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        """Raise a CatalogueError naming the fix if ``value`` cannot be this kind."""
        want = cls.expected_shape(m, n)
        if not isinstance(value, torch.Tensor):
            raise CatalogueError(f"operand {operand!r} is declared {cls.name} and needs a tensor of "
                                 f"shape {want}; got {type(value).__name__}")
        if tuple(value.shape) != want:
            raise CatalogueError(
                f"operand {operand!r} is declared {cls.name}, which needs shape {want} for this "
                f"GEMM (M={m}, N={n}); got {tuple(value.shape)}. {cls.hint}")
        if value.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CatalogueError(f"operand {operand!r}: dtype {value.dtype} is not supported; "
                                 "use bf16, fp16 or fp32")
        if value.dim() == 1 and value.numel() > 1 and value.stride(0) != 1:
            # Seen on an H200: quack refuses a strided vector at launch, so the
            # reference lowering must refuse it too.
            raise CatalogueError(f"operand {operand!r} is a strided view (stride {value.stride(0)}); "
                                 "vectors must be contiguous: slice rows of a (heads, M) tensor, not "
                                 "columns of an (M, heads) one")

    hint = ""


class Tile(Kind):
    """A full (M, N) tensor read alongside the accumulator (residual, saved x)."""

    port = "tile"
    hint = "A Tile has the GEMM output's shape."

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (m, n)


class RowVec(Kind):
    """One value per output column, length N, broadcast down the rows (gamma, bias)."""

    port = "row"
    hint = "A RowVec has one value per output column (length N); per-row values are a ColVec."

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (n,)


class ColVec(Kind):
    """One value per output row, length M, broadcast across columns (inverse RMS)."""

    port = "col"
    hint = "A ColVec has one value per output row (length M); per-column values are a RowVec."

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (m,)


class Scalar(Kind):
    """A Python number baked into the kernel (eps, a scale)."""

    port = "scalar"

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CatalogueError(f"operand {operand!r} is declared Scalar and needs a Python number; "
                                 f"got {type(value).__name__} (pass tensors as Tile/RowVec/ColVec)")


class PairedTile(Kind):
    """A 16-bit (M, 2N) tensor whose adjacent columns form one Pair per output
    element: the saved (gate, up) pre-activation read by the SwiGLU backward.
    At most one per epilogue; the epilogue's D then has this tensor's shape."""

    port = "paired"
    hint = "A PairedTile is twice as wide as the GEMM output (interleaved pairs)."

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (m, 2 * n)

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        super().check(operand, value, m, n)
        assert isinstance(value, torch.Tensor)
        if value.dtype not in INPUT_DTYPES:
            raise CatalogueError(f"operand {operand!r} is a PairedTile and must be bf16 or fp16 "
                                 f"(two 16-bit lanes per 32-bit word); got {value.dtype}")


class HeadStat(Kind):
    """The per-head statistic of the element's head, declared in ``head_stats=``;
    gemm takes the head width under its name (the kernel computes the values)."""

    port = "head"

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 2:
            raise CatalogueError(f"operand {operand!r} is a HeadStat: pass the head width as a positive "
                                 f"even int, gemm(..., {operand}=head_dim); got {value!r}")
        if n % value:
            raise CatalogueError(f"gemm: head statistic {operand!r} groups {value} columns per head, so "
                                 f"N must be a multiple of {value}; got N = {n}")


KINDS: dict[str, type[Kind]] = {k.name: k for k in (Tile, RowVec, ColVec, Scalar, PairedTile, HeadStat)}


# --------------------------------------------------------------------------- reductions


@dataclass(frozen=True)
class Reduction:
    """A declared fold of the values an epilogue returns under one name."""

    axis: str  # "cols": one value per row (M,);  "rows": one value per column (N,)
    combine: str  # "add" | "max" | "lse" | "select"
    partials: bool = False
    index: str | None = None  # select_col: the int operand naming the column per row

    @property
    def identity(self) -> float:
        return 0.0 if self.combine == "add" else -math.inf

    def describe(self) -> str:
        if self.combine == "select":
            return f"select_col({self.index!r})"
        name = {"add": "sum", "max": "max", "lse": "lse"}[self.combine]
        base = "online_lse" if self.combine == "lse" else f"{'col' if self.axis == 'cols' else 'row'}_{name}"
        return f"{base}({'partials=True' if self.partials else ''})"


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
    return Reduction("cols", "add", partials=partials)


def col_max(*, identity: float | None = None) -> Reduction:
    """Max across the columns of each row -> (M,) fp32 (ragged lanes masked to -inf)."""
    _check_identity("col_max", identity, -math.inf)
    return Reduction("cols", "max")


def row_sum(*, identity: float | None = None) -> Reduction:
    """Sum down the rows of each column -> (N,) fp32."""
    _check_identity("row_sum", identity, 0.0)
    return Reduction("rows", "add")


def online_lse() -> Reduction:
    """Online log-sum-exp across all columns of each row -> (M,) fp32."""
    return Reduction("cols", "lse")


def select_col(index: str) -> Reduction:
    """The returned value at column ``index[m]`` of each row -> (M,) fp32."""
    if not isinstance(index, str) or not index.isidentifier():
        raise CatalogueError("select_col needs the name of the int index operand, e.g. "
                             "select_col('target'), and gemm(..., target=targets)")
    return Reduction("cols", "select", index=index)


@dataclass(frozen=True)
class HeadRms:
    """A declared per-head inverse RMS of the raw accumulator (see the module doc)."""

    eps: float
    save: bool = False


def head_rstd(eps: float = 1e-6, *, save: bool = False) -> HeadRms:
    """Per-(row, head) ``rsqrt(mean(acc**2 over the head's columns) + eps)``, read by a
    ``HeadStat`` parameter, head width given at the call (``gemm(..., rstd=128)``);
    ``save=True`` also returns it (M, N / head_dim) fp32."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise CatalogueError(f"head_rstd: eps must be a positive number; got {eps!r}")
    return HeadRms(float(eps), save)
