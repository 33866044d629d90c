"""The non-attention part of a pre-LN GPT-2 layer (out-proj + bias + residual,
LayerNorm, exact-GELU MLP + residual, the next layer's LayerNorm + QKV
projection), forward and backward, as GEMMs with epilogues plus O(T) aux
kernels.

Every LayerNorm sits between two GEMMs.  The producing GEMM's epilogue adds
bias and residual, stores the new stream and reduces sum(h) and sum(h^2) per
row; layernorm_stats finishes mean and rstd; the consuming GEMM reads the
stored stream against its weight scaled by gamma (layernorm_fold, once per
call) and finishes the rank-1 form rstd * (acc - mean * gw) + c, so no
normalized activation is written in the forward.

Backward, each LayerNorm's gradient rides in the epilogue of the GEMM that
produces g = d(out) @ w: dh = dy + rstd * gamma * g + p * h + q, with p, q per
row from the two statistics s1 = d(out) . gw, s2 = d(out) . (out - c)
(vector_pass, once per row), writing LN(h) for the weight gradient.  On the MLP
side the dGELU epilogue reduces s1 and s2 (and b_fc's gradient); on the QKV
side d(qkv) is an input (the attention backward's epilogue would host it), so
one tile pass over dqkv and the saved qkv reduces them and b_qkv's gradient.
The bias gradient of the MLP's residual branch, sum_rows(dh2), is reduced by
the MLP-side LayerNorm backward, which reads dh2 as a tile; b_o's,
sum_rows(dh), by a pass over dh, the block's input gradient.  (A sum folds the
padded lanes of a ragged tile too, where a tile is 0 and a per-row
coefficient is not, so the epilogue that writes dh cannot sum it.)

Floor: 12 GEMMs; beyond their operands, per LayerNorm the residual read in its
producing epilogue, the reads of h and dy and the LN(h) store in its backward
epilogue and two passes over its weight; the pre store and its read in dGELU;
the pass over dqkv and qkv; and the read of dh for b_o's gradient.
"""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, erf, exp, gelu, gemm,
                                   layernorm_fold, layernorm_stats, row_sum, tile_pass, vector_pass)

SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)


@epilogue(reductions={"sum": col_sum(), "sumsq": col_sum(), "bias_dot": col_sum()})
def residual_moments(acc, b: RowVec, x: Tile):
    # The sums fold a = acc + x, which is 0 in a ragged tile's padded lanes (b is
    # not); layernorm_stats adds the bias's share.
    a = acc + x
    return {"D": a + b, "sum": a, "sumsq": a * a, "bias_dot": a * b}


@epilogue(outputs={"act": "bf16"})
def ln_fc_gelu(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    pre = rstd * (acc - mean * gw) + shift
    return {"D": pre, "act": gelu(pre)}


@epilogue()
def ln_rank1(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}


@epilogue(reductions={"s1": col_sum(), "s2": col_sum(), "db": row_sum()})
def ln_grad_stats(du: Tile, u: Tile, gw: RowVec, shift: RowVec):
    return {"s1": du * gw, "s2": du * (u - shift), "db": du}


@epilogue(reductions={"db": row_sum(), "s1": col_sum(), "s2": col_sum()})
def dgelu_stats(acc, pre: Tile, gw: RowVec, shift: RowVec):
    dpre = acc * (0.5 * (1.0 + erf(pre * SQRT_HALF)) + pre * exp(-0.5 * pre * pre) * INV_SQRT_2PI)
    return {"D": dpre, "db": dpre, "s1": dpre * gw, "s2": dpre * (pre - shift)}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    # xhat = rstd * h + r0;  dh = dy + rstd * gamma * g + p * h + q
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum()})
def ln_backward(acc, h: Tile, dy: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                beta: RowVec):
    xhat = rstd * h + r0
    return {"D": dy + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum(), "db_res": row_sum()})
