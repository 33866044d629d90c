"""A SwiGLU MLP alone, y = W_down(silu(g) * u) with (g, u) = x @ W_gu^T, forward and backward as
GEMMs with epilogues: the MLP block (mlp_block.py) without its RMSNorm and residual.

Forward: the gate/up GEMM's epilogue keeps the pre-activation (g, u) for the backward and writes
silu(g) * u, the down GEMM's input; no pass outside a GEMM.  Between forward and backward only
(g, u) is kept (beside the inputs), the least any SwiGLU backward needs.

Backward: dy @ W_down's epilogue turns its accumulator d(silu(g) * u) into d(pre) = (dg, du), read
against the saved (g, u) as pairs, and writes silu(g) * u again for W_down's gradient (cheap where
(g, u) sit; a frozen W_down skips it).  d(pre) is written over the saved pre-activation it is
computed from (each element is read before it is written), so the backward never holds both
(T, 2I) tensors.  Then dx = d(pre) @ W_gu and the weight gradients, each GEMM plain, and each skipped
where ``needs`` lacks its gradient (a frozen weight, a first layer's input).
"""

from coda_agent.primitives import PairedTile, epilogue, gemm, pack, sigmoid, unpack


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


def swiglu_grads(acc, pre):
    """(silu(g), dg, du, u) of the dSwiGLU epilogues: acc is d(silu(g) * u)."""
    g, u = unpack(pre)
    sg = sigmoid(g)
    silu_g = g * sg
    return silu_g, acc * u * sg * (1.0 + g * (1.0 - sg)), acc * silu_g, u


@epilogue(outputs={"act": "bf16"})
def dswiglu(acc, pre: PairedTile):
    silu_g, dg, du, u = swiglu_grads(acc, pre)
    return {"D": pack(dg, du), "act": silu_g * u}


@epilogue()
def dswiglu_frozen(acc, pre: PairedTile):
    # W_down frozen: its gradient's input silu(g) * u is not written
    _, dg, du, _ = swiglu_grads(acc, pre)
    return {"D": pack(dg, du)}


def forward(x, w_gu, w_down):
    gu = gemm(x, w_gu.t(), swiglu)
    y = gemm(gu["act"], w_down.t())["D"]
    return {"y": y, "pre": gu["D"]}


def backward(saved, dy, needs):
    x, w_gu, w_down = saved["x"], saved["w_gu"], saved["w_down"]
    grads = {}
    da = gemm(dy, w_down, dswiglu if "dw_down" in needs else dswiglu_frozen, pre=saved["pre"],
              out=saved["pre"])
    dpre = da["D"]
    if "dw_down" in needs:
        grads["dw_down"] = gemm(dy.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    if "dx" in needs:
        grads["dx"] = gemm(dpre, w_gu)["D"]
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dpre.t(), x)["D"]
    return grads
