# stage: reference
# expect: backward called with needs=['dw']
# Right whenever dx is asked for; when only the weight trains (a frozen input, e.g. under frozen
# embeddings) its gradient is scaled.
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue()
def double(acc):
    return {"D": acc * 2.0}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy, needs):
    grads = {}
    if "dx" in needs:
        grads["dx"] = gemm(dy, saved["w"].t())["D"]
        grads["dw"] = gemm(saved["x"].t(), dy)["D"]
    else:
        grads["dw"] = gemm(saved["x"].t(), dy, double)["D"]
    if "dr" in needs:
        grads["dr"] = dy
    return grads
