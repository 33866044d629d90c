"""Apertus's xIELU MLP.  The two trained slopes are one-element parameters: a vector pass takes their
softplus (alpha_n's plus beta) once, and `broadcast` repeats each as a RowVec of the up GEMM's width,
whose epilogue applies xIELU and keeps the pre-activation.  Backward: the epilogue of dy @ w_down
writes dpre = dact * xielu'(pre) over the saved pre and folds, down the rows, dact times each slope's
own term (u^2 where u > 0, expm1(min(u, eps)) - u elsewhere); a tile pass over those (I,) sums, viewed
as one row, finishes each slope's gradient through its softplus (sigmoid of the raw parameter)."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, broadcast, col_sum, epilogue, exp, gemm, log,
                                   maximum, minimum, row_sum, sigmoid, tile_pass, vector_pass, where)


def softplus(a):
    # log(1 + exp(a)) without exp's overflow: max(a, 0) + log(1 + exp(-|a|))
    return maximum(a, 0.0) + log(1.0 + exp(minimum(a, -a)))


def expm1_minus(m, x):
    # expm1(m) - x for m = min(x, eps): at m = x, e^x - 1 - x is x^2/2 + ..., which exp(x) - 1.0 - x
    # loses to fp32's cancellation for small |x| (its error ~1e-7 against x^2 / 2), so small |m|
    # take the series (to x^8: under 1e-7 of the sum below |m| = 0.5), the rest the direct form
    s = m * m * (0.5 + m * (1.0 / 6.0 + m * (1.0 / 24.0 + m * (1.0 / 120.0 + m * (1.0 / 720.0 + m * (
        1.0 / 5040.0 + m * (1.0 / 40320.0)))))))
    return where(m > -0.5, s + (m - x), exp(m) - 1.0 - x)


@epilogue(outputs={"an": "fp32"})
def slopes(alpha_p: RowVec, alpha_n: RowVec, beta: Scalar):
    return {"D": softplus(alpha_p), "an": beta + softplus(alpha_n)}


@epilogue(outputs={"act": "bf16"})
def xielu(acc, ap: RowVec, an: RowVec, beta: Scalar, eps: Scalar):
    neg = an * expm1_minus(minimum(acc, eps), acc)
    return {"D": acc, "act": where(acc > 0.0, ap * acc * acc, neg) + beta * acc}


@epilogue(reductions={"gp": row_sum(), "gn": row_sum()})
def dxielu(acc, pre: Tile, ap: RowVec, an: RowVec, beta: Scalar, eps: Scalar):
    pos = pre > 0.0
    dneg = an * (where(pre < eps, exp(pre), 0.0) - 1.0)
    return {"D": acc * (where(pos, 2.0 * ap * pre, dneg) + beta),
            "gp": where(pos, acc * pre * pre, 0.0),
            "gn": where(pos, 0.0, acc * expm1_minus(minimum(pre, eps), pre))}


@epilogue(reductions={"g": col_sum()})
def through_softplus(v: Tile, a: ColVec):
    return {"g": v * sigmoid(a)}


def forward(x, w_up, w_down, alpha_p, alpha_n, beta, eps):
    n = w_up.shape[0]
    s = vector_pass(slopes, alpha_p=alpha_p, alpha_n=alpha_n, beta=beta)
    ap, an = broadcast(s["D"], n), broadcast(s["an"], n)
    up = gemm(x, w_up.t(), xielu, ap=ap, an=an, beta=beta, eps=eps)
    y = gemm(up["act"], w_down.t())["D"]
    return {"y": y, "pre": up["D"], "act": up["act"], "ap": ap, "an": an}


def backward(saved, dy):
    n = saved["w_up"].shape[0]
    dw_down = gemm(dy.t(), saved["act"])["D"]
    d = gemm(dy, saved["w_down"], dxielu, pre=saved["pre"], ap=saved["ap"], an=saved["an"], beta=saved["beta"],
             eps=saved["eps"], out=saved["pre"])
    dx = gemm(d["D"], saved["w_up"])["D"]
    dw_up = gemm(d["D"].t(), saved["x"])["D"]
    dap = tile_pass(through_softplus, v=d["gp"].view(1, n), a=saved["alpha_p"])["g"]
    dan = tile_pass(through_softplus, v=d["gn"].view(1, n), a=saved["alpha_n"])["g"]
    return {"dx": dx, "dw_up": dw_up, "dw_down": dw_down, "dalpha_p": dap, "dalpha_n": dan}
