"""GPT-2's MLP sub-block with GELU's tanh approximation (Hugging Face's GPT-2,
``gelu_new``), y = h + gelu_tanh(LN(h) @ w_fc^T + b_fc) @ w_proj^T + b_proj,
forward and backward as GEMMs with epilogues: mlp_block's program, the
activation and its derivative aside.  With t = tanh(k (x + a x^3)),
k = sqrt(2/pi), a = 0.044715:

    gelu_tanh(x)  = 0.5 x (1 + t)
    gelu_tanh'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2)

Forward: the sub-block's LayerNorm has no producing GEMM here, so h's row
statistics take one pass over h (row_stats); the fc GEMM reads h itself
against w_fc * gamma (layernorm_fold) and finishes the rank-1 form
pre = rstd * (acc - mean * gw) + c in its epilogue, storing pre (for the
backward) and gelu_tanh(pre) (the proj GEMM's input); the proj GEMM adds b_proj
and the residual h.

Backward (4 GEMMs): dy @ w_proj with the derivative's epilogue reading pre, writing
dpre and reducing b_fc's gradient sum_rows(dpre) and the LayerNorm statistics
s1 = sum_cols(dpre * gw) and s2 = sum_cols(dpre * (pre - c)) (gamma-weighted
sums of g = dpre @ w_fc and of g * xhat, read off the fc GEMM's output);
dpre @ w_fc with the LayerNorm backward in its epilogue,
dh = dy + rstd * gamma * g + p * h + q (p, q per row, computed once per row),
writing LN(h) for w_fc's gradient and reducing dgamma, dbeta and b_proj's
gradient sum_rows(dy); then dw_fc = dpre^T @ LN(h) and dw_proj = dy^T @ gelu_tanh(pre),
on tensors the forward and backward already wrote.

Floor: 6 GEMMs; beyond their operands, the statistics' read of h, the pre
store, the residual read, the read of pre in the derivative's epilogue, the reads of
h and dy and the LN(h) store in the LayerNorm-backward epilogue, and two passes
over w_fc.  dpre is written over the saved pre (``out=``), so the backward
holds one (T, 4H) tensor fewer."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gelu_tanh, gemm, layernorm_fold,
                                   row_stats, row_sum, tanh_fast, vector_pass)

K = 0.7978845608028654  # sqrt(2 / pi)
A = 0.044715
HALF_K = 0.5 * K
HALF_K_3A = 1.5 * K * A  # 0.5 * k * 3a


@epilogue(outputs={"act": "bf16"})
def ln_fc_gelu(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    pre = rstd * (acc - mean * gw) + shift
    return {"D": pre, "act": gelu_tanh(pre)}


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum(), "s1": col_sum(), "s2": col_sum()})
def dgelu_stats(acc, pre: Tile, gw: RowVec, shift: RowVec):
    t = tanh_fast(K * (pre + A * pre * pre * pre))
    dpre = acc * (0.5 * (1.0 + t) + pre * (1.0 - t * t) * (HALF_K + HALF_K_3A * pre * pre))
    return {"D": dpre, "db": dpre, "s1": dpre * gw, "s2": dpre * (pre - shift)}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    # xhat = rstd * h + r0;  dh = dy + rstd * gamma * g + p * h + q
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum(), "db_res": row_sum()})
def ln_backward(acc, h: Tile, dy: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                beta: RowVec):
    xhat = rstd * h + r0
    return {"D": dy + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc, "db_res": dy}


def forward(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps):
    stats = row_stats(h, eps)
    fold = layernorm_fold(w_fc.t(), gamma, beta, b_fc)
    fc = gemm(h, fold["B"], ln_fc_gelu, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
              shift=fold["c"])
    y = gemm(fc["act"], w_proj.t(), bias_residual, b=b_proj, x=h)["D"]
    return {"y": y, "pre": fc["D"], "act": fc["act"], "mean": stats["mean"], "rstd": stats["rstd"],
            "gw": fold["gw"], "shift": fold["c"]}


def backward(saved, dy, needs):
    h, rstd = saved["h"], saved["rstd"]
    # dpre goes over the saved pre it is computed from (read before written, not read again).
    da = gemm(dy, saved["w_proj"], dgelu_stats, pre=saved["pre"], out=saved["pre"], gw=saved["gw"],
              shift=saved["shift"])
    k = vector_pass(ln_grad_coeffs, mean=saved["mean"], rstd=rstd, s1=da["s1"], s2=da["s2"],
                    inv_dim=1.0 / h.shape[1])
    d = gemm(da["D"], saved["w_fc"], ln_backward, h=h, dy=dy, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"],
             gamma=saved["gamma"], beta=saved["beta"])
    grads = {"dh": d["D"], "dgamma": d["dgamma"], "dbeta": d["dbeta"], "db_fc": da["db"], "db_proj": d["db_res"]}
    # a frozen weight (LoRA, a frozen base: not in needs) skips its gradient GEMM
    if "dw_fc" in needs:
        grads["dw_fc"] = gemm(da["D"].t(), d["ln"])["D"]
    if "dw_proj" in needs:
        grads["dw_proj"] = gemm(dy.t(), saved["act"])["D"]
    return grads
