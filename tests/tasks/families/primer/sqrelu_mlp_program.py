"""Squared-ReLU MLP: rms_prepare, the up GEMM (r * acc, relu^2 in its epilogue), the down GEMM with the residual;
backward: dy @ w_down with d(relu^2) = 2 relu(pre) reading the saved pre (scaled by r, reducing the RMSNorm
statistic s = sum(pre * dpre)), then the RMSNorm backward in the epilogue of (r dpre) @ w_up."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, maximum, rms_prepare,
                                   row_sum)


@epilogue(outputs={"act": "bf16"})
def norm_sqrelu(acc, rstd: ColVec):
    pre = acc * rstd
    r = maximum(pre, 0.0)
    return {"D": pre, "act": r * r}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue(reductions={"s": col_sum()})
def dsqrelu(acc, pre: Tile, rstd: ColVec):
    dpre = 2.0 * acc * maximum(pre, 0.0)
    return {"D": dpre * rstd, "s": dpre * pre}


@epilogue()
def scale_cols(acc, gamma: RowVec):
    return {"D": acc * gamma}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    return {"D": dy + gamma * acc - h * rstd * rstd * s * inv_dim, "dgamma": acc * h}


def forward(h, gamma, w_up, w_down, eps):
    prep = rms_prepare(h, gamma, eps)
    up = gemm(prep["xg"], w_up.t(), norm_sqrelu, rstd=prep["rstd"])
    y = gemm(up["act"], w_down.t(), add_residual, residual=h)["D"]
    return {"y": y, "pre": up["D"], "act": up["act"], "rstd": prep["rstd"]}


def backward(saved, dy):
    h, gamma, rstd = saved["h"], saved["gamma"], saved["rstd"]
    dw_down = gemm(dy.t(), saved["act"])["D"]
    da = gemm(dy, saved["w_down"], dsqrelu, pre=saved["pre"], rstd=rstd, out=saved["pre"])
    d = gemm(da["D"], saved["w_up"], rmsnorm_bwd, rstd=rstd, s=da["s"], gamma=gamma, h=h, dy=dy,
             inv_dim=1.0 / h.shape[1])
    dw_up = gemm(da["D"].t(), h, scale_cols, gamma=gamma)["D"]
    return {"dh": d["D"], "dgamma": d["dgamma"], "dw_up": dw_up, "dw_down": dw_down}
