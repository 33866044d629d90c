# stage: reference
# expect: lacks ['dw'] (it returned `d_w` for `dw`: rename them)
"""A backward whose gradient of w is returned under another name: the message names the one it
found, so the fix is a rename."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "d_w": dw, "dr": dy}
