# stage: static
# expect: attribute `.gi_frame` on a non-catalogue object
"""The escape the flat name list let through: `fr` is a float from math at module level, so every
later `fr.x` looked like a catalogue access; rebinding `fr` step by step walks the frames."""
from math import e as fr

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    fr = (t for t in ())
    fr = fr.gi_frame
    fr = fr.f_back
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
