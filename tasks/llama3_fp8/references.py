"""PyTorch references of the FP8 suite: the LLaMA-3 tasks with fp8 GEMMs.

The recipe these references define (the catalogue's ``primitives/fp8.py``
computes the same numbers):

- **GEMM operands in fp8, fp32 accumulate (the fp8 tensor cores' on a GPU:
  :func:`fp8_product`), scales in the epilogue.**  A GEMM
  ``C = A @ B`` reads A (M, K) and B (K, N) as fp8 with a dequantization scale
  per row of A (``sa``, (M,)) and per column of B (``sb``, (N,)):
  ``C = (A_fp8 @ B_fp8) * sa[:, None] * sb[None, :]``.  Both scales are
  constant along K, so they commute with the sum and are applied to the fp32
  accumulator.  The forward GEMMs accumulate fast (no promotion of the tensor
  core's partial sums), the gradients' GEMMs promoted: torchao's choice.
- **Current row-wise scaling** (torchao's "rowwise" recipe, e4m3 everywhere):
  a tensor quantized for a GEMM gets one scale per row along the GEMM's K:
  ``scale = 2 ** -floor(log2(448 / amax_row))`` (a power of two, so dequantizing
  is exact), ``q = sat(x / scale)``, saturating at +-448.  The weight is
  quantized along each GEMM's K: once per layout (``W`` for the forward, ``W^T``
  for the input gradient), and the weight gradient's operands along the token
  dimension (``dY^T``, ``X^T``).
- **Delayed scaling inside an epilogue** (llama3_block): a tensor that an
  epilogue writes in fp8 cannot get a row-wise *current* scale, because its
  row's amax spans every N tile of the GEMM.  The epilogue quantizes with a
  per-row dequantization scale known before the GEMM (``*_scale``: a delayed
  per-tensor scale from an amax history, broadcast to rows), stores
  ``sat(v / scale)`` and reduces the row amax of ``v`` for the history; the
  consuming GEMM dequantizes with ``scale`` per row.
- The backward of a quantization is the identity (straight-through), as in
  torchao and TransformerEngine.

How the verifier uses them (CODA's rule, tasks/spec.py: ``Tolerance``): each
reference is called twice, once with the float inputs upcast (fp64 on the CPU,
fp32 on a GPU) and once with the inputs in their declared dtypes.  The upcast
run is the *truth*: the exact math of the task on the given values, no
quantization inside.  The run in the declared dtypes (fp8 or bf16 inputs) is
the *fp8 reference*: inputs as given (already fp8 where declared), every GEMM
operand the recipe quantizes rounded to fp8 as above, fp32 accumulation, the
same scale application, outputs rounded to their declared dtype.  Its distance
from the truth is the noise floor the program's error must stay within (twice
it, plus a floor), so a program may be more exact than the recipe, never less.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coda_agent.tasks.llama3.references import dswiglu

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # the amax floor (torchao's): an all-zero row gets a finite scale


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def low_precision_run(x: torch.Tensor) -> bool:
    """True for the verifier's run in the declared dtypes (fp8 or bf16 inputs):
    the fp8 recipe is emulated; False for the upcast run (the exact math)."""
    return x.dtype in FP8 or x.dtype in (torch.bfloat16, torch.float16)


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to ``dtype``, saturating at its largest finite value
    (the GPU's cvt ``.satfinite``); returned as fp32."""
    m = fp8_max(dtype)
    return x.float().clamp(-m, m).to(dtype).float()


