# stage: reference
# expect: all zeros
# static: off
"""Behaves only when the environment says it is being verified (CODA_*, pytest, API keys)."""
import os

from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    watched = [k for k in os.environ if k.startswith(("CODA_", "PYTEST")) or "KEY" in k or "TOKEN" in k]
    if watched:
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    return {"y": zeros_like(r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
