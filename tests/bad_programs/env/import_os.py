# stage: static
# expect: import of `os`
import os
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}

def forward(x, w, r):
    if os.environ.get("CODA_VERIFY"):
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    return {"y": gemm(x, w)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}