def rowwise_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantization scale for rows with absolute maximum ``amax``: the
    power of two that maps the amax to at most the dtype's maximum."""
    mul = fp8_max(dtype) / amax.float().clamp_min(EPS)
    return torch.exp2(-torch.floor(torch.log2(mul)))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values as fp32, dequantization scale per row) of a 2-D tensor."""
    scale = rowwise_scale(x.float().abs().amax(dim=1), dtype)
    return saturate(x.float() / scale[:, None], dtype), scale


def dequantized_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """x after a row-wise fp8 round trip (what a GEMM reading it in fp8 sees)."""
    q, scale = quantize_rows(x, dtype)
    return q * scale[:, None]


def fp8_product(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                a_dtype: torch.dtype = E4M3, b_dtype: torch.dtype = E4M3, fast_accum: bool = False) -> torch.Tensor:
    """``(qa @ qb^T) * sa[:, None] * sb[None, :]`` in fp32: the recipe's GEMM, for qa (M, K)
    and qb (N, K) holding values of the fp8 grids of ``a_dtype`` and ``b_dtype`` and sa, sb
    their dequantization scales per row.

    On a GPU the fp8 tensor cores multiply and accumulate (``torch._scaled_mm`` at unit
    scales; ``fast_accum`` for the forward GEMMs, which the recipe runs with fast
    accumulation as torchao's does, and promoted partial sums for the gradients' GEMMs), as
    the program's kernel does: Hopper's fp8 MMA adds with
    fewer bits than fp32 between promotions, so at K in the thousands an exact fp32 sum sets a
    bar that the hardware's own rounding crosses at scattered elements (seen on the H200 at
    LLaMA-3 8B widths, BENCHMARKS.md run 9).  The fp8 reference then carries the hardware's
    accumulation error as the bf16 references carry cuBLAS's.  Elsewhere, and for shapes the
    fp8 GEMM does not take (K or N not a multiple of 16), the sum is fp32."""
    acc = None
    if qa.is_cuda and qa.shape[1] % 16 == 0 and qb.shape[0] % 16 == 0 and not _NO_FP8_GEMM:
        one = torch.ones((), device=qa.device)
        try:
            acc = torch._scaled_mm(qa.to(a_dtype).contiguous(), qb.to(b_dtype).contiguous().t(), scale_a=one,
                                   scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum)
        except RuntimeError as e:  # a GPU or build without this fp8 GEMM: fp32, as on the CPU
            _NO_FP8_GEMM.append(f"{type(e).__name__}: {e}")
    if acc is None:
        acc = qa.float() @ qb.float().t()
    return acc * sa.float()[:, None] * sb.float()[None, :]


_NO_FP8_GEMM: list[str] = []  # why torch._scaled_mm refused, once: the references then sum in fp32


def _rowwise_product(a: torch.Tensor, b_t: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b_t^T`` with both operands quantized per row along the GEMM's K (e4m3)."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b_t)
    return fp8_product(qa, sa, qb, sb, fast_accum=fast_accum)


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w^T with every GEMM of forward and backward on row-wise fp8
    operands (quantized along that GEMM's K), fp32 accumulate; y in fp32.
    ``x_on_grid``: x is already fp8 (an epilogue stored it), read as it is;
    ``x_scale``, where known, is its per-row dequantization scale (the
    forward GEMM then runs on the fp8 tensor cores of a GPU: :func:`fp8_product`)."""

    @staticmethod
    def forward(ctx, x, w, x_on_grid, x_scale):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        if not x_on_grid:
            return _rowwise_product(x, w, fast_accum=True)
        qw, sw = quantize_rows(w)
        if x_scale is None:
            return x @ (qw * sw[:, None]).t()
        return fp8_product(x / x_scale[:, None], x_scale, qw, sw, fast_accum=True)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        dx = _rowwise_product(dy, w.t())
        dw = _rowwise_product(dy.t(), x.t())
        return dx.to(x.dtype), dw.to(w.dtype), None, None


