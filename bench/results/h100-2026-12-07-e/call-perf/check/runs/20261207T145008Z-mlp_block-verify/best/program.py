"""The MLP sub-block, y = h + W_down(SwiGLU(RMSNorm(h) @ W_gu^T)), forward and
backward as GEMMs with epilogues.

RMSNorm commutes with the GEMM that consumes it (r is one scalar per row):
RMSNorm(h) @ W = r * ((h * gamma) @ W).  Its backward needs the statistic
s = sum_cols(d_pre * pre), reduced in the dSwiGLU epilogue that produces
d_pre, so that the GEMM d = d_pre @ W_gu can finish the RMSNorm backward in
its own epilogue:  dh = r * (gamma * d - h * r * s / H)  (+ dy, the residual).

Between forward and backward only the pre-activation (g, u) and the inverse RMS
r are kept (beside the inputs and y), the least any SwiGLU backward needs.  The
GEMM inputs the weight gradients want are not kept: silu(g) * u is cheap
where (g, u) already sit, so the dSwiGLU epilogue writes it again (``act``, as
swiglu_bwd's ``postact``), and h * gamma never exists in the backward:
dW_gu = (r * d_pre)^T @ (h * gamma) = ((r * d_pre)^T @ h) * gamma, gamma
scaling the output columns in that GEMM's epilogue.  dSwiGLU stores r * d_pre,
so d_pre @ W_gu's epilogue reads its accumulator as r * d:
dh = dy + gamma * acc - h * r^2 * s / H and dgamma = sum_rows(acc * h).
r * d_pre is written over the saved pre-activation it is computed from
(``gemm(..., out=pre)``: each element is read before it is written), so the
backward never holds both (T, 2I) tensors, and each temporary is dropped once
its last GEMM has read it.

Frozen weights (LoRA, a frozen base: ``needs`` lacks their gradients) skip
their GEMMs, and a frozen W_down also the store of silu(g) * u.
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


def swiglu_grads(acc, pre):
    """(silu(g), dg, du, g, u) of the dSwiGLU epilogues: acc is d(silu(g) * u)."""
    g, u = unpack(pre)
    sg = sigmoid(g)
    silu_g = g * sg
    return silu_g, acc * u * sg * (1.0 + g * (1.0 - sg)), acc * silu_g, g, u


@epilogue(outputs={"act": "bf16"}, reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile, rstd: ColVec):
    silu_g, dg, du, g, u = swiglu_grads(acc, pre)
    return {"D": pack(dg * rstd, du * rstd), "act": silu_g * u, "s": g * dg + u * du}


@epilogue(reductions={"s": col_sum()})
def dswiglu_frozen(acc, pre: PairedTile, rstd: ColVec):
    # W_down frozen: its gradient's input silu(g) * u is not written
    silu_g, dg, du, g, u = swiglu_grads(acc, pre)
    return {"D": pack(dg * rstd, du * rstd), "s": g * dg + u * du}


@epilogue()
def scale_cols(acc, gamma: RowVec):
    return {"D": acc * gamma}


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
    return {"y": y, "pre": gu["D"], "rstd": prep["rstd"]}


def backward(saved, dy, needs):
    h, gamma, w_gu, w_down = saved["h"], saved["gamma"], saved["w_gu"], saved["w_down"]
    rstd = saved["rstd"]
    grads = {}
    # d(pre) overwrites the saved pre-activation it is computed from: the two never coexist.
    da = gemm(dy, w_down, dswiglu if "dw_down" in needs else dswiglu_frozen, pre=saved["pre"], rstd=rstd,
              out=saved["pre"])
    dpre, s = da["D"], da["s"]
    if "dw_down" in needs:
        grads["dw_down"] = gemm(dy.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    if "dh" in needs or "dgamma" in needs:
        d = gemm(dpre, w_gu, rmsnorm_bwd, rstd=rstd, s=s, gamma=gamma, h=h, dy=dy,
                 inv_dim=1.0 / h.shape[1])
        grads["dh"], grads["dgamma"] = d["D"], d["dgamma"]
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dpre.t(), h, scale_cols, gamma=gamma)["D"]
    return grads
