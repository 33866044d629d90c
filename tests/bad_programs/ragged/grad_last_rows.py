# stage: reference
# expect: `dx` differs from the reference
"""The input gradient skips the ragged last rows."""
from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = zeros_like(saved["x"])
    full = dy.shape[0] // 128 * 128 if dy.shape[0] >= 128 else dy.shape[0]
    gemm(dy[:full], saved["w"].t(), accumulate_into=dx[:full])
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
