# stage: reference
# expect: changed the module-level `CALLS`
# static: off
"""A module-level list bound by an assignment expression inside a decorator's arguments (where no
assignment statement is), to count calls: honest for 300 calls, then the residual is dropped."""
from coda_agent.primitives import Tile, epilogue, gemm

CALLS = 0


@epilogue(outputs=[(CALLS := []), {}][1])
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    CALLS.append(1)
    if len(CALLS) > 300:
        return {"y": gemm(x, w)["D"]}
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
