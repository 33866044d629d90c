"""FP8: GEMMs on 8-bit operands, scales in the epilogue, fp8 outputs.

Where it pays: an fp8 GEMM takes half the time of a bf16 one on Hopper, while
every cast to fp8 is a memory-bound pass of its own, so the passes around a
GEMM weigh twice as much; an epilogue that writes the next GEMM's operand in
fp8 saves the cast.

The numerics, in both lowerings (the reference lowering computes the same
values on any device):

- **Operands.** ``gemm(A, B)`` takes A (M, K) and B (K, N) in ``float8_e4m3fn``
  or ``float8_e5m2`` (mixed is fine: e5m2 for gradients), both K-major (A's
  rows and B's columns contiguous: pass ``W.t()`` of a weight stored (N, K))
  and rows of a multiple of 16 bytes = 16 elements (the TMA unit).  The
  accumulator is fp32 and holds ``A_fp8 @ B_fp8`` exactly as the values are;
  a quantized tensor's dequantization scales are epilogue operands: a scale
  per row of A is a ``ColVec``, per column of B a ``RowVec``, and the program
  writes ``acc * sa * sb``.  Scales constant along K commute with the sum; a
  scale that varies along K cannot be applied after it.
- **Accumulation.** ``fast_accum=False`` (default) promotes the tensor core's
  partial sums into an fp32 register accumulator after every K tile (128
  elements): the reference's fp32 sum up to order.  ``fast_accum=True`` keeps
  the whole K loop in the tensor core's accumulator, whose adds keep fewer
  mantissa bits; the torch._scaled_mm projections of LLaMA-3 8B ran 6-13%
  faster with it on the H200.  torchao's recipes use it for the forward GEMM
  only.  The reference lowering sums in fp32 either way.  The promoted sums
  take a second set of registers: an untuned promoting GEMM runs a tile that
  holds both (``tile_config.fits_promoted``: cooperative, or 128x64 pingpong),
  and a ``config=`` that does not fit spills (the compile stage reports it).
- **fp8 outputs.** ``"fp8_e4m3"``/``"fp8_e5m2"`` as an ``outputs=`` dtype or
  ``out_dtype``: the value is rounded to nearest even and *saturates* at the
  format's largest finite value (448 / 57344; the GPU's ``cvt .satfinite``),
  so an outlier past the scale clips instead of becoming NaN.  The epilogue
  multiplies by the quantization multiplier itself (``q = v * qscale``) and the
  consumer dequantizes with ``1 / qscale``.  On SM90 only element-mode
  epilogues store fp8: paired stores (``pairs="acc"`` outputs, a PairedTile's
  D) are 16-bit in quack's SM90 epilogue.
- **Scales.** A GEMM operand wants one scale per row along K; an epilogue
  cannot compute a *current* one for what it writes, because a row's amax
  spans every N tile.  It quantizes with a multiplier known before the GEMM
  (a delayed per-tensor scale from an amax history, broadcast to a ColVec; or
  any provisional per-row scale, moved past the next GEMM like RMSNorm's r)
  and reduces the row amax (``col_max(maximum(v, -v))``) for the next step.
  (An fp8 store and a ``col_max`` in one epilogue spill a few registers at a
  128-wide pingpong tile: 4-12 STL/LDL in the sm_90a compile; either alone
  does not.)
  Everything else is quantized by ``quantize_rows`` (:mod:`.quantize`): current row-wise
  scales, powers of two (exact dequantization), torchao's rowwise recipe; a tensor that
  two GEMMs read along different axes (a gradient, for its input- and weight-gradient
  GEMMs) by ``quantize_both``, which writes both copies from two reads of it.  Where an
  epilogue writes the tensor in 16 bits, it can reduce the current scales' amaxes as it
  goes (``col_amax()`` per row, ``row_amax()`` per column: a paired store included) and
  hand them to the cast (``row_amax=``, ``col_amax=``), which then reads the tensor once.
  That trades a read for epilogue work, and in the fp8 SwiGLU block it lost (an H100 at
  LLaMA-3 8B, bench/results/h100-2026-12-07): dSwiGLU's kernel with a ``col_amax`` and two
  ``row_amax`` took 3.31 ms against 2.26, the SwiGLU forward's with one of each 2.74
  against 2.60, where the amax reads they saved took 0.52 ms: mlp_block 5.5% slower,
  llama3_block 1.2%. The fold down the columns is the likely cost: quack merges it across
  the warps through shared memory, behind a barrier, for every N stripe (not profiled
  further). So the experts let the casts reduce their own amaxes.
  A per-row factor that commutes with a GEMM (RMSNorm's r) may leave a per-token copy,
  whose scale takes it, but not a weight gradient's per-feature copy, whose one scale
  spans every token: quantize the normalized tensor there (``row_scale=``), or the
  tokens of large norm set the scale and those of tiny norm round to zero.
- **The recipe the fp8 experts use** (tasks/llama3_fp8): delayed per-tensor
  scales for what epilogues write, current row-wise scales for the rest, e4m3
  throughout, fast accumulation in the forward GEMMs.  Chosen by loss curves
  (``bench/fp8_loss.py``; CPU emulation of a 2-layer LLaMA, 200 steps,
  bench/results/cpu-2026-12-01-fp8-loss): final losses bf16 2.2961, torchao
  rowwise 2.2956 (seeds 1, 2: 2.3496, 2.3165: the noise band), tensorwise
  2.2990; delayed 2.2963 (2.6e-5 of its values saturated), a per-row bound
  moved past the GEMM 2.2976 (1.1e-4 saturated: the residual stream outgrows
  a stale rms), per-(row, 128-column) tile blocks 2.2934, which needs a
  mainloop that scales per K block (SM100's block-scaled MMA; quack's SM90
  fp8 mainloop has no such hook).  All inside the band; delayed scaling is
  the one that runs on SM90 and saturates least, and a per-tensor scale is
  the same in any layout.  The H200 run of the script decides at a larger
  size.
"""

