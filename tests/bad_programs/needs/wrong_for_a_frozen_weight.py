# stage: reference
# expect: backward called with needs=['dr', 'dx']
# A backward right for the whole gradient set that halves dx when w is frozen: the checks of the
# smaller sets a caller may ask for catch what the whole-set check cannot see.
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue()
def half(acc):
    return {"D": acc * 0.5}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy, needs):
    if "dw" in needs:
        return {"dx": gemm(dy, saved["w"].t())["D"], "dw": gemm(saved["x"].t(), dy)["D"], "dr": dy}
    return {"dx": gemm(dy, saved["w"].t(), half)["D"], "dr": dy}
