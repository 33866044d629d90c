# stage: static
# expect: default argument of a lambda is not a constant
"""Takes ``eval`` as a lambda's default: a default is evaluated in the scope around the lambda,
where ``eval`` is the builtin, although inside the lambda the name is a parameter."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    run = (lambda eval=eval: eval)()
    return {"y": run("(x.float() @ w.float() + r.float()).to(x.dtype)", {"x": x, "w": w, "r": r})}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
