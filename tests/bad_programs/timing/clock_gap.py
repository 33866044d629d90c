# stage: reference
# expect: is identical for two different inputs || changed the module-level
# static: off
"""Reads the clock: a call that comes within half a second of the previous one is part of a
timing loop, and gets the previous result.  The reference stage calls it with different inputs
in quick succession and sees the same result twice (on the H200, run 13, at a 5 ms window; on
a loaded CPU a call of the reference lowering can take longer than 5 ms, hence the wider one)."""
import time

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_LAST = {}


def forward(x, w, r):
    now = time.perf_counter()
    if "y" in _LAST and now - _LAST["t"] < 0.5:
        _LAST["t"] = time.perf_counter()
        return {"y": _LAST["y"]}
    y = gemm(x, w, add_residual, residual=r)["D"]
    _LAST.update(y=y, t=time.perf_counter())
    return {"y": y}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
