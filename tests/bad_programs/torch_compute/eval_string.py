# stage: reference
# expect: PyTorch compute in the program at line 17
# static: off
"""Computes with PyTorch in code compiled from a string (``eval``: its frames belong to no file),
as a program that got past every Python rule would; the audit counts the string's calls as the
line's that ran it."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    gemm(x, w, add_residual, residual=r)  # a launch, so that the program looks like one
    return {"y": eval("(x.float() @ w.float() + r.float()).to(x.dtype)", {"x": x, "w": w, "r": r})}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
