"""The MLP sub-block, y = h + W_down(SwiGLU(RMSNorm(h) @ W_gu^T)), forward and
backward as GEMMs with epilogues.

RMSNorm commutes with the GEMM that consumes it (r is one scalar per row):
RMSNorm(h) @ W = r * ((h * gamma) @ W).  Its backward needs the statistic
s = sum_cols(d_pre * pre), reduced in the dSwiGLU epilogue that produces
d_pre, so that the GEMM d = d_pre @ W_gu can finish the RMSNorm backward in
its own epilogue:  dh = r * (gamma * d - h * r * s / H)  (+ dy, the residual).

Nothing is written twice: the forward keeps h * gamma (the gate/up GEMM's A
operand) and silu(g) * u (the down GEMM's A operand) for the weight gradients,
as autograd would.  dSwiGLU stores r * d_pre, so dW_gu = (r * d_pre)^T @
(h * gamma) needs no normalized copy of h, and d_pre @ W_gu's epilogue reads
its accumulator as r * d:  dh = dy + gamma * acc - h * r^2 * s / H and
dgamma = sum_rows(acc * h).
"""

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, epilogue,
                                   gemm, pack, rms_prepare, row_sum, sigmoid, unpack)


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def norm_swiglu(acc, rstd: ColVec):
    g, u = unpack(acc)
    g = g * rstd
    u = u * rstd
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue(reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile, rstd: ColVec):
    g, u = unpack(pre)
    sg = sigmoid(g)
    dg = acc * u * sg * (1.0 + g * (1.0 - sg))
    du = acc * g * sg
    return {"D": pack(dg * rstd, du * rstd), "s": g * dg + u * du}


@epilogue(reductions={"dgamma": row_sum()})
def rmsnorm_bwd(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    # acc = r * d (the A operand was r * d_pre)
    hr = h * rstd
    return {"D": dy + gamma * acc - hr * rstd * s * inv_dim,
            "dgamma": acc * h}


def forward(h, gamma, w_gu, w_down, eps):
    prep = rms_prepare(h, gamma, eps)
    gu = gemm(prep["xg"], w_gu.t(), norm_swiglu, rstd=prep["rstd"])
    y = gemm(gu["act"], w_down.t(), add_residual, residual=h)["D"]
    return {"y": y, "pre": gu["D"], "act": gu["act"], "xg": prep["xg"], "rstd": prep["rstd"]}


def backward(saved, dy):
    h, gamma, w_gu, w_down = saved["h"], saved["gamma"], saved["w_gu"], saved["w_down"]
    rstd = saved["rstd"]
    da = gemm(dy, w_down, dswiglu, pre=saved["pre"], rstd=rstd)
    d = gemm(da["D"], w_gu, rmsnorm_bwd, rstd=rstd, s=da["s"], gamma=gamma, h=h, dy=dy,
             inv_dim=1.0 / h.shape[1])
    dw_gu = gemm(da["D"].t(), saved["xg"])["D"]
    dw_down = gemm(dy.t(), saved["act"])["D"]
    return {"dh": d["D"], "dgamma": d["dgamma"], "dw_gu": dw_gu, "dw_down": dw_down}
