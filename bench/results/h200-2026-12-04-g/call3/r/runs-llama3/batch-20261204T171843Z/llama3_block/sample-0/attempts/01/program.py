"""The non-attention part of a LLaMA-3 layer (out-proj + residual, RMSNorm,
SwiGLU MLP + residual, the next layer's RMSNorm + QKV projection), forward and
backward, as GEMMs with epilogues plus O(T) aux kernels.

Every RMSNorm sits between two GEMMs: the producing GEMM's epilogue adds the
residual, stores the new stream h and h * gamma, and reduces sum(h^2) per row;
rms_rstd finishes r; the consuming GEMM multiplies its accumulator by r.
Backward, the RMSNorm gradient rides in the epilogue of the GEMM that produces
d = d(out) @ W:  dh = dy + r * (gamma * d - h * r * s / H)  with
s = sum_cols(d(out) * out) = r * sum_cols(gamma * d * h).  On the MLP side s is
reduced by the dSwiGLU epilogue; on the QKV side d(out) is an input, so s comes
from a row_dot pass over dqkv and the saved qkv (``tile_pass``: one read of
each, no GEMM), not from a second full dqkv @ W_qkv.

Between forward and backward only h1, the pre-activation (g, u), the two inverse
RMS vectors and the outputs are kept (beside the inputs): the least the
backward needs.  The GEMM inputs the MLP's weight gradients want are not kept:
the dSwiGLU epilogue holds (g, u) and writes silu(g) * u again (``act``, for
dW_down), and dW_gu = (r1 * d(pre))^T @ (h1 * gamma_mlp) = ((r1 * d(pre))^T @
h1) * gamma_mlp scales its output columns in the epilogue, so h1 * gamma_mlp
is never needed again.  dSwiGLU stores r1 * d(pre), so d(pre) @ W_gu's
accumulator is r1 * d; it is written over the saved pre-activation it is
computed from (``gemm(..., out=pre)``), so the backward never holds both
(T, 2I) tensors, and each temporary is dropped once its last GEMM has read it.

Frozen weights (LoRA, a frozen base: ``needs`` lacks their gradients) skip
their gradient GEMMs, and the epilogues skip the stores only those GEMMs read
(xn for dW_qkv, act for dW_down); a frozen attention output skips dattn's GEMM.
"""

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, epilogue,
                                   gemm, pack, rms_rstd, row_sum, sigmoid, tile_pass, unpack)


@epilogue(outputs={"hg": "bf16"}, reductions={"sumsq": col_sum()})
def residual_norm_stats(acc, residual: Tile, gamma: RowVec):
    h = acc + residual
    return {"D": h, "hg": h * gamma, "sumsq": h * h}


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def norm_swiglu(acc, rstd: ColVec):
    g, u = unpack(acc)
    g = g * rstd
    u = u * rstd
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


@epilogue(reductions={"s": col_sum()})
def row_dot(du: Tile, u: Tile):
    # s = sum_cols(du * u): the RMSNorm-backward statistic of the QKV side, read
    # from the incoming dqkv and the saved qkv (no GEMM produces either here).
    return {"s": du * u}


