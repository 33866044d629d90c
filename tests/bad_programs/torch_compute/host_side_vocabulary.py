# stage: reference
# expect: PyTorch compute in the program at line 9
"""The epilogue vocabulary called on whole tensors in forward: fma(y, 1, r) is y + r in PyTorch,
run from the catalogue's file, so an audit that looked only at the nearest caller saw none."""
from coda_agent.primitives import fma, gemm


def forward(x, w, r):
    return {"y": fma(gemm(x, w)["D"], 1.0, r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
