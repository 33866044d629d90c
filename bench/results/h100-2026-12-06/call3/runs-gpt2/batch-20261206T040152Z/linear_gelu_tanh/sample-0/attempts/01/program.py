"""A linear with bias and GELU's tanh form, forward and backward, in three GEMMs: linear_gelu's
program with gelu_tanh and its derivative in place of the exact GELU's.

Forward: one GEMM; the epilogue adds the bias, stores gelu_tanh(pre) as D and keeps pre.
Backward: dy arrives for the activation from outside, so a tile pass without a GEMM reads dy and
pre, writes dpre = dy * gelu_tanh'(pre) over the saved pre (each element is read before it is
written, and nothing reads pre afterwards) and folds the bias gradient sum_rows(dpre); then
dx = dpre @ w and dw = dpre^T @ x."""

from coda_agent.primitives import RowVec, Tile, epilogue, gelu_tanh, gelu_tanh_grad, gemm, row_sum, tile_pass


@epilogue(outputs={"pre": "bf16"})
def bias_gelu_tanh(acc, b: RowVec):
    pre = acc + b
    return {"D": gelu_tanh(pre), "pre": pre}


@epilogue(reductions={"db": row_sum()})
def dgelu_tanh(dy: Tile, pre: Tile):
    dpre = dy * gelu_tanh_grad(pre)
    return {"D": dpre, "db": dpre}


def forward(x, w, b):
    out = gemm(x, w.t(), bias_gelu_tanh, b=b)
    return {"y": out["D"], "pre": out["pre"]}


def backward(saved, dy):
    g = tile_pass(dgelu_tanh, dy=dy, pre=saved["pre"], out=saved["pre"])
    return {"dx": gemm(g["D"], saved["w"])["D"], "dw": gemm(g["D"].t(), saved["x"])["D"], "db": g["db"]}
