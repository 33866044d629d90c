# stage: reference
# expect: a runner may write
# static: off
"""Takes the disk's inodes instead of its blocks: empty files, which no byte count sees, by the
hundred thousand in its scratch directory."""
import os

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    for d in range(1000):
        os.mkdir(f"d{d}")
        for i in range(1000):
            open(f"d{d}/{i}", "w").close()
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
