"""The CUDA paths of :func:`quantize.quantize_rows` and :func:`quantize.quantize_both`:
two Triton kernels each, no host sync.

Imported lazily (only for CUDA tensors).  ``x`` is any strided 2-D view.  Pass 1
reduces each row's amax (of ``x * row_scale * col_scale``) into an fp32 buffer;
pass 2 turns it into the power-of-two scale, scales, saturates and stores fp8.
Two reads of x and one fp8 write: the same traffic as a fused amax + cast,
without holding a whole row in one program (a row of the down projection's
input is 14336 wide).  Rows contiguous in memory: a program walks a few whole
rows in long column blocks.  Otherwise (``quantize_rows(x.t())``, the transposed
copy a weight-gradient GEMM needs) pass 1 is the strip kernel below, run on the
view's transpose so that it reads along memory, and pass 2 walks square (row,
column) tiles, loads coalesced down a tile and stores along it: a program per
row block would leave the GPU idle where the view has few rows (a (16384, 4096)
activation's transpose has 4096: 64 programs, 0.53 ms on the H200 where its rows
took 0.09).

The amax pass for both (``_amax_strip_kernel``): a program reads a strip of rows
of one column block, folding its rows' maxima into the row buffer with an atomic
maximum per row and step, and its columns' maxima, kept in registers over the
strip, with one per column at the end.  A maximum is exact and order-free, so
the result is deterministic; the buffers are fp32 read as int32, as a
non-negative float orders like its bits.  A 128 x 128 tile per program, with an
atomic per row and per column of every tile, took half of quantize_both's time
on the H200 (BENCHMARKS.md, run 15).

``quantize_both``: pass 1 reduces the row and column amaxes into two buffers (skipped
where the epilogue that wrote x reduced them: ``row_amax``/``col_amax``); pass 2
walks the tiles and writes each twice, quantized by its rows'
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

# The cast kernels' square tiles, whichever way x lies: they store along both of a tile's axes.
CAST_TILE = 64
# The amax pass's steps hold AMAX_STEP elements of column blocks AMAX_WIDTH wide; it aims at
# AMAX_PROGRAMS programs (a few per SM) of AMAX_WARPS warps each.  ``bench/fp8.py --casts`` times
# 54 geometries on the H200: this one was the fastest at all three of an 8B layer's widths (4096,
# 14336, 28672), within 14% of a plain read reduction (``x.amax()``) and 1.3-1.4x faster than
# 512-wide blocks of 8 warps (BENCHMARKS.md, run 16).  The likely reason: a 128-wide row is 16
# threads of one warp, so its per-step fold needs only shuffles, where a 512-wide one spans two
# warps and meets in shared memory behind a barrier.
AMAX_STEP, AMAX_WIDTH, AMAX_PROGRAMS, AMAX_WARPS = 8192, 128, 1024, 4


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
def _amax_strip_kernel(Y, syr, syc, PRE_R, PRE_C, POST_R, POST_C, RAMAX, CAMAX, rows, cols, strip_rows,
                       HAS_PRE_R: tl.constexpr, HAS_PRE_C: tl.constexpr, HAS_POST_R: tl.constexpr,
                       HAS_POST_C: tl.constexpr, DO_R: tl.constexpr, DO_C: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row and/or column amaxes of |y * pre_r * pre_c|, times |post_r| / |post_c|, folded into RAMAX /
    CAMAX (int32 views of fp32 buffers: a non-negative float orders like its bits, so one integer
    atomic maximum is exact).  A program walks a strip of ``strip_rows`` rows of one column block
    in (BLOCK_R, BLOCK_C) steps: each step folds its rows' maxima with one atomic per row, the
    strip's column maxima stay in registers until one atomic per column at the end."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(cols, BLOCK_C)
    sb, cb = pid // col_blocks, pid % col_blocks
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cm = c < cols
    if HAS_PRE_C:
        fc = tl.load(PRE_C + c, mask=cm, other=0.0).to(tl.float32)
    col_acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)  # reduced across its rows once, at the end
    for i in range(0, strip_rows, BLOCK_R):
        r = sb * strip_rows + i + tl.arange(0, BLOCK_R).to(tl.int64)
        rm = (r < rows) & (i + tl.arange(0, BLOCK_R) < strip_rows)
        v = tl.load(Y + r[:, None] * syr + c[None, :] * syc, mask=rm[:, None] & cm[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_PRE_C:
            v = v * fc[None, :]
        if HAS_PRE_R:
            v = v * tl.load(PRE_R + r, mask=rm, other=0.0).to(tl.float32)[:, None]
        a = tl.abs(v)
        if DO_R:
            rmax = tl.max(a, axis=1)
            if HAS_POST_R:  # a non-negative factor commutes with the maximum, rounding included
                rmax = rmax * tl.abs(tl.load(POST_R + r, mask=rm, other=0.0).to(tl.float32))
            tl.atomic_max(RAMAX + r, rmax.to(tl.int32, bitcast=True), mask=rm)
        if DO_C:
            col_acc = tl.maximum(col_acc, a)
    if DO_C:
        cmax = tl.max(col_acc, axis=0)
        if HAS_POST_C:
            cmax = cmax * tl.abs(tl.load(POST_C + c, mask=cm, other=0.0).to(tl.float32))
        tl.atomic_max(CAMAX + c, cmax.to(tl.int32, bitcast=True), mask=cm)


@triton.jit
def _quantize_both_kernel(X, sxr, sxc, RS, RAMAX, CAMAX, Q, QT, SCALE, SCALE_T, rows, cols, fmax, eps,
                          HAS_RS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    v, r, c, m, rb, cb = _tile(X, sxr, sxc, rows, cols, BLOCK_R, BLOCK_C)
    if HAS_RS:  # v = x * row_scale, as the amax pass read it
        v = v * tl.load(RS + r, mask=r < rows, other=0.0).to(tl.float32)[:, None]
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


def _amaxes(x: torch.Tensor, ramax: torch.Tensor | None, camax: torch.Tensor | None,
            pre_c: torch.Tensor | None = None, post_r: torch.Tensor | None = None,
            pre_r: torch.Tensor | None = None, *, step: int = AMAX_STEP, width: int = AMAX_WIDTH,
            programs: int = AMAX_PROGRAMS, warps: int = AMAX_WARPS) -> None:
    """Fold the row amaxes of ``|x * pre_r * pre_c| * |post_r|`` into ``ramax`` and/or its column
    amaxes into ``camax`` (fp32, zeros or earlier maxima).  The strip kernel reads its view's
    rows along memory, so a view whose columns lie along memory (a transpose) runs as its transpose,
    rows and columns swapped.  ``step``, ``width`` (a power of two), ``programs`` and ``warps`` are
    the kernel's geometry (any gives the same maxima)."""
    view, rbuf, cbuf, post_c = x, ramax, camax, None
    if x.stride(1) != 1 and x.stride(0) == 1:  # x's rows are the view's columns, and its factors swap sides
        view, rbuf, cbuf = x.t(), camax, ramax
        pre_r, pre_c = pre_c, pre_r
        post_c, post_r = post_r, None
    rows, cols = view.shape
    block_c = min(width, max(16, triton.next_power_of_2(cols)))
    block_r = max(1, step // block_c)
    col_blocks = triton.cdiv(cols, block_c)
    strips = max(1, min(triton.cdiv(rows, block_r), triton.cdiv(programs, col_blocks)))
    strip_rows = triton.cdiv(triton.cdiv(rows, strips), block_r) * block_r
    some = rbuf if rbuf is not None else cbuf

    def arg(t: torch.Tensor | None) -> torch.Tensor:  # an absent operand is never read: any tensor stands in
        return t if t is not None else some

    _amax_strip_kernel[(triton.cdiv(rows, strip_rows) * col_blocks,)](
        view, view.stride(0), view.stride(1), arg(pre_r), arg(pre_c), arg(post_r), arg(post_c),
        arg(rbuf).view(torch.int32), arg(cbuf).view(torch.int32), rows, cols, strip_rows,
        HAS_PRE_R=pre_r is not None, HAS_PRE_C=pre_c is not None, HAS_POST_R=post_r is not None,
        HAS_POST_C=post_c is not None, DO_R=rbuf is not None, DO_C=cbuf is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


def _tiles(rows: int, cols: int, block: int) -> tuple[int]:
    """The tile kernels' flat grid: one program per (block, block) tile."""
    return (triton.cdiv(rows, block) * triton.cdiv(cols, block),)


def quantize_both_triton(x: torch.Tensor, dtype: torch.dtype, row_scale: torch.Tensor | None = None,
                         row_amax: torch.Tensor | None = None, col_amax: torch.Tensor | None = None
                         ) -> dict[str, torch.Tensor]:
    rows, cols = x.shape
    dev = x.device
    out = {"q": torch.empty(rows, cols, dtype=dtype, device=dev), "scale": torch.empty(rows, device=dev),
           "qt": torch.empty(cols, rows, dtype=dtype, device=dev), "scale_t": torch.empty(cols, device=dev)}
    if rows == 0 or cols == 0:
        return out
    rs = row_scale.float().contiguous() if row_scale is not None else None
    if row_amax is not None:  # reduced by the epilogue that wrote x: one read of x, not two
        ramax, camax = row_amax.float().contiguous(), col_amax.float().contiguous()
    else:  # zeros are the identity of a maximum of absolute values
        ramax, camax = torch.zeros(rows, device=dev), torch.zeros(cols, device=dev)
        _amaxes(x, ramax, camax, pre_r=rs)
    _quantize_both_kernel[_tiles(rows, cols, CAST_TILE)](
        x, x.stride(0), x.stride(1), ramax if rs is None else rs, ramax, camax, out["q"], out["qt"], out["scale"],
        out["scale_t"], rows, cols, fp8_max(dtype), EPS, HAS_RS=rs is not None, BLOCK_R=CAST_TILE,
        BLOCK_C=CAST_TILE)
    return out


def quantize_rows_triton(x: torch.Tensor, dtype: torch.dtype, row_scale: torch.Tensor | None,
                         col_scale: torch.Tensor | None, row_amax: torch.Tensor | None = None
                         ) -> dict[str, torch.Tensor]:
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return {"q": q, "scale": scale}
    rs = row_scale.float().contiguous() if row_scale is not None else scale  # unread when absent
    cs = col_scale.float().contiguous() if col_scale is not None else scale
    fmax, has = fp8_max(dtype), dict(HAS_RS=row_scale is not None, HAS_CS=col_scale is not None)
    given = row_amax.float().contiguous() if row_amax is not None else None  # the epilogue's: no amax pass
    if x.stride(1) == 1:  # rows contiguous: a few whole rows per program, long column blocks
        grid = (triton.cdiv(rows, 4),)
        amax = given
        if amax is None:
            amax = torch.empty(rows, dtype=torch.float32, device=x.device)
            _row_amax_kernel[grid](x, x.stride(0), x.stride(1), rs, cs, amax, rows, cols, BLOCK_R=4,
                                   BLOCK_C=1024, **has)
        _quantize_kernel[grid](x, x.stride(0), x.stride(1), rs, cs, amax, q, scale, rows, cols, fmax, EPS,
                               BLOCK_R=4, BLOCK_C=1024, **has)
        return {"q": q, "scale": scale}
    amax = given
    if amax is None:
        amax = torch.zeros(rows, dtype=torch.float32, device=x.device)  # the identity of the atomic maxima
        _amaxes(x, amax, None, pre_c=cs if col_scale is not None else None,
                post_r=rs if row_scale is not None else None)
    _tile_quantize_kernel[_tiles(rows, cols, CAST_TILE)](
        x, x.stride(0), x.stride(1), rs, cs, amax, q, scale, rows, cols, fmax, EPS, BLOCK_R=CAST_TILE,
        BLOCK_C=CAST_TILE, **has)
    return {"q": q, "scale": scale}
