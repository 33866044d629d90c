"""The non-attention part of a LLaMA-3 layer (out-proj + residual, RMSNorm,
SwiGLU MLP + residual, the next layer's RMSNorm + QKV projection), forward and
backward, as GEMMs with epilogues plus O(T) aux kernels.

Every RMSNorm sits between two GEMMs: the producing GEMM's epilogue adds the
residual, stores the new stream h and h * gamma, and reduces sum(h^2) per row;
rms_rstd finishes r; the consuming GEMM multiplies its accumulator by r.
Backward, the RMSNorm gradient rides in the epilogue of the GEMM that produces
d = d(out) @ W:  dh = dy + r * (gamma * d - h * r * s / H)  with
s = sum_cols(d(out) * out) = r * sum_cols(gamma * d * h).
"""

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, epilogue,
                                   gemm, pack, rms_rstd, row_sum, sigmoid, unpack)


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


@epilogue(reductions={"t": col_sum()})
def norm_stat(acc, gamma: RowVec, h: Tile):
    # t = sum(gamma * d * h): the RMSNorm-backward statistic, no D stored.
    return {"t": acc * gamma * h}


@epilogue(outputs={"xn": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_bwd_t(acc, rstd: ColVec, t: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    hr = h * rstd
    return {"D": dy + rstd * (gamma * acc - hr * rstd * t * inv_dim),
            "xn": hr * gamma,
            "dgamma": acc * hr}


@epilogue(outputs={"act": "bf16"}, reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile):
    g, u = unpack(pre)
    sg = sigmoid(g)
    silu_g = g * sg
    dg = acc * u * sg * (1.0 + g * (1.0 - sg))
    du = acc * silu_g
    return {"D": pack(dg, du), "act": silu_g * u, "s": g * dg + u * du}


@epilogue(outputs={"xn": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_bwd_s(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    hr = h * rstd
    return {"D": dy + rstd * (gamma * acc - hr * s * inv_dim),
            "xn": hr * gamma,
            "dgamma": acc * hr}


def forward(attn, h, w_o, gamma_mlp, w_gu, w_down, gamma_attn, w_qkv, eps):
    dim = h.shape[1]
    a = gemm(attn, w_o.t(), residual_norm_stats, residual=h, gamma=gamma_mlp)
    r1 = rms_rstd(a["sumsq"], dim, eps)
    gu = gemm(a["hg"], w_gu.t(), norm_swiglu, rstd=r1)
    c = gemm(gu["act"], w_down.t(), residual_norm_stats, residual=a["D"], gamma=gamma_attn)
    r2 = rms_rstd(c["sumsq"], dim, eps)
    qkv = gemm(c["hg"], w_qkv.t(), scale_rows, rstd=r2)["D"]
    return {"h_out": c["D"], "qkv": qkv, "h1": a["D"], "r1": r1, "pre": gu["D"], "r2": r2}


def backward(saved, dh_out, dqkv):
    inv_dim = 1.0 / saved["h"].shape[1]
    h1, h2 = saved["h1"], saved["h_out"]
    w_qkv, w_gu, w_down, w_o = saved["w_qkv"], saved["w_gu"], saved["w_down"], saved["w_o"]
    g_attn, g_mlp = saved["gamma_attn"], saved["gamma_mlp"]
    # Next layer's RMSNorm + QKV: the statistic first (no D), then the gradient.
    t2 = gemm(dqkv, w_qkv, norm_stat, gamma=g_attn, h=h2)["t"]
    d2 = gemm(dqkv, w_qkv, rmsnorm_bwd_t, rstd=saved["r2"], t=t2, gamma=g_attn, h=h2, dy=dh_out,
              inv_dim=inv_dim)
    dh2 = d2["D"]
    dw_qkv = gemm(dqkv.t(), d2["xn"])["D"]
    # SwiGLU MLP + its RMSNorm (+ the residual gradient dh2).
    da = gemm(dh2, w_down, dswiglu, pre=saved["pre"])
    d1 = gemm(da["D"], w_gu, rmsnorm_bwd_s, rstd=saved["r1"], s=da["s"], gamma=g_mlp, h=h1, dy=dh2,
              inv_dim=inv_dim)
    dh1 = d1["D"]
    dw_gu = gemm(da["D"].t(), d1["xn"])["D"]
    dw_down = gemm(dh2.t(), da["act"])["D"]
    # Out-projection + residual.
    dattn = gemm(dh1, w_o)["D"]
    dw_o = gemm(dh1.t(), saved["attn"])["D"]
    return {"dattn": dattn, "dh": dh1, "dw_o": dw_o, "dgamma_mlp": d1["dgamma"], "dw_gu": dw_gu,
            "dw_down": dw_down, "dgamma_attn": d2["dgamma"], "dw_qkv": dw_qkv}
