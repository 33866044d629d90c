# stage: performance
# expect: memory
# needs: gpu
# static: off
"""Takes most of the GPU's free memory on its first GPU call and holds it, so that large checks
cannot fit.  The judge sizes its checks to the device's whole memory, so the first one that
needs room (at the latest the performance stage's largest set) runs out of it, and the verdict
names memory."""
import torch

from coda_agent.primitives import Tile, epilogue, gemm

HOG = []


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    if x.is_cuda and not HOG:
        free, _ = torch.cuda.mem_get_info()
        HOG.append(torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda"))
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
