# stage: static
# expect: module-level state
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}

_CACHE = {}


def forward(x, w, r):
    if "y" not in _CACHE:
        _CACHE["y"] = gemm(x, w, add_residual, residual=r)["D"]
    return {"y": _CACHE["y"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}

