# stage: reference
# expect: `dx` differs from the reference on shape set small with fresh inputs: NaN: all
# D written over a buffer (out=) and the buffer read afterwards instead of the returned D: right
# where the kernel writes into that very buffer, wrong under torch.compile, where D gets a buffer
# of its own; the reference lowering fills the dead buffer with NaN.
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    gemm(dy, saved["w"].t(), out=dx)
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
