"""The CUDA paths of :func:`quantize.quantize_rows` and :func:`quantize.quantize_both`:
two Triton kernels each, no host sync.

Imported lazily (only for CUDA tensors).  ``x`` is any strided 2-D view.  Pass 1
reduces each row's amax (of ``x * row_scale * col_scale``) into an fp32 buffer;
pass 2 turns it into the power-of-two scale, scales, saturates and stores fp8.
Two reads of x and one fp8 write: the same traffic as a fused amax + cast,
without holding a whole row in one program (a row of the down projection's
input is 14336 wide).  Rows contiguous in memory: a program walks a few whole
rows in long column blocks.  Otherwise (``quantize_rows(x.t())``, the transposed
copy a weight-gradient GEMM needs) the kernels walk square (row, column) tiles,
loads coalesced down a tile and stores along it, and pass 1 folds each tile's
row amaxes into the buffer with atomic maxima (a maximum is exact and
order-free, so the result is deterministic): a program per row block would
leave the GPU idle where the view has few rows (a (16384, 4096) activation's
transpose has 4096: 64 programs, 0.53 ms on the H200 where its rows took 0.09).

``quantize_both`` walks the tiles too: pass 1 reduces each tile's row and column
amaxes into two buffers; pass 2 writes the tile twice, quantized by its rows'
scales into ``q`` and by its columns' scales, transposed, into ``qt``.  Two reads
of x and two fp8 writes, where ``quantize_rows(x)`` and ``quantize_rows(x.t())``
read x four times.  Every path computes the scale and the cast with the same
expressions, so the bits match.  The tile kernels run on a flat grid (one
program per tile), so neither dimension meets CUDA's 65535 limit on a grid's
y extent (a transposed view has as many columns as there are tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import EPS, fp8_max

# The tile kernels' square tiles, whichever way x lies: the casts store along both of a tile's
# axes (64); the amax passes take larger ones (128), folding each row and column into fewer atomics.
CAST_TILE, AMAX_TILE = 64, 128


@triton.jit
def _load_block(X, sxr, sxc, CS, r, rmask, start, cols, HAS_CS: tl.constexpr, BLOCK_C: tl.constexpr):
    """x[r, start:start + BLOCK_C] * col_scale in fp32 (0 outside), and its mask."""
    c = start + tl.arange(0, BLOCK_C).to(tl.int64)
    m = rmask[:, None] & (c[None, :] < cols)
    v = tl.load(X + r[:, None] * sxr + c[None, :] * sxc, mask=m, other=0.0).to(tl.float32)
    if HAS_CS:
        v = v * tl.load(CS + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    return v, c, m


@triton.jit
def _scale_of(amax, fmax, eps):
    """The power-of-two dequantization scale 2 ** -floor(log2(fmax / amax)): dividing by it is exact."""
    return tl.exp2(-tl.floor(tl.log2(fmax / tl.maximum(amax, eps))))


@triton.jit
def _row_amax_kernel(X, sxr, sxc, RS, CS, AMAX, rows, cols, HAS_RS: tl.constexpr, HAS_CS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = r < rows
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, cols, BLOCK_C):
        v, c, m = _load_block(X, sxr, sxc, CS, r, rmask, start, cols, HAS_CS, BLOCK_C)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    if HAS_RS:
        amax = amax * tl.abs(tl.load(RS + r, mask=rmask, other=0.0).to(tl.float32))
    tl.store(AMAX + r, amax, mask=rmask)


@triton.jit
def _quantize_kernel(X, sxr, sxc, RS, CS, AMAX, Q, SCALE, rows, cols, fmax, eps,
                     HAS_RS: tl.constexpr, HAS_CS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = r < rows
    scale = _scale_of(tl.load(AMAX + r, mask=rmask, other=1.0), fmax, eps)
    mul = 1.0 / scale
    if HAS_RS:
        mul = mul * tl.load(RS + r, mask=rmask, other=0.0).to(tl.float32)
    tl.store(SCALE + r, scale, mask=rmask)
    for start in range(0, cols, BLOCK_C):
        v, c, m = _load_block(X, sxr, sxc, CS, r, rmask, start, cols, HAS_CS, BLOCK_C)
        q = tl.minimum(tl.maximum(v * mul[:, None], -fmax), fmax)
        tl.store(Q + r[:, None] * cols + c[None, :], q.to(Q.dtype.element_ty), mask=m)


@triton.jit
def _tile(X, sxr, sxc, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (BLOCK_R, BLOCK_C) tile of x in fp32 (0 outside), its row and column indices, the
    mask, and its row and column block.  The grid is flat (no axis limit), along the columns first."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(cols, BLOCK_C)
    rb, cb = pid // col_blocks, pid % col_blocks
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    m = (r < rows)[:, None] & (c < cols)[None, :]
    v = tl.load(X + r[:, None] * sxr + c[None, :] * sxc, mask=m, other=0.0).to(tl.float32)
    return v, r, c, m, rb, cb


@triton.jit
def _amax_both_kernel(X, sxr, sxc, RAMAX, CAMAX, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    v, r, c, m, rb, cb = _tile(X, sxr, sxc, rows, cols, BLOCK_R, BLOCK_C)
    a = tl.abs(v)
    tl.atomic_max(RAMAX + r, tl.max(a, axis=1), mask=r < rows)
    tl.atomic_max(CAMAX + c, tl.max(a, axis=0), mask=c < cols)


@triton.jit
def _quantize_both_kernel(X, sxr, sxc, RAMAX, CAMAX, Q, QT, SCALE, SCALE_T, rows, cols, fmax, eps,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    v, r, c, m, rb, cb = _tile(X, sxr, sxc, rows, cols, BLOCK_R, BLOCK_C)
    rs = _scale_of(tl.load(RAMAX + r, mask=r < rows, other=1.0), fmax, eps)
    cs = _scale_of(tl.load(CAMAX + c, mask=c < cols, other=1.0), fmax, eps)
    if cb == 0:
        tl.store(SCALE + r, rs, mask=r < rows)
    if rb == 0:
        tl.store(SCALE_T + c, cs, mask=c < cols)
    q = tl.minimum(tl.maximum(v * (1.0 / rs)[:, None], -fmax), fmax)
    tl.store(Q + r[:, None] * cols + c[None, :], q.to(Q.dtype.element_ty), mask=m)
    qt = tl.minimum(tl.maximum(v * (1.0 / cs)[None, :], -fmax), fmax)
    tl.store(QT + c[None, :] * rows + r[:, None], qt.to(QT.dtype.element_ty), mask=m)


@triton.jit
def _scaled_tile(X, sxr, sxc, CS, rows, cols, HAS_CS: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """``_tile`` times col_scale (as ``_load_block`` applies it)."""
    v, r, c, m, rb, cb = _tile(X, sxr, sxc, rows, cols, BLOCK_R, BLOCK_C)
    if HAS_CS:
        v = v * tl.load(CS + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    return v, r, c, m, cb


@triton.jit
def _tile_row_amax_kernel(X, sxr, sxc, RS, CS, AMAX, rows, cols, HAS_RS: tl.constexpr, HAS_CS: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    v, r, c, m, cb = _scaled_tile(X, sxr, sxc, CS, rows, cols, HAS_CS, BLOCK_R, BLOCK_C)
    amax = tl.max(tl.abs(v), axis=1)
    if HAS_RS:  # a non-negative factor commutes with the maximum, rounding included
        amax = amax * tl.abs(tl.load(RS + r, mask=r < rows, other=0.0).to(tl.float32))
    tl.atomic_max(AMAX + r, amax, mask=r < rows)


@triton.jit
def _tile_quantize_kernel(X, sxr, sxc, RS, CS, AMAX, Q, SCALE, rows, cols, fmax, eps, HAS_RS: tl.constexpr,
                          HAS_CS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    v, r, c, m, cb = _scaled_tile(X, sxr, sxc, CS, rows, cols, HAS_CS, BLOCK_R, BLOCK_C)
    scale = _scale_of(tl.load(AMAX + r, mask=r < rows, other=1.0), fmax, eps)
    mul = 1.0 / scale
    if HAS_RS:
        mul = mul * tl.load(RS + r, mask=r < rows, other=0.0).to(tl.float32)
    if cb == 0:
        tl.store(SCALE + r, scale, mask=r < rows)
    q = tl.minimum(tl.maximum(v * mul[:, None], -fmax), fmax)
    tl.store(Q + r[:, None] * cols + c[None, :], q.to(Q.dtype.element_ty), mask=m)


def _tiles(rows: int, cols: int, block: int) -> tuple[int]:
    """The tile kernels' flat grid: one program per (block, block) tile."""
    return (triton.cdiv(rows, block) * triton.cdiv(cols, block),)


