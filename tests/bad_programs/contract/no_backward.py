# stage: static
# expect: define `def backward(saved, dy)`
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}