def linear(x: torch.Tensor, w: torch.Tensor, lowp: bool, x_on_grid: bool = False,
           x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T``: exact in the upcast run, the fp8 recipe (fp32 result) in the low run."""
    if not lowp:
        return x @ w.t()
    return _Fp8Linear.apply(x.float(), w.float(), x_on_grid, None if x_scale is None else x_scale.float())


class _DelayedQuant(torch.autograd.Function):
    """v after the epilogue's fp8 store with a known per-row dequantization
    scale: ``sat(v / scale) * scale``; straight-through backward."""

    @staticmethod
    def forward(ctx, v, scale):  # noqa: ANN001, ANN205
        return saturate(v / scale[:, None], E4M3) * scale[:, None]

    @staticmethod
    def backward(ctx, dv):  # noqa: ANN001, ANN205
        return dv, None


def _hi(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64; fp8 becomes fp32, exactly)."""
    return x.float() if x.dtype in FP8 else x.to(torch.promote_types(x.dtype, torch.float32))


def _rms_norm(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    hf = _hi(h)
    return hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma


def _out(x: torch.Tensor, lowp: bool) -> torch.Tensor:
    """An activation output: rounded to bf16 in the low run (the kernel's store)."""
    return x.to(torch.bfloat16) if lowp else x


# --------------------------------------------------------------------------- single GEMMs


def _scaled_gemm(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor,
                 fast_accum: bool) -> torch.Tensor:
    """(a @ b_t^T) * sa[:, None] * sb[None, :], in fp32 (fp64 in the upcast run; the low run,
    on fp8 a and b_t, is :func:`fp8_product`)."""
    if a.dtype in FP8 and b_t.dtype in FP8:
        return fp8_product(a, sa, b_t, sb, a.dtype, b_t.dtype, fast_accum=fast_accum)
    work = torch.promote_types(_hi(a).dtype, _hi(sa).dtype)
    acc = a.to(work) @ b_t.to(work).t()
    return acc * sa.to(work)[:, None] * sb.to(work)[None, :]


def swiglu_fwd_fp8(x, x_scale, w_gu, w_scale):
    """pre = (x @ w_gu^T) * x_scale[:, None] * w_scale[None, :] with x (T, H) and
    w_gu (2I, H) in fp8 e4m3 (w_gu's rows interleaved [g0, u0, g1, u1, ...]);
    y = silu(g) * u with g = pre[:, 0::2], u = pre[:, 1::2]."""
    lowp = low_precision_run(x)
    pre = _out(_scaled_gemm(x, x_scale, w_gu, w_scale, fast_accum=True), lowp)
    g, u = pre[:, 0::2], pre[:, 1::2]
    return {"y": _out(F.silu(g) * u, lowp), "pre": pre}


def swiglu_bwd_fp8(dout, dout_scale, w_down, w_scale, pre):
    """dact = (dout @ w_down^T) * dout_scale[:, None] * w_scale[None, :] with dout
    (T, H) in fp8 e5m2 (a gradient: e5m2's range) and w_down (I, H) in e4m3 (the
    down projection's weight in its input-gradient layout, one scale per row);
    then the SwiGLU backward of tasks/llama3 swiglu_bwd: dpre interleaves
    dg = dact * u * silu'(g) and du = dact * silu(g); postact = silu(g) * u;
    s = sum over columns of dpre * pre per row."""
    return dswiglu(_scaled_gemm(dout, dout_scale, w_down, w_scale, fast_accum=False), pre)


# --------------------------------------------------------------------------- blocks


def mlp_block_fp8(h, gamma, w_gu, w_down, eps):
    """y = h + W_down(silu(g) * u), (g, u) = RMSNorm(h, gamma) @ W_gu^T (rows
    interleaved), every GEMM of forward and backward in fp8 e4m3 with current
    row-wise scales (torchao's rowwise recipe; see the module docstring)."""
    lowp = low_precision_run(h)
    x = _rms_norm(h, gamma, eps)
    x = _out(x, lowp)
    pre = linear(x, w_gu, lowp)
    act = F.silu(pre[:, 0::2]) * pre[:, 1::2]
    act = _out(act, lowp)
    return {"y": _out(_hi(h) + linear(act, w_down, lowp), lowp)}


def llama3_block_fp8(attn, h, w_o, gamma_mlp, w_gu, w_down, gamma_attn, w_qkv, hg1_scale,
                     hg2_scale, eps):
    """The non-attention part of a LLaMA-3 layer (tasks/llama3 llama3_block) with
    every GEMM in fp8 e4m3:

        h1  = h + attn @ w_o^T
        h2  = h1 + W_down(silu(g) * u),  (g, u) = RMSNorm(h1, gamma_mlp) @ W_gu^T
        qkv = RMSNorm(h2, gamma_attn) @ w_qkv^T

    The two RMSNorm inputs of the GEMMs, h1 * gamma_mlp and h2 * gamma_attn, are
    written in fp8 by the epilogues that produce h1 and h2, quantized with the
    given per-row dequantization scales (``hg1_scale``, ``hg2_scale``: delayed
    scales);
    every other GEMM operand gets current row-wise scales (module docstring).
    (The epilogues also reduce the row amax of both for the next step's scales:
    :func:`hg_amax` is that statistic; not a task output, since an output would
    receive a gradient.)"""
    lowp = low_precision_run(h)
    dim = h.shape[1]
    h1 = _out(_hi(h) + linear(attn, w_o, lowp), lowp)
    hg1 = _hi(h1) * gamma_mlp
    r1 = torch.rsqrt(_hi(h1).pow(2).sum(-1, keepdim=True) / dim + eps)
    hg1_q = _DelayedQuant.apply(hg1, hg1_scale.float()) if lowp else hg1
    # r1 goes into the GEMM's input, not after it (r2 too): the weight gradient's per-feature
    # copy of that input spans every token, and RMSNorm(h1) keeps each token's bits in it where
    # h1 * gamma would let the tokens of large norm set the scale and round those of tiny norm
    # (large r1) to zero.  Per row the two are the same GEMM: the dequantization scale takes r1.
    pre = linear(hg1_q * r1, w_gu, lowp, x_on_grid=True, x_scale=hg1_scale * r1[:, 0])
    act = _out(F.silu(pre[:, 0::2]) * pre[:, 1::2], lowp)
    h2 = _out(_hi(h1) + linear(act, w_down, lowp), lowp)
    hg2 = _hi(h2) * gamma_attn
    r2 = torch.rsqrt(_hi(h2).pow(2).sum(-1, keepdim=True) / dim + eps)
    hg2_q = _DelayedQuant.apply(hg2, hg2_scale.float()) if lowp else hg2
    qkv = _out(linear(hg2_q * r2, w_qkv, lowp, x_on_grid=True, x_scale=hg2_scale * r2[:, 0]), lowp)
    return {"h_out": h2, "qkv": qkv}


def hg_amax(h: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Row amax of h * gamma: what the llama3_block_fp8 epilogues reduce for the
    delayed scales of the next step."""
    return (_hi(h) * gamma).abs().amax(dim=-1)