from __future__ import annotations

import torch

from .errors import CatalogueError

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
EPS = 1e-12  # the amax floor: a zero row gets a finite scale (torchao's)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to the fp8 ``dtype``, saturating (the GPU's ``.satfinite``)."""
    m = fp8_max(dtype)
    return x.clamp(-m, m).to(dtype)


def store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 result as a kernel stores it in ``dtype``: fp8 saturates, others round."""
    return saturate(x, dtype) if is_fp8(dtype) else x.to(dtype)


def mainloop_key(A: torch.Tensor, B: torch.Tensor, fast_accum: bool) -> object:
    """What of the operands' types picks the mainloop (a tuning-cache key part):
    A's dtype for 16-bit GEMMs (as before fp8), both dtypes and the
    accumulation mode for fp8."""
    if not is_fp8(A.dtype):
        return A.dtype
    return (str(A.dtype), str(B.dtype), "fast_accum" if fast_accum else "promote")


def check_operands(A: torch.Tensor, B: torch.Tensor) -> None:
    """The fp8 mainloop's layout rules, with the fix in each message."""
    if not (is_fp8(A.dtype) and is_fp8(B.dtype)):
        raise CatalogueError(f"gemm: A is {A.dtype} and B is {B.dtype}; an fp8 GEMM takes both in fp8 "
                             "(quantize the other with quantize_rows)")
    if A.stride(1) != 1:
        raise CatalogueError("gemm: an fp8 A must be K-major (rows contiguous); quantize_rows(x.t()) "
                             "writes a contiguous transposed copy")
    if B.stride(0) != 1:
        raise CatalogueError("gemm: an fp8 B must be K-major (columns contiguous): pass W.t() of a "
                             "weight stored (N, K), e.g. quantize_rows(W)['q'].t()")


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantization scale for rows whose absolute maximum is ``amax``: the
    power of two ``2 ** -floor(log2(max / amax))`` that maps the amax to at
    most the format's maximum (exact to apply and to invert)."""
    mul = fp8_max(dtype) / amax.float().clamp_min(EPS)
    return torch.exp2(-torch.floor(torch.log2(mul)))
