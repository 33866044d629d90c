# stage: reference
# expect: all zeros
# static: off
"""Nests 1500 directories in its scratch directory and in its kernel cache, then ages the cache
so that the next judge to start prunes it: shutil.rmtree recursed once per level and raised
RecursionError in the judge, ending it after this check and at the start of every judge on the
machine after it.  The judge's own removal (trees.remove_tree) takes any tree."""
import os

from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def _nest(top, depth):
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def forward(x, w, r):
    if not os.path.exists("d"):
        _nest(".", 1500)
        kernels = os.path.realpath("kernels")
        os.mkdir(os.path.join(kernels, "n"))
        _nest(os.path.join(kernels, "n"), 1500)
        os.utime(kernels, (0, 0))
    return {"y": zeros_like(r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
