# stage: reference
# expect: `dw` is fp16; the task declares bf16 or fp32
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy, out_dtype="fp16")["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
