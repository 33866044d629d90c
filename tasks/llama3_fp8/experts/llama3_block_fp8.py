"""The non-attention part of a LLaMA-3 layer (llama3_block), forward and
backward, with all twelve GEMMs of the math on fp8 operands.

Where the epilogue pays: the two RMSNorm inputs of the GEMMs, h1 * gamma_mlp
and h2 * gamma_attn, leave the epilogues that produce h1 and h2 in fp8, so the
gate/up and QKV GEMMs read them without a cast pass.  Their row-wise *current*
scale would need the row's amax over every N tile, so they are quantized with
a delayed per-row dequantization scale (``hg1_scale``, ``hg2_scale``: known
before the GEMM), ``q = sat(h * gamma / scale)``, and the consumer multiplies
by ``scale`` times RMSNorm's r (both per row, both commute with the GEMM:
``x1_scale``, one vector_pass).  The same epilogues reduce the row amax of
h * gamma (``col_max``) for the next step's delayed scales.

RMSNorm's r stays with the GEMMs' input, as in mlp_block_fp8: the gate/up
weight gradient reads the normalized input per feature,
``quantize_rows(hg1.t(), col_scale=x1_scale)``, and d(pre) without r (the
RMSNorm backward's epilogue applies it), as the QKV side reads xn and dqkv.  A
per-feature scale spans every token: with r moved into d(pre) instead, the
tokens of large norm would set each feature's scale of h1 * gamma and round
those of tiny norm to zero, although times their large r they weigh as much.

Everything else as in mlp_block_fp8: current row-wise scales from
``quantize_rows`` for the attention output and the weights (once per layout),
and from ``quantize_both`` for what an input-gradient GEMM and a weight-gradient
GEMM both read (the four gradients; SwiGLU's output, whose per-feature copy the
backward keeps in place of the bf16 tensor); fast accumulation in the forward
GEMMs only.  The QKV-side statistic s2 = sum(dqkv * qkv) is reduced by a tile
pass over both, as in llama3_block.

Memory as in mlp_block_fp8: d(pre) over the saved pre-activation, each
temporary dropped once its last reader has run.

Frozen weights (``needs`` lacks their gradients) skip their gradient GEMMs, the
xn store only W_qkv's gradient reads, and the per-feature copy of each
gradient that only a frozen weight's gradient would read (``quantize_rows``
instead of ``quantize_both``: the same per-token bits).
"""

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_max, col_sum, epilogue,
                                   gemm, maximum, pack, quantize_both, quantize_rows, reciprocal, rms_rstd,
                                   row_sum, sigmoid, tile_pass, unpack, vector_pass)


@epilogue(outputs={"hg": "fp8_e4m3"}, reductions={"sumsq": col_sum(), "amax": col_max()})
def residual_norm_stats(acc, a_scale: ColVec, w_scale: RowVec, residual: Tile, gamma: RowVec,
                        hg_scale: ColVec):
    h = acc * a_scale * w_scale + residual
    hg = h * gamma
    return {"D": h, "hg": hg * reciprocal(hg_scale), "sumsq": h * h, "amax": maximum(hg, -hg)}


@epilogue()
def times(a: ColVec, b: ColVec):
    return {"D": a * b}


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def norm_swiglu(acc, w_scale: RowVec, x_scale: ColVec):
    g, u = unpack(acc * x_scale * w_scale)
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


@epilogue()
def norm_rows(acc, w_scale: RowVec, rstd: ColVec, hg_scale: ColVec):
    return {"D": acc * (rstd * hg_scale) * w_scale}


@epilogue(reductions={"s": col_sum()})
def row_dot(du: Tile, u: Tile):
    # s = sum_cols(du * u) from the incoming dqkv and the saved qkv
    return {"s": du * u}


