# stage: performance
# expect: correct but slow
# needs: gpu
# static: off
"""Half its work on a side stream the timing events never wait for: three redundant GEMMs (on
CUDA only: a CPU stage's runner on a GPU host cannot reach the device)."""
import torch

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_SIDE = []


def forward(x, w, r):
    if not x.is_cuda:
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    _SIDE[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_SIDE[0]):
        for _ in range(3):
            gemm(x, w, add_residual, residual=r)
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
