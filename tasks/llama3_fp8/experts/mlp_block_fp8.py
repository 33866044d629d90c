"""The MLP sub-block of mlp_block, forward and backward, with all six GEMMs on
fp8 operands (current row-wise scales, e4m3: torchao's rowwise recipe).

The epilogues are mlp_block's (SwiGLU pairs, the residual, dSwiGLU reducing s,
the RMSNorm backward), each first multiplying the fp32 accumulator by its
operands' dequantization scales: A's per row (a ColVec), B's per output column
(a RowVec).

RMSNorm's r stays inside the quantized tensors, not outside the GEMMs as in
mlp_block: the entry norm's output is quantized as ``h * gamma`` times ``r``
(``quantize_both``'s ``row_scale``), and dSwiGLU stores d(pre) without it.  A
per-token copy would not care (its scale takes any per-token factor), but a
weight gradient's per-feature copy has one scale over all the tokens: with r
left out of x (and moved into d(pre)), the tokens of large norm set each
feature's scale of x, and a token of tiny norm rounds to zero there although,
times its large r, it weighs in dw_gu as much as any other.

What no epilogue can write in fp8 is quantized by ``quantize_rows`` or
``quantize_both``: the entry norm's output (no GEMM produces it), SwiGLU's
silu(g) * u and dSwiGLU's d(pre) (paired stores are 16-bit on SM90), the
incoming gradient, and the weights (once per layout: along K of the forward and
of the input gradient).  The weight gradients contract over the tokens, so
their operands are quantized per feature, into K-major transposed copies.
What two GEMMs read along different axes is quantized both ways in one call
from two reads: RMSNorm(h) and silu(g) * u in the forward (its GEMM's copy per
token, and the weight gradient's per feature, which the backward keeps in
place of the bf16 tensor: half the bytes), dy and d(pre) in the backward.
The forward GEMMs use fast accumulation, the gradient GEMMs promote to fp32
(torchao's choice).

Memory: d(pre) is written over the saved pre-activation it is computed from
(``gemm(..., out=pre)``), and every temporary is dropped (``del``) once its
last reader has run: beside the saved tensors and the gradients, the backward
holds d(pre)'s two fp8 copies and one GEMM's operands at a time.

Frozen weights (LoRA, a frozen base: ``needs`` lacks their gradients) skip
their gradient GEMMs, and a gradient no weight-gradient GEMM reads is
quantized per token only (``quantize_rows``: the same bits as
``quantize_both``'s ``q``, from half its traffic).
"""

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, epilogue, gemm,
                                   pack, quantize_both, quantize_rows, rms_prepare, row_sum, sigmoid, unpack)


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def norm_swiglu(acc, a_scale: ColVec, w_scale: RowVec):
    g, u = unpack(acc * a_scale * w_scale)
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


@epilogue()
def add_residual(acc, a_scale: ColVec, w_scale: RowVec, residual: Tile):
    return {"D": acc * a_scale * w_scale + residual}


@epilogue(reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile, a_scale: ColVec, w_scale: RowVec):
    dact = acc * a_scale * w_scale
    g, u = unpack(pre)
    sg = sigmoid(g)
    dg = dact * u * sg * (1.0 + g * (1.0 - sg))
    du = dact * g * sg
    return {"D": pack(dg, du), "s": g * dg + u * du}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd(acc, a_scale: ColVec, w_scale: RowVec, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile,
                dy: Tile, inv_dim: Scalar):
    # d = r * (d(pre) @ W_gu), the gradient at h * gamma: the A operand is d(pre), r is applied here.
    d = acc * a_scale * w_scale * rstd
    hr = h * rstd
    return {"D": dy + gamma * d - hr * rstd * s * inv_dim, "dgamma": d * h}


@epilogue()
def dequantize(acc, a_scale: ColVec, b_scale: RowVec):
    return {"D": acc * a_scale * b_scale}


def forward(h, gamma, w_gu, w_down, eps):
    prep = rms_prepare(h, gamma, eps)
    rstd = prep["rstd"]
    x = quantize_both(prep["xg"], row_scale=rstd)  # RMSNorm(h), both ways
    del prep
    wgu = quantize_rows(w_gu)
    gu = gemm(x["q"], wgu["q"].t(), norm_swiglu, a_scale=x["scale"], w_scale=wgu["scale"], fast_accum=True)
    x_t, x_t_scale = x["qt"], x["scale_t"]  # RMSNorm(h) per feature, for dw_gu
    del x, wgu
    pre = gu["D"]
    act = quantize_both(gu["act"])
    del gu  # the (T, I) bf16 silu(g) * u: its fp8 copies replace it
    wd = quantize_rows(w_down)
    y = gemm(act["q"], wd["q"].t(), add_residual, a_scale=act["scale"], w_scale=wd["scale"], residual=h,
             fast_accum=True)["D"]
    return {"y": y, "pre": pre, "act_t": act["qt"], "act_t_scale": act["scale_t"], "x_t": x_t,
            "x_t_scale": x_t_scale, "rstd": rstd}


def _quantize(x, both):
    """x per token, and per feature too (``qt``, ``scale_t``) where a weight gradient reads it."""
    return quantize_both(x) if both else quantize_rows(x)


def backward(saved, dy, needs):
    h, gamma, w_gu, w_down, rstd = saved["h"], saved["gamma"], saved["w_gu"], saved["w_down"], saved["rstd"]
    grads = {}
    g = _quantize(dy, "dw_down" in needs)
    if "dw_down" in needs:
        grads["dw_down"] = gemm(g["qt"], saved["act_t"].t(), dequantize, a_scale=g["scale_t"],
                                b_scale=saved["act_t_scale"])["D"]
    if not needs & {"dh", "dgamma", "dw_gu"}:
        return grads
    wd_t = quantize_rows(w_down.t())  # (I, H): K = H for the input gradient
    # d(pre) overwrites the saved pre-activation it is computed from: the two never coexist.
    da = gemm(g["q"], wd_t["q"].t(), dswiglu, pre=saved["pre"], a_scale=g["scale"], w_scale=wd_t["scale"],
              out=saved["pre"])
    del g, wd_t
    s = da["s"]
    dp = _quantize(da["D"], "dw_gu" in needs)
    del da
    if "dh" in needs or "dgamma" in needs:
        wgu_t = quantize_rows(w_gu.t())  # (H, 2I)
        d = gemm(dp["q"], wgu_t["q"].t(), rmsnorm_bwd, a_scale=dp["scale"], w_scale=wgu_t["scale"], rstd=rstd,
                 s=s, gamma=gamma, h=h, dy=dy, inv_dim=1.0 / h.shape[1])
        grads["dh"], grads["dgamma"] = d["D"], d["dgamma"]
        del wgu_t
    # The weight gradient contracts over the tokens: each operand's per-feature copy.
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dp["qt"], saved["x_t"].t(), dequantize, a_scale=dp["scale_t"],
                              b_scale=saved["x_t_scale"])["D"]
    return grads
