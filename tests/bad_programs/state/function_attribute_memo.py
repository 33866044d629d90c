# stage: reference
# expect: identical for two different inputs || changed the module-level
# static: off
"""State on the function object: the result of the first call of each size."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    memo = forward.__dict__.setdefault("memo", {})
    if x.shape[0] not in memo:
        memo[x.shape[0]] = gemm(x, w, add_residual, residual=r)["D"]
    return {"y": memo[x.shape[0]]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
