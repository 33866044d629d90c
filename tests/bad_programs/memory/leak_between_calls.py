# stage: launch_audit
# expect: `empty`
# needs: gpu
# static: off
"""Keeps 8 GiB more of device memory after every GPU call (on the CPU it is honest, so the CPU
stages pass it).  An allocation in every call is PyTorch work in the program's own code, which
the launch audit's profile shows (the H200, run 12: rejected there, naming `empty`), before the
checks would run out of room."""
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