def ln_backward_bias(acc, h: Tile, dy: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                     beta: RowVec):
    # db_res = sum_rows(dy): the gradient of the bias added where dy's stream was
    # produced (dy is a Tile, 0 in padded rows; dh is not: q holds a stale value there).
    xhat = rstd * h + r0
    return {"D": dy + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc, "db_res": dy}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(attn, x, w_o, b_o, gamma_mlp, beta_mlp, w_fc, b_fc, w_proj, b_proj, gamma_attn, beta_attn,
            w_qkv, b_qkv, eps):
    dim = x.shape[1]
    a = gemm(attn, w_o.t(), residual_moments, b=b_o, x=x)
    st1 = layernorm_stats(a["sum"], a["sumsq"], dim, eps, bias=b_o, bias_dot=a["bias_dot"])
    f_fc = layernorm_fold(w_fc.t(), gamma_mlp, beta_mlp, b_fc)
    fc = gemm(a["D"], f_fc["B"], ln_fc_gelu, mean=st1["mean"], rstd=st1["rstd"], gw=f_fc["gw"],
              shift=f_fc["c"])
    c = gemm(fc["act"], w_proj.t(), residual_moments, b=b_proj, x=a["D"])
    st2 = layernorm_stats(c["sum"], c["sumsq"], dim, eps, bias=b_proj, bias_dot=c["bias_dot"])
    f_qkv = layernorm_fold(w_qkv.t(), gamma_attn, beta_attn, b_qkv)
    qkv = gemm(c["D"], f_qkv["B"], ln_rank1, mean=st2["mean"], rstd=st2["rstd"], gw=f_qkv["gw"],
               shift=f_qkv["c"])["D"]
    return {"h_out": c["D"], "qkv": qkv, "h": a["D"], "pre": fc["D"], "act": fc["act"],
            "mean1": st1["mean"], "rstd1": st1["rstd"], "gw_fc": f_fc["gw"], "shift_fc": f_fc["c"],
            "mean2": st2["mean"], "rstd2": st2["rstd"], "gw_qkv": f_qkv["gw"], "shift_qkv": f_qkv["c"]}


def backward(saved, dh_out, dqkv):
    inv_dim = 1.0 / saved["x"].shape[1]
    h, h2, act = saved["h"], saved["h_out"], saved["act"]
    # Next layer's LayerNorm + QKV: the statistics from dqkv and the saved qkv.
    st = tile_pass(ln_grad_stats, du=dqkv, u=saved["qkv"], gw=saved["gw_qkv"], shift=saved["shift_qkv"])
    k2 = vector_pass(ln_grad_coeffs, mean=saved["mean2"], rstd=saved["rstd2"], s1=st["s1"], s2=st["s2"],
                     inv_dim=inv_dim)
    d2 = gemm(dqkv, saved["w_qkv"], ln_backward, h=h2, dy=dh_out, rstd=saved["rstd2"], r0=k2["r0"],
              p=k2["p"], q=k2["q"], gamma=saved["gamma_attn"], beta=saved["beta_attn"])
    dh2 = d2["D"]
    dw_qkv = gemm(dqkv.t(), d2["ln"])["D"]
    # MLP + its LayerNorm (+ the residual gradient dh2).
    # dpre goes over the saved pre it is computed from (read before written, not read again).
    da = gemm(dh2, saved["w_proj"], dgelu_stats, pre=saved["pre"], out=saved["pre"], gw=saved["gw_fc"],
              shift=saved["shift_fc"])
    k1 = vector_pass(ln_grad_coeffs, mean=saved["mean1"], rstd=saved["rstd1"], s1=da["s1"], s2=da["s2"],
                     inv_dim=inv_dim)
    d1 = gemm(da["D"], saved["w_fc"], ln_backward_bias, h=h, dy=dh2, rstd=saved["rstd1"], r0=k1["r0"], p=k1["p"],
              q=k1["q"], gamma=saved["gamma_mlp"], beta=saved["beta_mlp"])
    dh1 = d1["D"]
    dw_fc = gemm(da["D"].t(), d1["ln"])["D"]
    dw_proj = gemm(dh2.t(), act)["D"]
    # Out-projection + residual; b_o's gradient sum_rows(dh1): dh1 leaves the block, so a pass reads it.
    return {"dattn": gemm(dh1, saved["w_o"])["D"], "dx": dh1, "dw_o": gemm(dh1.t(), saved["attn"])["D"],
            "db_o": tile_pass(bias_grad, dy=dh1)["db"], "dgamma_mlp": d1["dgamma"], "dbeta_mlp": d1["dbeta"],
            "dw_fc": dw_fc, "db_fc": da["db"], "dw_proj": dw_proj, "db_proj": d1["db_res"], "dgamma_attn": d2["dgamma"],
            "dbeta_attn": d2["dbeta"], "dw_qkv": dw_qkv, "db_qkv": st["db"]}
