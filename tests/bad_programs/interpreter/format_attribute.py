# stage: static
# expect: method call `.format()`
"""str.format reaches attributes by name ("{0.__class__}"), so it is no allowed method."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    leak = "{0.__class__.__init__.__globals__}".format(x)
    return {"y": gemm(x, w, add_residual, residual=r)["D"], "leak": leak}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
