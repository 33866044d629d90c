# stage: reference
# expect: PyTorch compute in the program at line
from coda_agent.primitives import gemm


def forward(x, w, r):
    return {"y": gemm(x, w)["D"] + r}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}

