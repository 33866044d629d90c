# stage: reference
# expect: PyTorch compute in the program at line 17
"""The residual add in a helper nested in forward and named like the epilogue fn: an audit that
exempted frames by function name took it for the epilogue's traced body."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    y = gemm(x, w)["D"]

    def add_residual(a, b):
        return a + b

    return {"y": add_residual(y, r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
