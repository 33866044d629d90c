# stage: reference
# expect: differs from the reference
"""Does the residual add only when the inner size is a multiple of 128 (the small set's)."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    if x.shape[1] % 128 == 0:
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    return {"y": gemm(x, w)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
