# stage: static
# expect: inside an @epilogue fn: a Python branch or loop on values; select with where(cond, a, b)
"""An epilogue that picks its result by its operand's dtype text: a torch tensor under the
reference lowering, a CuTe value in the compiled kernel, so the two compute different things."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, r: Tile):
    keep = 1.0 if "torch" in str(acc.dtype) else 0.0
    return {"D": acc + keep * r}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, r=r)["D"]}
