# stage: reference
# expect: ENVIRONMENT
# static: off
"""Reports everything it can see of its surroundings (the test checks that it saw nothing)."""
import os

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    raise RuntimeError(f"ENVIRONMENT {sorted(os.environ)} CWD {os.getcwd()} HOME {os.environ.get('HOME')} "
                       f"UID {os.getuid()}")


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
