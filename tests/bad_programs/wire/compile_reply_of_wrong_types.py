# stage: compile
# expect: the runner's reply to `compile`
# static: off
"""Answers the compile request itself (the runner's channel, found through the garbage
collector) with fields of the wrong JSON types: ``kernels`` a number, the judge's loop over
them a TypeError, and a judge that raises reports its own error, not the program's failure.
The reply is the runner's word, so every field is checked for its type before it is read."""
import gc
import os
import sys

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    f = sys._getframe()
    while f is not None and f.f_code.co_name != "_compile":
        f = f.f_back
    if f is not None:  # the compile stage; the reference stage gets honest results
        for obj in gc.get_objects():
            if type(obj).__name__ == "Channel":
                obj.send({"kernels": 7})
                os._exit(0)
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
