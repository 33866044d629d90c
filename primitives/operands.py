"""Operand kinds and output dtypes (catalogue families 2-3).

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

Reductions and per-head statistics are declared in :mod:`.reductions`.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CatalogueError
from .fp8 import FP8_DTYPES
from .pair import Pair
from .reductions import HeadRms

OUTPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, **FP8_DTYPES}
INPUT_DTYPES = (torch.bfloat16, torch.float16)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes between consecutive rows of the tensor's non-contiguous dimension."""
    major = t.stride(0) if t.stride(-1) == 1 else t.stride(-1)
    return major * t.element_size()


# What a padded lane of a vector operand holds in the reference lowering's
# padded_lanes mode: quack's vector loads are predicated copies into shared
# memory, so past the ragged edge a lane keeps whatever was there (finite, but
# anything); a large value makes a result that depends on it plainly wrong.
STALE_VECTOR_VALUE = 1.0e3


def _zero_padded(value: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=value.dtype, device=value.device)
    out[:value.shape[0], :value.shape[1]] = value
    return out


def _stale_padded(value: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.full((length,), STALE_VECTOR_VALUE, dtype=value.dtype, device=value.device)
    out[:value.shape[0]] = value
    return out


def _per_column(v: Any, pairs_acc: bool) -> Any:
    """In a ``pairs="acc"`` epilogue a per-column value is seen as a Pair of adjacent columns."""
    return Pair.of_columns(v) if pairs_acc else v


class Kind:
    """An operand kind: used as an annotation, ``def fn(acc, r: Tile)``.

    Everything the catalogue does with an operand of a kind is a method of the
    kind, so a new kind is one class: its shape and checks at the ``gemm``
    call, its value in the decoration-time dry run, what the fn sees in the
    reference lowering, the quack op that loads it in the cute lowering and
    the layout quack takes it in, and the rows the mainloop's TMA copies.
    The quack ops are imported where they are built: quack loads only when a
    cute lowering runs.
    """

    name = ""
    hint = ""
    # Which list of the ``coda::gemm`` custom op carries it: "tensors", "scalars" (floats)
    # or "ints" (gemm.py packs operands by it).
    op_argument = "tensors"

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
            # quack refuses a strided vector at launch, so the reference lowering
            # refuses it too.
            raise CatalogueError(f"operand {operand!r} is a strided view (stride {value.stride(0)}); "
                                 "vectors must be contiguous: slice rows of a (heads, M) tensor, not "
                                 "columns of an (M, heads) one (head_rstd's saved statistics: "
                                 "`pad(rstd.t())` copies them into (heads, M) once)")

    @classmethod
    def dry_run_value(cls, m: int, n: int) -> Any:
        """A value for the dry run of an (m, n) accumulator at decoration time."""
        return torch.randn(cls.expected_shape(m, n))

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        """What the fn sees in the reference lowering, called once on the whole
        fp32 (M, N) accumulator ``acc``: fp32, broadcastable against it.
        ``pairs_acc``: the epilogue pairs adjacent accumulator columns;
        ``stat``: the head statistic declared under the operand's name."""
        raise NotImplementedError

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        """The quack EpiOp pinned for this operand (None: quack reads it as the C operand)."""
        raise NotImplementedError

    @classmethod
    def quack_parameter(cls, name: str) -> str:
        """The fn parameter name quack passes the operand under."""
        return name

    @classmethod
    def quack_value(cls, value: Any) -> Any:
        """The operand in the layout quack takes it in."""
        return value

    @classmethod
    def tma_row_bytes(cls, value: Any) -> int | None:
        """Bytes per row the mainloop's TMA copies of it (None: not copied by TMA)."""
        return None

    @classmethod
    def output_grid(cls, value: Any) -> tuple[int, int] | None:
        """The (M, N) output a tensor of this kind implies (None: it implies none):
        how a tile pass, which has no A and B, knows its shape."""
        return None

    @classmethod
    def padded(cls, value: Any, mp: int, np_: int) -> Any:
        """The operand over whole tiles (mp, np_) as the kernel's epilogue sees it past
        the ragged edge (the reference lowering's ``padded_lanes`` mode)."""
        return value


class Tile(Kind):
    """A full (M, N) tensor read alongside the accumulator (residual, saved x)."""

    hint = "A Tile has the GEMM output's shape."

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (m, n)

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        return _per_column(value.float(), pairs_acc)

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        from quack.epilogue import ops

        return ops.TileLoad(name)

    @classmethod
    def tma_row_bytes(cls, value: Any) -> int | None:
        return row_bytes(value)

    @classmethod
    def output_grid(cls, value: Any) -> tuple[int, int] | None:
        return tuple(value.shape) if isinstance(value, torch.Tensor) and value.dim() == 2 else None

    @classmethod
    def padded(cls, value: Any, mp: int, np_: int) -> Any:
        return _zero_padded(value, mp, np_)  # TMA fills out-of-bounds loads with zeros


class _Vector(Kind):
    """A vector broadcast over the tile: one value per output column (a RowVec, length N)
    or per output row (a ColVec, length M)."""

    per_column = True
    quack_load = ""  # the quack EpiOp that loads it

    @classmethod
    def expected_shape(cls, m: int, n: int) -> tuple[int, ...]:
        return (n,) if cls.per_column else (m,)

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        from quack.epilogue import ops

        return getattr(ops, cls.quack_load)(name)

    @classmethod
    def quack_value(cls, value: Any) -> Any:
        return value.reshape(1, -1)

    @classmethod
    def padded(cls, value: Any, mp: int, np_: int) -> Any:
        return _stale_padded(value, np_ if cls.per_column else mp)


class RowVec(_Vector):
    """One value per output column, length N, broadcast down the rows (gamma, bias)."""

    hint = "A RowVec has one value per output column (length N); per-row values are a ColVec."
    per_column, quack_load = True, "RowVecLoad"

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        return _per_column(value.float().reshape(1, -1), pairs_acc)


class ColVec(_Vector):
    """One value per output row, length M, broadcast across columns (inverse RMS)."""

    hint = "A ColVec has one value per output row (length M); per-column values are a RowVec."
    per_column, quack_load = False, "ColVecLoad"

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        return value.float().reshape(-1, 1)


class Scalar(Kind):
    """A Python number baked into the kernel (eps, a scale)."""

    op_argument = "scalars"

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CatalogueError(f"operand {operand!r} is declared Scalar and needs a Python number; "
                                 f"got {type(value).__name__} (pass tensors as Tile/RowVec/ColVec)")

    @classmethod
    def dry_run_value(cls, m: int, n: int) -> Any:
        return 1.0

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        return float(value)

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        from quack.epilogue import ops

        return ops.Scalar(name)


class PairedTile(Kind):
    """A 16-bit (M, 2N) tensor whose adjacent columns form one Pair per output
    element: the saved (gate, up) pre-activation read by the SwiGLU backward.
    At most one per epilogue; the epilogue's D then has this tensor's shape.
    The epilogue's N is the number of pairs: its other operands hold one value
    per pair (a RowVec N values, a Tile (M, N)), read as they are, without
    ``unpack`` (under ``pairs="acc"`` a RowVec has one per column, 2N, and is unpacked)."""

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

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        return Pair.of_columns(value.float())

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        return None  # quack's packed_cd_b16x2 mode reads it as C, two 16-bit lanes per word

    @classmethod
    def quack_parameter(cls, name: str) -> str:
        return "c"

    @classmethod
    def tma_row_bytes(cls, value: Any) -> int | None:
        return row_bytes(value)

    @classmethod
    def output_grid(cls, value: Any) -> tuple[int, int] | None:
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value.shape[0], value.shape[1] // 2
        return None

    @classmethod
    def padded(cls, value: Any, mp: int, np_: int) -> Any:
        return _zero_padded(value, mp, 2 * np_)


class HeadStat(Kind):
    """The per-head statistic of the element's head, declared in ``head_stats=``;
    gemm takes the head width under its name (the kernel computes the values), or
    ``(head_dim, eps)`` for a ``head_rstd()`` declared without eps (``Epilogue.call_eps``
    splits that pair before any check here)."""

    op_argument = "ints"

    @classmethod
    def check(cls, operand: str, value: object, m: int, n: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 2:
            raise CatalogueError(f"operand {operand!r} is a HeadStat: pass the head width as a positive "
                                 f"even int, gemm(..., {operand}=head_dim); got {value!r}")
        if n % value:
            raise CatalogueError(f"gemm: head statistic {operand!r} groups {value} columns per head, so "
                                 f"N must be a multiple of {value}; got N = {n}")

    @classmethod
    def dry_run_value(cls, m: int, n: int) -> Any:
        return 2  # a head width that divides the dry run's N

    @classmethod
    def reference_argument(cls, value: Any, acc: torch.Tensor, pairs_acc: bool, stat: HeadRms | None) -> Any:
        assert stat is not None  # the decorator pairs every HeadStat with a head_stats entry
        return _per_column(stat.values(acc, value).repeat_interleave(value, dim=1), pairs_acc)

    @classmethod
    def quack_op(cls, name: str, stat: HeadRms | None) -> Any:
        from quack.epilogue.head_rmsnorm import HeadRstd

        assert stat is not None
        return HeadRstd(name, eps=stat.eps)


KINDS: dict[str, type[Kind]] = {k.name: k for k in (Tile, RowVec, ColVec, Scalar, PairedTile, HeadStat)}
