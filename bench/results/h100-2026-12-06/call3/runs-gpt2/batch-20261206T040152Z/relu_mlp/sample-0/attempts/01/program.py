"""An MLP with no gate, norm or residual at its ends and ReLU (CTRL's feed-forward network, a
``nn.Sequential`` of Linear, ReLU, Linear; OPT's and BioGPT's with their inline code), forward
and backward as GEMMs with epilogues, y = relu(x @ w_fc^T + b_fc) @ w_proj^T + b_proj.

Forward: the fc GEMM's epilogue adds b_fc and stores a = relu(pre) in bf16, the proj GEMM's
input and the one tensor kept for the backward: ReLU's derivative is 1 exactly where a > 0, so no
pre-activation is kept (gelu_mlp keeps pre and writes the activation again in its backward).

Backward: dw_proj = dy^T @ a first, while a is still a; then dy @ w_proj's epilogue turns its
accumulator into dpre = acc where a > 0, else 0 (PyTorch's ReLU backward, 0 at 0), written over
a, and reduces b_fc's gradient; dx = dpre @ w_fc reduces b_proj's gradient sum_rows(dy) in its
epilogue (without dx a pass over dy does it); dw_fc = dpre^T @ x.  Each weight gradient is
skipped where ``needs`` lacks it.  Floor: the six GEMMs, with one (T, I) bf16 tensor between
forward and backward."""

from coda_agent.primitives import RowVec, Tile, epilogue, gemm, maximum, row_sum, tile_pass, where


@epilogue()
def fc_relu(acc, b: RowVec):
    return {"D": maximum(acc + b, 0.0)}


@epilogue()
def bias(acc, b: RowVec):
    return {"D": acc + b}


@epilogue(reductions={"db": row_sum()})
def relu_grad(acc, a: Tile):
    dpre = where(a > 0.0, acc, 0.0)
    return {"D": dpre, "db": dpre}


@epilogue(reductions={"db": row_sum()})
def with_bias_grad(acc, dy: Tile):
    return {"D": acc, "db": dy}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(x, w_fc, b_fc, w_proj, b_proj):
    a = gemm(x, w_fc.t(), fc_relu, b=b_fc)["D"]
    return {"y": gemm(a, w_proj.t(), bias, b=b_proj)["D"], "a": a}


def backward(saved, dy, needs):
    a = saved["a"]
    grads = {}
    if "dw_proj" in needs:  # before dpre is written over a
        grads["dw_proj"] = gemm(dy.t(), a)["D"]
    da = gemm(dy, saved["w_proj"], relu_grad, a=a, out=a)
    dpre, grads["db_fc"] = da["D"], da["db"]
    if "dx" in needs:
        d = gemm(dpre, saved["w_fc"], with_bias_grad, dy=dy)
        grads["dx"], grads["db_proj"] = d["D"], d["db"]
    else:
        grads["db_proj"] = tile_pass(bias_grad, dy=dy)["db"]
    if "dw_fc" in needs:
        grads["dw_fc"] = gemm(dpre.t(), saved["x"])["D"]
    return grads
