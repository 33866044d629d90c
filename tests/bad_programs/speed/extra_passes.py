# stage: performance
# expect: correct but slow
# needs: gpu
"""Right, but through a second GEMM and an auxiliary add instead of the epilogue."""
from coda_agent.primitives import add, epilogue, gemm


@epilogue()
def identity(acc):
    return {"D": acc}


def forward(x, w, r):
    y = gemm(x, w, identity)["D"]
    for _ in range(3):
        y = gemm(x, w, identity)["D"]
    return {"y": add(y, r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
