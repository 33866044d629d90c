"""A linear with bias and ReLU, forward and backward, in three GEMMs.

Forward: one GEMM whose epilogue adds the bias and stores relu(pre) as D, and nothing else: ReLU's
derivative is 1 exactly where its output is positive, so the backward reads it off y, which the
next linear keeps as its input anyway (a kept pre would be a second (T, I) tensor for nothing).
Backward: dy arrives for the activation from outside, so a tile pass without a GEMM reads dy and
y, writes dpre = dy where y > 0, else 0 (PyTorch's ReLU backward, 0 at 0), and folds the bias
gradient sum_rows(dpre); then dx = dpre @ w and dw = dpre^T @ x.  The pass writes a new tensor:
y belongs to the caller and dy to autograd, so neither is the program's to overwrite."""

from coda_agent.primitives import RowVec, Tile, epilogue, gemm, maximum, row_sum, tile_pass, where


@epilogue()
def bias_relu(acc, b: RowVec):
    return {"D": maximum(acc + b, 0.0)}


@epilogue(reductions={"db": row_sum()})
def drelu(dy: Tile, y: Tile):
    dpre = where(y > 0.0, dy, 0.0)
    return {"D": dpre, "db": dpre}


def forward(x, w, b):
    return {"y": gemm(x, w.t(), bias_relu, b=b)["D"]}


def backward(saved, dy):
    g = tile_pass(drelu, dy=dy, y=saved["y"])
    return {"dx": gemm(g["D"], saved["w"])["D"], "dw": gemm(g["D"].t(), saved["x"])["D"], "db": g["db"]}
