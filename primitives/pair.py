"""Pairs: two lanes of adjacent columns handled as one value (catalogue family 1).

A paired epilogue (``pairs="acc"``, or a ``PairedTile`` operand) sees columns
(2j, 2j+1) as one :class:`Pair`: ``g, u = unpack(acc)``, ``return {"D": pack(a, b)}``.
As a value it is a plain tuple of its two lanes with lane-wise ``+ - *``
(a single value, or a number, applies to both lanes), so ``acc * rstd + bias``
works before unpacking.

The catalogue owns this type, so importing it costs nothing: each lowering
converts at its boundary.  The reference lowering builds Pairs of torch column
slices (:meth:`Pair.of_columns`); the cute lowering swaps them for quack's own
``Pair`` where quack's tracer hands values in and reads them back
(``cute.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .errors import CatalogueError


class Pair(NamedTuple):
    """Two lanes of adjacent columns, ``(a, b)``, with lane-wise arithmetic."""

    a: Any
    b: Any

    @classmethod
    def of_columns(cls, x: Any) -> Pair:
        """The even and odd columns of a tensor as one Pair (the reference lowering's view)."""
        return cls(x[..., 0::2], x[..., 1::2])

    @staticmethod
    def _lanes(v: Any) -> tuple[Any, Any]:
        return (v[0], v[1]) if isinstance(v, tuple) else (v, v)

    def __add__(self, other: Any) -> Pair:  # type: ignore[override]
        a, b = Pair._lanes(other)
        return Pair(self.a + a, self.b + b)

    __radd__ = __add__

    def __mul__(self, other: Any) -> Pair:  # type: ignore[override]
        a, b = Pair._lanes(other)
        return Pair(self.a * a, self.b * b)

    __rmul__ = __mul__

    def __sub__(self, other: Any) -> Pair:
        a, b = Pair._lanes(other)
        return Pair(self.a - a, self.b - b)

    def __rsub__(self, other: Any) -> Pair:
        a, b = Pair._lanes(other)
        return Pair(a - self.a, b - self.b)

    def __neg__(self) -> Pair:
        return Pair(-self.a, -self.b)


def unpack(value: Any) -> tuple[Any, Any]:
    """Split a Pair into its two lanes: ``g, u = unpack(acc)``."""
    if not isinstance(value, Pair):
        raise CatalogueError(
            "unpack() got a value that is not a Pair. Pairs exist only with "
            "@epilogue(pairs='acc') (adjacent accumulator columns) or for a PairedTile operand; beside a "
            "PairedTile the other operands hold one value per pair (a RowVec N values, not 2N): use them as they "
            "are, without unpack().")
    return value.a, value.b


def pack(a: Any, b: Any) -> Pair:
    """Join two lanes into a Pair: ``return {"D": pack(dg, du)}``."""
    return Pair(a, b)