@epilogue(outputs={"xn": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_bwd(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    hr = h * rstd
    return {"D": dy + rstd * (gamma * acc - hr * s * inv_dim),
            "xn": hr * gamma,
            "dgamma": acc * hr}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd_frozen(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    # rmsnorm_bwd without xn, which only W_qkv's gradient reads.
    hr = h * rstd
    return {"D": dy + rstd * (gamma * acc - hr * s * inv_dim), "dgamma": acc * hr}


def swiglu_grads(acc, pre):
    """(silu(g), dg, du, g, u) of the dSwiGLU epilogues: acc is d(silu(g) * u)."""
    g, u = unpack(pre)
    sg = sigmoid(g)
    silu_g = g * sg
    return silu_g, acc * u * sg * (1.0 + g * (1.0 - sg)), acc * silu_g, g, u


@epilogue(outputs={"act": "bf16"}, reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile, rstd: ColVec):
    # Stores r1 * d(pre), so the next GEMM's accumulator is r1 * d, and writes
    # silu(g) * u (dW_down's operand) from the (g, u) it reads anyway.
    silu_g, dg, du, g, u = swiglu_grads(acc, pre)
    return {"D": pack(dg * rstd, du * rstd), "act": silu_g * u, "s": g * dg + u * du}


@epilogue(reductions={"s": col_sum()})
def dswiglu_frozen(acc, pre: PairedTile, rstd: ColVec):
    # dswiglu without act, which only W_down's gradient reads.
    silu_g, dg, du, g, u = swiglu_grads(acc, pre)
    return {"D": pack(dg * rstd, du * rstd), "s": g * dg + u * du}


@epilogue()
def scale_cols(acc, gamma: RowVec):
    return {"D": acc * gamma}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd_scaled(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    # acc = r * d (the A operand was r * d(out)): dh = dy + gamma * acc - h * r^2 * s / H.
    hr = h * rstd
    return {"D": dy + gamma * acc - hr * rstd * s * inv_dim,
            "dgamma": acc * h}


def forward(attn, h, w_o, gamma_mlp, w_gu, w_down, gamma_attn, w_qkv, eps):
    dim = h.shape[1]
    a = gemm(attn, w_o.t(), residual_norm_stats, residual=h, gamma=gamma_mlp)
    r1 = rms_rstd(a["sumsq"], dim, eps)
    gu = gemm(a["hg"], w_gu.t(), norm_swiglu, rstd=r1)
    c = gemm(gu["act"], w_down.t(), residual_norm_stats, residual=a["D"], gamma=gamma_attn)
    r2 = rms_rstd(c["sumsq"], dim, eps)
    qkv = gemm(c["hg"], w_qkv.t(), scale_rows, rstd=r2)["D"]
    return {"h_out": c["D"], "qkv": qkv, "h1": a["D"], "r1": r1, "pre": gu["D"], "r2": r2}


def backward(saved, dh_out, dqkv, needs):
    inv_dim = 1.0 / saved["h"].shape[1]
    h1, h2 = saved["h1"], saved["h_out"]
    w_qkv, w_gu, w_down, w_o = saved["w_qkv"], saved["w_gu"], saved["w_down"], saved["w_o"]
    g_attn, g_mlp = saved["gamma_attn"], saved["gamma_mlp"]
    grads = {}
    # Next layer's RMSNorm + QKV: s2 = sum(dqkv * qkv) per row (CODA's statistic,
    # from the saved output), then the gradient GEMM finishes the RMSNorm backward.
    s2 = tile_pass(row_dot, du=dqkv, u=saved["qkv"])["s"]
    d2 = gemm(dqkv, w_qkv, rmsnorm_bwd if "dw_qkv" in needs else rmsnorm_bwd_frozen, rstd=saved["r2"], s=s2,
              gamma=g_attn, h=h2, dy=dh_out, inv_dim=inv_dim)
    dh2, grads["dgamma_attn"] = d2["D"], d2["dgamma"]
    if "dw_qkv" in needs:
        grads["dw_qkv"] = gemm(dqkv.t(), d2["xn"])["D"]
    del d2  # xn, before the MLP's GEMMs allocate
    # SwiGLU MLP + its RMSNorm (+ the residual gradient dh2).
    # d(pre) overwrites the saved pre-activation it is computed from: the two never coexist.
    da = gemm(dh2, w_down, dswiglu if "dw_down" in needs else dswiglu_frozen, pre=saved["pre"],
              rstd=saved["r1"], out=saved["pre"])
    dpre, s1 = da["D"], da["s"]
    if "dw_down" in needs:
        grads["dw_down"] = gemm(dh2.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    d1 = gemm(dpre, w_gu, rmsnorm_bwd_scaled, rstd=saved["r1"], s=s1, gamma=g_mlp, h=h1, dy=dh2,
              inv_dim=inv_dim)
    dh1 = grads["dh"] = d1["D"]
    grads["dgamma_mlp"] = d1["dgamma"]
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dpre.t(), h1, scale_cols, gamma=g_mlp)["D"]
    # Out-projection + residual.
    if "dattn" in needs:
        grads["dattn"] = gemm(dh1, w_o)["D"]
    if "dw_o" in needs:
        grads["dw_o"] = gemm(dh1.t(), saved["attn"])["D"]
    return grads
