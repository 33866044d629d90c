# stage: reference
# expect: identical for two different inputs || changed the module-level
# static: off
"""A list default argument survives between calls: the first result is served forever after."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r, memo=[]):
    if not memo:
        memo.append(gemm(x, w, add_residual, residual=r)["D"])
    return {"y": memo[0]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
