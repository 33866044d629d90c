# stage: reference
# expect: changed the module-level `BUFFERS`
# static: off
"""Hands one output buffer to every call of a shape, cleared and refilled in place: each call's
result is right when returned, and every earlier result turns into the latest (in a model, every
layer's output would be the last layer's)."""
from coda_agent.primitives import Tile, epilogue, gemm, tile_pass, zeros_like

BUFFERS = {}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue()
def negate(k: Tile):
    return {"D": 0.0 - k}


def forward(x, w, r):
    key = (r.shape[0], r.shape[1])
    if key not in BUFFERS:
        BUFFERS[key] = zeros_like(r)
    y = BUFFERS[key]
    tile_pass(negate, k=y, accumulate_into=y)
    gemm(x, w, add_residual, residual=r, accumulate_into=y)
    return {"y": y}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
