# stage: reference
# expect: `__repr__`
# static: off
"""An epilogue whose helper tells the lowering apart by its operand's text: under the reference
lowering (a torch tensor) it adds the residual, in the compiled kernel (a CuTe value) it does not,
so every CPU check sees a correct program."""
from coda_agent.primitives import Tile, epilogue, gemm


def combine(acc, residual):
    if "tensor(" in str(acc):
        return acc + residual
    return acc


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": combine(acc, residual)}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
