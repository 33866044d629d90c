"""CLIP's MLP: the rank-1 LayerNorm into fc1 with quick_gelu in its epilogue, fc2 with its bias and
the residual.  quick_gelu is written from the vocabulary, x * sigmoid(A x), and so is its
derivative, s + A x s (1 - s) with s = sigmoid(A x) (sigmoid_grad(A x) is s (1 - s)).  The backward
is the LayerNorm MLP's (OPT's, GPT-2's): the activation's derivative and the norm's two row sums in
the epilogue of dy @ w2, the norm's backward in the epilogue of dpre @ w1."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, layernorm_fold,
                                   row_stats, row_sum, sigmoid, sigmoid_grad, vector_pass)

A = 1.702  # quick_gelu's slope, a constant of the model's code


@epilogue(outputs={"act": "bf16"})
def ln_fc_quick_gelu(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    pre = rstd * (acc - mean * gw) + shift
    return {"D": pre, "act": pre * sigmoid(A * pre)}


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum(), "s1": col_sum(), "s2": col_sum()})
def dquick_gelu_stats(acc, pre: Tile, gw: RowVec, shift: RowVec):
    dpre = acc * (sigmoid(A * pre) + A * pre * sigmoid_grad(A * pre))
    return {"D": dpre, "db": dpre, "s1": dpre * gw, "s2": dpre * (pre - shift)}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum(), "db_res": row_sum()})
def ln_backward(acc, h: Tile, dy: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                beta: RowVec):
    xhat = rstd * h + r0
    return {"D": dy + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc, "db_res": dy}


def forward(h, gamma, beta, w1, b1, w2, b2, eps):
    stats = row_stats(h, eps)
    fold = layernorm_fold(w1.t(), gamma, beta, b1)
    fc = gemm(h, fold["B"], ln_fc_quick_gelu, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
              shift=fold["c"])
    y = gemm(fc["act"], w2.t(), bias_residual, b=b2, x=h)["D"]
    return {"y": y, "pre": fc["D"], "act": fc["act"], "mean": stats["mean"], "rstd": stats["rstd"],
            "gw": fold["gw"], "shift": fold["c"]}


def backward(saved, dy):
    h, rstd = saved["h"], saved["rstd"]
    da = gemm(dy, saved["w2"], dquick_gelu_stats, pre=saved["pre"], out=saved["pre"], gw=saved["gw"],
              shift=saved["shift"])
    k = vector_pass(ln_grad_coeffs, mean=saved["mean"], rstd=rstd, s1=da["s1"], s2=da["s2"], inv_dim=1.0 / h.shape[1])
    d = gemm(da["D"], saved["w1"], ln_backward, h=h, dy=dy, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"],
             gamma=saved["gamma"], beta=saved["beta"])
    return {"dh": d["D"], "dgamma": d["dgamma"], "dbeta": d["dbeta"], "dw1": gemm(da["D"].t(), d["ln"])["D"],
            "db1": da["db"], "dw2": gemm(dy.t(), saved["act"])["D"], "db2": d["db_res"]}
