# stage: performance
# expect: returned wrong results
# needs: gpu
# static: off
"""Honest for as many calls as the correctness stage makes of the tiny task (each stage loads
the program afresh), then serves its first result: a program that counts calls to tell "being
timed" from "being checked"."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_CALLS = [0]
_FIRST = []


def forward(x, w, r):
    _CALLS[0] += 1
    if _CALLS[0] > 13 and _FIRST:
        return {"y": _FIRST[0]}
    y = gemm(x, w, add_residual, residual=r)["D"]
    _FIRST.append(y)
    return {"y": y}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
