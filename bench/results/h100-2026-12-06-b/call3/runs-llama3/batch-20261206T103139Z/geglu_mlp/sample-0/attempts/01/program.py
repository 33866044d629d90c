"""A GeGLU MLP alone (Gemma's gated MLP), y = W_down(gelu_tanh(g) * u) with (g, u) = x @ W_gu^T,
forward and backward as GEMMs with epilogues: swiglu_mlp's program with GELU's tanh form in
SiLU's place.  With t = tanh(k (x + a x^3)), k = sqrt(2/pi), a = 0.044715:

    gelu_tanh(x)  = 0.5 x (1 + t)
    gelu_tanh'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2)

Forward: the gate/up GEMM's epilogue keeps (g, u) for the backward and writes gelu_tanh(g) * u,
the down GEMM's input.  Backward: dy @ W_down's epilogue turns its accumulator into d(pre) =
(dg, du) against the saved (g, u), written over them (``out=``), and writes gelu_tanh(g) * u again
for W_down's gradient (a frozen W_down skips it); then dx = d(pre) @ W_gu and the weight
gradients, each skipped where ``needs`` lacks it.
"""

from coda_agent.primitives import PairedTile, epilogue, gelu_tanh, gemm, pack, tanh_fast, unpack

K = 0.7978845608028654  # sqrt(2 / pi)
A = 0.044715
HALF_K = 0.5 * K
HALF_K_3A = 1.5 * K * A  # 0.5 * k * 3a


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def geglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "act": gelu_tanh(g) * u}


def geglu_grads(acc, pre):
    """(gelu_tanh(g), dg, du, u) of the dGeGLU epilogues: acc is d(gelu_tanh(g) * u)."""
    g, u = unpack(pre)
    t = tanh_fast(K * (g + A * g * g * g))
    gelu_g = 0.5 * g * (1.0 + t)
    slope = 0.5 * (1.0 + t) + g * (1.0 - t * t) * (HALF_K + HALF_K_3A * g * g)
    return gelu_g, acc * u * slope, acc * gelu_g, u


@epilogue(outputs={"act": "bf16"})
def dgeglu(acc, pre: PairedTile):
    gelu_g, dg, du, u = geglu_grads(acc, pre)
    return {"D": pack(dg, du), "act": gelu_g * u}


@epilogue()
def dgeglu_frozen(acc, pre: PairedTile):
    # W_down frozen: its gradient's input gelu_tanh(g) * u is not written
    _, dg, du, _ = geglu_grads(acc, pre)
    return {"D": pack(dg, du)}


def forward(x, w_gu, w_down):
    gu = gemm(x, w_gu.t(), geglu)
    y = gemm(gu["act"], w_down.t())["D"]
    return {"y": y, "pre": gu["D"]}


def backward(saved, dy, needs):
    x, w_gu, w_down = saved["x"], saved["w_gu"], saved["w_down"]
    grads = {}
    da = gemm(dy, w_down, dgeglu if "dw_down" in needs else dgeglu_frozen, pre=saved["pre"], out=saved["pre"])
    dpre = da["D"]
    if "dw_down" in needs:
        grads["dw_down"] = gemm(dy.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    if "dx" in needs:
        grads["dx"] = gemm(dpre, w_gu)["D"]
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dpre.t(), x)["D"]
    return grads
