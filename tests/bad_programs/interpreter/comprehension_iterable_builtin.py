# stage: static
# expect: `getattr`: dynamic code
"""Takes ``getattr`` from a comprehension's first iterable, which Python evaluates in the scope
around the comprehension (where ``getattr`` is the builtin), not in the one its target binds."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    reach = [getattr for getattr in [getattr]][0]
    y = reach(reach(x, "float")(), "__matmul__")(reach(w, "float")())
    return {"y": reach(reach(y, "__add__")(r), "to")(x.dtype)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
