# stage: reference
# expect: `dw` has shape [96, 128]; the task declares [128, 96]
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(dy.t(), saved["x"])["D"]  # the transposed weight gradient
    return {"dx": dx, "dw": dw, "dr": dy}

