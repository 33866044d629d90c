"""Entry LayerNorm + QKV projection with bias, forward and backward.

LayerNorm commutes with the GEMM that consumes it in its rank-1 form:

    LN(x) @ w^T + b = rstd * (x @ (w * gamma)^T - mean * gw) + c

with gw the column sums of w * gamma and c = beta @ w^T + b (layernorm_fold:
one pass over the weight per call).  The GEMM reads x itself, so the
normalized activation is never written; mean and rstd of x, which no GEMM
produced, take one pass over x (row_stats).

Backward, with g = dqkv @ w the gradient of LN(x) and xhat = (x - mean) * rstd:

    dx = rstd * (gamma * g - (s1 + xhat * s2) / H)

where s1 = sum_cols(gamma * g) = dqkv . gw and s2 = sum_cols(gamma * g * xhat)
= dqkv . (qkv - c) are read off the consuming GEMM's output: one tile pass over
dqkv and the saved qkv reduces both and b_qkv's gradient sum_rows(dqkv) (no
GEMM of this task produces dqkv).  The per-row coefficients of dx are computed
once per row (vector_pass: dx = rstd * gamma * g + p * x + q); the g GEMM's
epilogue writes dx and LN(x) (the weight gradient's input) and reduces dgamma
and dbeta; dw_qkv = dqkv^T @ LN(x).

Floor: 3 GEMMs; beyond their operands, a read of x for the statistics, the
pass over dqkv and qkv, the read of x and the LN(x) store in the g GEMM's
epilogue, and two passes over the weight (read and write the folded copy)."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, layernorm_fold,
                                   row_stats, row_sum, tile_pass, vector_pass)


@epilogue()
def ln_rank1(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}


@epilogue(reductions={"s1": col_sum(), "s2": col_sum(), "db": row_sum()})
def ln_grad_stats(du: Tile, u: Tile, gw: RowVec, shift: RowVec):
    return {"s1": du * gw, "s2": du * (u - shift), "db": du}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    # xhat = rstd * x + r0;  dx = rstd * gamma * g + p * x + q
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum()})
def ln_backward(acc, x: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec, beta: RowVec):
    xhat = rstd * x + r0
    return {"D": rstd * gamma * acc + p * x + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc}


def forward(x, gamma, beta, w_qkv, b_qkv, eps):
    stats = row_stats(x, eps)
    fold = layernorm_fold(w_qkv.t(), gamma, beta, b_qkv)
    qkv = gemm(x, fold["B"], ln_rank1, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
               shift=fold["c"])["D"]
    return {"qkv": qkv, "mean": stats["mean"], "rstd": stats["rstd"], "gw": fold["gw"], "shift": fold["c"]}


def backward(saved, dqkv, needs):
    x, rstd = saved["x"], saved["rstd"]
    st = tile_pass(ln_grad_stats, du=dqkv, u=saved["qkv"], gw=saved["gw"], shift=saved["shift"])
    k = vector_pass(ln_grad_coeffs, mean=saved["mean"], rstd=rstd, s1=st["s1"], s2=st["s2"],
                    inv_dim=1.0 / x.shape[1])
    d = gemm(dqkv, saved["w_qkv"], ln_backward, x=x, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"],
             gamma=saved["gamma"], beta=saved["beta"])
    grads = {"dx": d["D"], "dgamma": d["dgamma"], "dbeta": d["dbeta"], "db_qkv": st["db"]}
    if "dw_qkv" in needs:  # a frozen weight (LoRA, a frozen base) skips its gradient GEMM
        grads["dw_qkv"] = gemm(dqkv.t(), d["ln"])["D"]
    return grads
