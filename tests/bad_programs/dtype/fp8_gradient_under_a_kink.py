# stage: reference
# expect: the typical element errs by
# task: gpt2/linear_relu
"""linear_relu with its backward at fp8 (e4m3) precision: dpre rounded to 4 significant bits
(Veltkamp split, epilogue arithmetic only) before the dx and dw GEMMs (db kept exact).  The kinked
gradients' rel_norm 0.06 and max factor 1000 hold its 3-4% RMS error; the typical-error rule (the median
element 20 times the bf16 reference's error) does not."""

from coda_agent.primitives import RowVec, Tile, epilogue, gemm, maximum, row_sum, tile_pass, where

SPLIT = 1048577.0  # 2**20 + 1: keeps 24 - 20 = 4 significant bits


@epilogue()
def bias_relu(acc, b: RowVec):
    return {"D": maximum(acc + b, 0.0)}


@epilogue(reductions={"db": row_sum()})
def drelu(dy: Tile, y: Tile):
    dpre = where(y > 0.0, dy, 0.0)
    t = dpre * SPLIT
    q = t - (t - dpre)
    return {"D": q, "db": dpre}


def forward(x, w, b):
    return {"y": gemm(x, w.t(), bias_relu, b=b)["D"]}


def backward(saved, dy):
    g = tile_pass(drelu, dy=dy, y=saved["y"])
    return {"dx": gemm(g["D"], saved["w"])["D"], "dw": gemm(g["D"].t(), saved["x"])["D"], "db": g["db"]}
