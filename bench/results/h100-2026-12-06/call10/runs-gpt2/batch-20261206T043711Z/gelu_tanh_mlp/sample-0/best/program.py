"""An MLP with no gate, norm or residual at its ends and GELU's tanh form (GPT-Neo's, GPT-J's,
Phi's: gelu_new), forward and backward as GEMMs with epilogues,
y = gelu_tanh(x @ w_fc^T + b_fc) @ w_proj^T + b_proj: gelu_mlp's program with the tanh form and
its derivative in place of the exact GELU's.

Forward: the fc GEMM's epilogue adds b_fc, keeps pre for the backward and writes gelu_tanh(pre),
the proj GEMM's input; the proj GEMM's epilogue adds b_proj.

Backward: dy @ w_proj's epilogue turns its accumulator into dpre = acc * gelu_tanh'(pre), written
over the saved pre, reduces b_fc's gradient and writes gelu_tanh(pre) again for w_proj's gradient
(a frozen w_proj skips it); dx = dpre @ w_fc reduces b_proj's gradient sum_rows(dy) in its
epilogue (without dx a pass over dy does it); then the weight gradients, each skipped where
``needs`` lacks it.  Floor: as gelu_mlp's."""

from coda_agent.primitives import (RowVec, Tile, epilogue, gelu_tanh, gelu_tanh_grad, gemm, row_sum,
                                   tile_pass)


@epilogue(outputs={"act": "bf16"})
def fc_gelu_tanh(acc, b: RowVec):
    pre = acc + b
    return {"D": pre, "act": gelu_tanh(pre)}


@epilogue()
def bias(acc, b: RowVec):
    return {"D": acc + b}


@epilogue(outputs={"act": "bf16"}, reductions={"db": row_sum()})
def dgelu_tanh(acc, pre: Tile):
    dpre = acc * gelu_tanh_grad(pre)
    return {"D": dpre, "db": dpre, "act": gelu_tanh(pre)}


@epilogue(reductions={"db": row_sum()})
def dgelu_tanh_frozen(acc, pre: Tile):
    # w_proj frozen: its gradient's input gelu_tanh(pre) is not written
    dpre = acc * gelu_tanh_grad(pre)
    return {"D": dpre, "db": dpre}


@epilogue(reductions={"db": row_sum()})
def with_bias_grad(acc, dy: Tile):
    return {"D": acc, "db": dy}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(x, w_fc, b_fc, w_proj, b_proj):
    fc = gemm(x, w_fc.t(), fc_gelu_tanh, b=b_fc)
    y = gemm(fc["act"], w_proj.t(), bias, b=b_proj)["D"]
    return {"y": y, "pre": fc["D"]}


def backward(saved, dy, needs):
    x, w_fc = saved["x"], saved["w_fc"]
    da = gemm(dy, saved["w_proj"], dgelu_tanh if "dw_proj" in needs else dgelu_tanh_frozen,
              pre=saved["pre"], out=saved["pre"])
    dpre = da["D"]
    grads = {"db_fc": da["db"]}
    if "dw_proj" in needs:
        grads["dw_proj"] = gemm(dy.t(), da["act"])["D"]
    del da  # before the next GEMMs allocate: the (T, I) act is the largest temporary here
    if "dx" in needs:
        d = gemm(dpre, w_fc, with_bias_grad, dy=dy)
        grads["dx"], grads["db_proj"] = d["D"], d["db"]
    else:
        grads["db_proj"] = tile_pass(bias_grad, dy=dy)["db"]
    if "dw_fc" in needs:
        grads["dw_fc"] = gemm(dpre.t(), x)["D"]
    return grads