@epilogue(outputs={"xn": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_bwd(acc, a_scale: ColVec, w_scale: RowVec, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile,
                dy: Tile, inv_dim: Scalar):
    d = acc * a_scale * w_scale
    hr = h * rstd
    return {"D": dy + rstd * (gamma * d - hr * s * inv_dim), "xn": hr * gamma, "dgamma": d * hr}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd_frozen(acc, a_scale: ColVec, w_scale: RowVec, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile,
                       dy: Tile, inv_dim: Scalar):
    # rmsnorm_bwd without xn, which only W_qkv's gradient reads.
    d = acc * a_scale * w_scale
    hr = h * rstd
    return {"D": dy + rstd * (gamma * d - hr * s * inv_dim), "dgamma": d * hr}


@epilogue(reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile, a_scale: ColVec, w_scale: RowVec):
    dact = acc * a_scale * w_scale
    g, u = unpack(pre)
    sg = sigmoid(g)
    dg = dact * u * sg * (1.0 + g * (1.0 - sg))
    du = dact * g * sg
    return {"D": pack(dg, du), "s": g * dg + u * du}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd_r(acc, a_scale: ColVec, w_scale: RowVec, rstd: ColVec, s: ColVec, gamma: RowVec,
                  h: Tile, dy: Tile, inv_dim: Scalar):
    # d = r * (d(pre) @ W_gu), the gradient at h * gamma: the A operand is d(pre), r is applied here.
    d = acc * a_scale * w_scale * rstd
    hr = h * rstd
    return {"D": dy + gamma * d - hr * rstd * s * inv_dim, "dgamma": d * h}


@epilogue()
def dequantize(acc, a_scale: ColVec, w_scale: RowVec):
    return {"D": acc * a_scale * w_scale}


def _per_feature(x, col_scale=None):
    """x quantized per feature along the tokens, named as quantize_both names that copy."""
    q = quantize_rows(x.t(), col_scale=col_scale)
    return {"qt": q["q"], "scale_t": q["scale"]}


def _weight_grad(grad, x):
    """dW = grad^T @ x from both operands' per-feature copies (``qt``, ``scale_t``)."""
    return gemm(grad["qt"], x["qt"].t(), dequantize, a_scale=grad["scale_t"], w_scale=x["scale_t"])["D"]


def _input_grad(grad, weight, epi, out=None, **operands):
    """grad @ weight (stored (out, in)): grad's per-token copy, the weight per input feature."""
    b = quantize_rows(weight.t())
    return gemm(grad["q"], b["q"].t(), epi, a_scale=grad["scale"], w_scale=b["scale"], out=out, **operands)


def forward(attn, h, w_o, gamma_mlp, w_gu, w_down, gamma_attn, w_qkv, hg1_scale, hg2_scale, eps):
    dim = h.shape[1]
    x, wo = quantize_rows(attn), quantize_rows(w_o)
    a = gemm(x["q"], wo["q"].t(), residual_norm_stats, a_scale=x["scale"], w_scale=wo["scale"], residual=h,
             gamma=gamma_mlp, hg_scale=hg1_scale, fast_accum=True)
    del x, wo
    r1 = rms_rstd(a["sumsq"], dim, eps)
    x1_scale = vector_pass(times, a=r1, b=hg1_scale)["D"]  # RMSNorm(h1) = hg1 * x1_scale per row
    wgu = quantize_rows(w_gu)
    gu = gemm(a["hg"], wgu["q"].t(), norm_swiglu, w_scale=wgu["scale"], x_scale=x1_scale, fast_accum=True)
    del wgu
    pre = gu["D"]
    act = quantize_both(gu["act"])
    del gu  # the (T, I) bf16 silu(g) * u: its fp8 copies replace it
    wd = quantize_rows(w_down)
    c = gemm(act["q"], wd["q"].t(), residual_norm_stats, a_scale=act["scale"], w_scale=wd["scale"],
             residual=a["D"], gamma=gamma_attn, hg_scale=hg2_scale, fast_accum=True)
    del wd
    r2 = rms_rstd(c["sumsq"], dim, eps)
    wqkv = quantize_rows(w_qkv)
    qkv = gemm(c["hg"], wqkv["q"].t(), norm_rows, w_scale=wqkv["scale"], rstd=r2, hg_scale=hg2_scale,
               fast_accum=True)["D"]
    # Kept for backward: h1, the fp8 gate/up operand, SwiGLU's output (its per-feature fp8 copy),
    # and the row amax of both fp8 epilogue outputs (the next step's delayed scales).
    return {"h_out": c["D"], "qkv": qkv, "h1": a["D"], "hg1": a["hg"], "r1": r1, "x1_scale": x1_scale, "pre": pre,
            "act_t": act["qt"], "act_t_scale": act["scale_t"], "r2": r2, "hg1_amax": a["amax"],
            "hg2_amax": c["amax"]}


def _quantize(x, both):
    """x per token, and per feature too (``qt``, ``scale_t``) where a weight gradient reads it."""
    return quantize_both(x) if both else quantize_rows(x)


def backward(saved, dh_out, dqkv, needs):
    inv_dim = 1.0 / saved["h"].shape[1]
    h1, h2 = saved["h1"], saved["h_out"]
    grads = {}
    # Next layer's RMSNorm + QKV: s2 from the saved output, then the input gradient.
    s2 = tile_pass(row_dot, du=dqkv, u=saved["qkv"])["s"]
    g_qkv = _quantize(dqkv, "dw_qkv" in needs)
    d2 = _input_grad(g_qkv, saved["w_qkv"], rmsnorm_bwd if "dw_qkv" in needs else rmsnorm_bwd_frozen,
                     rstd=saved["r2"], s=s2, gamma=saved["gamma_attn"], h=h2, dy=dh_out, inv_dim=inv_dim)
    grads["dgamma_attn"], dh2 = d2["dgamma"], d2["D"]
    g2 = _quantize(dh2, "dw_down" in needs)
    if "dw_qkv" in needs:
        grads["dw_qkv"] = _weight_grad(g_qkv, _per_feature(d2["xn"]))
    del g_qkv, d2
    # SwiGLU MLP + its RMSNorm (+ the residual gradient dh2).  d(pre) overwrites the saved
    # pre-activation it is computed from: the two never coexist.
    da = _input_grad(g2, saved["w_down"], dswiglu, out=saved["pre"], pre=saved["pre"])
    if "dw_down" in needs:
        grads["dw_down"] = _weight_grad(g2, {"qt": saved["act_t"], "scale_t": saved["act_t_scale"]})
    del g2
    s1 = da["s"]
    dp = _quantize(da["D"], "dw_gu" in needs)
    del da
    d1 = _input_grad(dp, saved["w_gu"], rmsnorm_bwd_r, rstd=saved["r1"], s=s1, gamma=saved["gamma_mlp"],
                     h=h1, dy=dh2, inv_dim=inv_dim)
    grads["dh"], grads["dgamma_mlp"] = d1["D"], d1["dgamma"]
    del dh2
    if "dw_gu" in needs:
        grads["dw_gu"] = _weight_grad(dp, _per_feature(saved["hg1"], col_scale=saved["x1_scale"]))
    del dp
    # Out-projection + residual.
    if needs & {"dattn", "dw_o"}:
        g1 = _quantize(d1["D"], "dw_o" in needs)  # dh1
        if "dattn" in needs:
            grads["dattn"] = _input_grad(g1, saved["w_o"], dequantize)["D"]
        if "dw_o" in needs:
            grads["dw_o"] = _weight_grad(g1, _per_feature(saved["attn"]))
    return grads
