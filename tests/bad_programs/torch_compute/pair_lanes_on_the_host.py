# stage: reference
# expect: PyTorch compute in the program at line 9
"""A Pair's lane arithmetic on whole tensors: pack(y, y) + pack(r, r) adds in the catalogue's file."""
from coda_agent.primitives import gemm, pack, unpack


def forward(x, w, r):
    y = gemm(x, w)["D"]
    s, _ = unpack(pack(y, y) + pack(r, r))
    return {"y": s}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
