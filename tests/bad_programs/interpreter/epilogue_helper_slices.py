# stage: static
# expect: inside `first_half`, which the @epilogue fn `add_residual` calls: indexing
"""An epilogue helper that indexes its value: a tile's element or a slice exists only under the
reference lowering, where the fn runs on whole host tensors."""
from coda_agent.primitives import Tile, epilogue, gemm


def first_half(v):
    return v[: len(v) // 2]


@epilogue()
def add_residual(acc, r: Tile):
    return {"D": acc + first_half(r)}


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, r=r)["D"]}
