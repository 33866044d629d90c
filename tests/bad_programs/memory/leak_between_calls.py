# stage: performance
# expect: memory
# needs: gpu
# static: off
"""Keeps 8 GiB more of device memory after every GPU call (on the CPU it is honest, so the CPU
stages pass it): the judge's checks run out of room within a stage or two, and the verdict names
memory."""
import torch

from coda_agent.primitives import Tile, epilogue, gemm

_KEPT = []


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    if x.is_cuda:
        _KEPT.append(torch.empty(8 << 30, dtype=torch.uint8, device="cuda"))
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
