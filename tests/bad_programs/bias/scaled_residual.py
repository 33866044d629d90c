# stage: reference
# expect: systematic bias
from coda_agent.primitives import Tile, epilogue, gemm, sigmoid


@epilogue()
def add_residual(acc, residual: Tile):
    # An offset that grows with the residual but stays at about a third of the per-element
    # bound (0.012 against about 0.038 on the small set) on every draw: its mean gives it away.
    return {"D": acc + residual + 0.012 * sigmoid(residual)}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
