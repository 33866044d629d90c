# stage: reference
# expect: identical for two different inputs || changed the module-level
# static: off
"""Computes once per shape and serves the cached result to every later call of that shape."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_SEEN = {}


def forward(x, w, r):
    key = tuple(x.shape)
    if key not in _SEEN:
        _SEEN[key] = gemm(x, w, add_residual, residual=r)["D"]
    return {"y": _SEEN[key]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
