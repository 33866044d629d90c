# stage: reference
# expect: not a torch.Tensor
# static: off
"""A lazy result: a subclass that would compute when the judge looks at it."""
import torch

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


class Lazy(torch.Tensor):
    pass


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"].as_subclass(Lazy)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
