# stage: reference
# expect: lacks ['dr'] (called with needs=['dr', 'dx']
# Asked for less, it returns less than it was asked for.
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy, needs):
    grads = {"dx": gemm(dy, saved["w"].t())["D"]}
    if "dw" in needs:
        grads["dw"] = gemm(saved["x"].t(), dy)["D"]
        grads["dr"] = dy
    return grads