def quantize_both_triton(x: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    rows, cols = x.shape
    dev = x.device
    out = {"q": torch.empty(rows, cols, dtype=dtype, device=dev), "scale": torch.empty(rows, device=dev),
           "qt": torch.empty(cols, rows, dtype=dtype, device=dev), "scale_t": torch.empty(cols, device=dev)}
    if rows == 0 or cols == 0:
        return out
    # Zeros are the identity of a maximum of absolute values.
    ramax, camax = torch.zeros(rows, device=dev), torch.zeros(cols, device=dev)
    _amax_both_kernel[_tiles(rows, cols, AMAX_TILE)](
        x, x.stride(0), x.stride(1), ramax, camax, rows, cols, BLOCK_R=AMAX_TILE, BLOCK_C=AMAX_TILE, num_warps=8)
    _quantize_both_kernel[_tiles(rows, cols, CAST_TILE)](
        x, x.stride(0), x.stride(1), ramax, camax, out["q"], out["qt"], out["scale"], out["scale_t"], rows, cols,
        fp8_max(dtype), EPS, BLOCK_R=CAST_TILE, BLOCK_C=CAST_TILE)
    return out


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype, row_scale: torch.Tensor | None,
                         col_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return {"q": q, "scale": scale}
    rs = row_scale.float().contiguous() if row_scale is not None else scale  # unread when absent
    cs = col_scale.float().contiguous() if col_scale is not None else scale
    fmax, has = fp8_max(dtype), dict(HAS_RS=row_scale is not None, HAS_CS=col_scale is not None)
    if x.stride(1) == 1:  # rows contiguous: a few whole rows per program, long column blocks
        amax = torch.empty(rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, 4),)
        _row_amax_kernel[grid](x, x.stride(0), x.stride(1), rs, cs, amax, rows, cols, BLOCK_R=4, BLOCK_C=1024,
                               **has)
        _quantize_kernel[grid](x, x.stride(0), x.stride(1), rs, cs, amax, q, scale, rows, cols, fmax, EPS,
                               BLOCK_R=4, BLOCK_C=1024, **has)
        return {"q": q, "scale": scale}
    amax = torch.zeros(rows, dtype=torch.float32, device=x.device)  # the identity of the atomic maxima
    _tile_row_amax_kernel[_tiles(rows, cols, AMAX_TILE)](
        x, x.stride(0), x.stride(1), rs, cs, amax, rows, cols, BLOCK_R=AMAX_TILE, BLOCK_C=AMAX_TILE, num_warps=8,
        **has)
    _tile_quantize_kernel[_tiles(rows, cols, CAST_TILE)](
        x, x.stride(0), x.stride(1), rs, cs, amax, q, scale, rows, cols, fmax, EPS, BLOCK_R=CAST_TILE,
        BLOCK_C=CAST_TILE, **has)
    return {"q": q, "scale": scale}
