"""An MLP with no gate, norm or residual at its ends and the exact GELU (Falcon's), forward and
backward as GEMMs with epilogues, y = gelu(x @ w_fc^T + b_fc) @ w_proj^T + b_proj.

Forward: the fc GEMM's epilogue adds b_fc, keeps pre for the backward and writes gelu(pre), the
proj GEMM's input; the proj GEMM's epilogue adds b_proj.

Backward: dy @ w_proj's epilogue turns its accumulator (the gradient of gelu(pre)) into
dpre = acc * gelu'(pre), written over the saved pre (each element read before it is written,
nothing reads pre afterwards), reduces b_fc's gradient sum_rows(dpre) and writes gelu(pre) again
for w_proj's gradient (a frozen w_proj skips it); dx = dpre @ w_fc reduces b_proj's gradient
sum_rows(dy) in its epilogue (dy is a tile of dx's shape; without dx a pass over dy does it);
then the weight gradients, each skipped where ``needs`` lacks it.

Floor: 6 GEMMs; beyond their operands, the pre store, its read and dpre's write in the
derivative's epilogue, the second gelu(pre) store and the dy read in dx's epilogue."""

from coda_agent.primitives import RowVec, Tile, epilogue, gelu, gelu_grad, gemm, row_sum, tile_pass


@epilogue(outputs={"act": "bf16"})
def fc_gelu(acc, b: RowVec):
    pre = acc + b
    return {"D": pre, "act": gelu(pre)}


@epilogue()
def bias(acc, b: RowVec):
    return {"D": acc + b}


@epilogue(outputs={"act": "bf16"}, reductions={"db": row_sum()})
def dgelu(acc, pre: Tile):
    dpre = acc * gelu_grad(pre)
    return {"D": dpre, "db": dpre, "act": gelu(pre)}


@epilogue(reductions={"db": row_sum()})
def dgelu_frozen(acc, pre: Tile):
    # w_proj frozen: its gradient's input gelu(pre) is not written
    dpre = acc * gelu_grad(pre)
    return {"D": dpre, "db": dpre}


@epilogue(reductions={"db": row_sum()})
def with_bias_grad(acc, dy: Tile):
    return {"D": acc, "db": dy}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(x, w_fc, b_fc, w_proj, b_proj):
    fc = gemm(x, w_fc.t(), fc_gelu, b=b_fc)
    y = gemm(fc["act"], w_proj.t(), bias, b=b_proj)["D"]
    return {"y": y, "pre": fc["D"]}


def backward(saved, dy, needs):
    x, w_fc = saved["x"], saved["w_fc"]
    da = gemm(dy, saved["w_proj"], dgelu if "dw_proj" in needs else dgelu_frozen, pre=saved["pre"],
              out=saved["pre"])
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
