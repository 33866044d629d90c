"""A clamped SwiGLU MLP with biases (GPT-OSS's experts; DeepSeek-V4's with alpha 1, offset 0),
forward and backward as GEMMs with epilogues:
y = W_down(g' * sigmoid(alpha g') * (u' + offset)) + b_down, (g, u) = x @ W_gu^T + b_gu,
g' = min(g, limit), u' = clamp(u, -limit, limit).

Forward: the gate/up GEMM's epilogue adds b_gu (a RowVec of 2I values, seen as a Pair beside the
paired accumulator), keeps the biased pre-activation (g, u) in bf16 for the backward and writes the
activation from those bf16 values (so a value at a bound is clamped in the forward exactly where the
backward stops its gradient), the down GEMM's input; the down GEMM adds b_down.  Both clamps compare
against the limit rounded to bf16, as torch's clamp of a bf16 tensor does (HF's bf16 experts): a
pre-activation that rounds onto the bound passes its gradient there, and the program flips at a kink
exactly where a bf16 model does.

Backward: dy @ W_down's epilogue turns its accumulator d(act) into d(pre) = (dg, du), read against
the saved (g, u) as pairs: each clamp passes the gradient only inside its range, bounds included
(torch.clamp's backward), and writes the activation again for W_down's gradient.  d(pre) is
written over the saved pre-activation.  b_gu's gradient, sum_rows(d(pre)), is a pass over d(pre)
where ``needs`` asks for it (a paired epilogue folds across columns only; a zero bias that does not
train, DeepSeek-V4's, pays nothing).  dx = d(pre) @ W_gu reduces b_down's gradient, sum_rows(dy), in its
epilogue (without dx a pass over dy does it); the weight gradients are plain GEMMs.  Each weight
gradient is skipped where ``needs`` lacks it.
"""

from coda_agent.primitives import (PairedTile, RowVec, Scalar, Tile, epilogue, gemm, maximum, minimum, pack, round_bf16,
                                   row_sum, sigmoid, tile_pass, unpack, where)


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def clamp_swiglu(acc, b: RowVec, limit: Scalar, alpha: Scalar, offset: Scalar):
    g, u = unpack(acc + b)
    g, u = round_bf16(g), round_bf16(u)  # the values the backward reads: both clamp where the other does
    lim = round_bf16(limit)
    gc = minimum(g, lim)
    uc = maximum(minimum(u, lim), -lim)
    return {"D": pack(g, u), "act": gc * sigmoid(alpha * gc) * (uc + offset)}


@epilogue()
def bias(acc, b: RowVec):
    return {"D": acc + b}


@epilogue(outputs={"act": "bf16"})
def dclamp_swiglu(acc, pre: PairedTile, limit: Scalar, alpha: Scalar, offset: Scalar):
    g, u = unpack(pre)
    lim = round_bf16(limit)
    gc = minimum(g, lim)
    uc = maximum(minimum(u, lim), -lim)
    s = sigmoid(alpha * gc)
    glu = gc * s
    up = uc + offset
    dg = where(g <= lim, acc * up * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
    du = where(u <= lim, where(u >= -lim, acc * glu, 0.0), 0.0)
    return {"D": pack(dg, du), "act": glu * up}


@epilogue(reductions={"db": row_sum()})
def with_bias_grad(acc, dy: Tile):
    return {"D": acc, "db": dy}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(x, w_gu, b_gu, w_down, b_down, limit, alpha, offset):
    gu = gemm(x, w_gu.t(), clamp_swiglu, b=b_gu, limit=limit, alpha=alpha, offset=offset)
    y = gemm(gu["act"], w_down.t(), bias, b=b_down)["D"]
    return {"y": y, "pre": gu["D"]}


def backward(saved, dy, needs):
    x, w_gu, w_down = saved["x"], saved["w_gu"], saved["w_down"]
    grads = {}
    da = gemm(dy, w_down, dclamp_swiglu, pre=saved["pre"], out=saved["pre"], limit=saved["limit"],
              alpha=saved["alpha"], offset=saved["offset"])
    dpre = da["D"]
    if "dw_down" in needs:
        grads["dw_down"] = gemm(dy.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    if "dx" in needs:
        d = gemm(dpre, w_gu, with_bias_grad, dy=dy)
        grads["dx"], grads["db_down"] = d["D"], d["db"]
    else:
        grads["db_down"] = tile_pass(bias_grad, dy=dy)["db"]
    if "db_gu" in needs:
        grads["db_gu"] = tile_pass(bias_grad, dy=dpre)["db"]
    if "dw_gu" in needs:
        grads["dw_gu"] = gemm(dpre.t(), x)["D"]
    return grads
