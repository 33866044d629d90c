"""Where a GEMM's (or a tile pass's) D goes: ``out=`` (a dead buffer D is written into) or
``accumulate_into=`` (D += the result, the TMA reduce-add store), checked before the launch.

The checks name the fix: the shape and dtype D has, row-major rows of 16-byte multiples for the
TMA store, and no memory shared with what the call reads.  The reference lowering computes D
into a buffer of its own and poisons ``out`` afterwards, so a destination that overlaps an
operand would be right on the CPU and a race on the GPU (each tile of D written while other
tiles still read the A rows, B columns or vectors under it): the overlap is refused in every
lowering, by memory span, views included.
"""

from __future__ import annotations

from typing import Any

import torch

from . import fp8
from .epilogue import Epilogue
from .errors import CatalogueError
from .operands import row_bytes


def check_destination(what: str, epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
                       m: int, n: int, dtype: torch.dtype, accumulate_into: torch.Tensor | None,
                       out: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor D goes into (``accumulate_into`` or ``out``), checked; None: a new one."""
    if accumulate_into is not None and out is not None:
        raise CatalogueError(f"{what}: give accumulate_into (D += result) or out (D = result), not both")
    dest = accumulate_into if accumulate_into is not None else out
    if dest is None:
        return None
    arg = "accumulate_into" if out is None else "out"
    if epi is not None and not epi.stores_d:
        raise CatalogueError(f"{what}: {arg} takes D, but epilogue {epi.name!r} returns no 'D'")
    want = epi.d_shape(m, n) if epi is not None else (m, n)
    if not isinstance(dest, torch.Tensor) or tuple(dest.shape) != want:
        raise CatalogueError(f"{what}: {arg} must be a tensor of shape {want}")
    if accumulate_into is not None and fp8.is_fp8(accumulate_into.dtype):
        raise CatalogueError(f"{what}: accumulate_into adds with the TMA reduce-add store, which takes "
                             "fp32, bf16 or fp16; accumulate in one of those")
    if out is not None:
        if out.dtype != dtype:
            raise CatalogueError(f"{what}: out is {out.dtype}, and D is {dtype} here (the first Tile's dtype in a "
                                 "tile_pass, A's in a gemm, or out_dtype=, or the PairedTile's)")
        if out.stride(-1) != 1 or row_bytes(out) % 16:
            raise CatalogueError(f"{what}: out must be row-major with rows of a multiple of 16 bytes (TMA stores)")
    # Every tile reads all of A's rows and B's columns that it needs, and every tile of a row (column)
    # its vector operands: D written over any of them races with the tiles still reading.  A Tile
    # operand that is D itself, element for element, is read by the tile that writes it, first.
    read = {"A": A, "B": B, **{k: v for k, v in operands.items() if isinstance(v, torch.Tensor)}}
    for name, t in ({} if torch.compiler.is_compiling() else read).items():  # a traced call has no storages
        same = name not in ("A", "B") and (t.data_ptr(), t.shape, t.stride()) == (
            dest.data_ptr(), dest.shape, dest.stride())
        if not same and _overlap(dest, t):
            raise CatalogueError(f"{what}: {arg} shares memory with {name if name in ('A', 'B') else repr(name)}, "
                                 f"which the call reads while it writes D (other tiles still read what one tile "
                                 f"stores over); give {arg} a buffer of its own")
    return dest


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share an element: exactly for row-major 2-D views with one row stride
    (column slices of one buffer, side by side, do not), else whether their memory spans meet."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0 or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.data_ptr() > b.data_ptr():
        a, b = b, a
    size = a.element_size()
    last = [sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) for t in (a, b)]
    if b.data_ptr() >= a.data_ptr() + (last[0] + 1) * size:
        return False
    row = a.stride(0) if a.dim() == 2 else 0
    if not (a.dim() == b.dim() == 2 and b.element_size() == size and a.stride() == b.stride() == (row, 1)
            and row > 0 and (b.data_ptr() - a.data_ptr()) % size == 0):
        return True  # spans meet; no finer look
    q, r = divmod((b.data_ptr() - a.data_ptr()) // size, row)  # b's first element: a's row q, column r
    (rows_a, cols_a), (rows_b, cols_b) = a.shape, b.shape
    # b's rows lie on a's rows q.., at columns r..r+cols_b-1, the part past the row stride on the next
    return (q < rows_a and r < cols_a) or (r + cols_b > row and q + 1 < rows_a)
