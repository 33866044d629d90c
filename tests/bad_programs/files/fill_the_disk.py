# stage: reference
# expect: a runner may write
# static: off
"""Fills its kernel cache, which outlives the check, with files of a GiB each (the most one file
may hold), until the disk is full: every later write of the machine (the verdict cache, run
directories, an eval's results) would fail.  The judge adds up what a runner's writable
directories hold and kills it past a bound."""
import os

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    block = b"\x01" * (16 << 20)
    for i in range(64):
        with open(os.path.join("kernels", f"fill-{i}.bin"), "wb") as f:
            for _ in range(64):
                f.write(block)
                f.flush()
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
