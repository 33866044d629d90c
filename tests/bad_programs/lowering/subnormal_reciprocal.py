# stage: reference
# expect: differs from the reference
# task: out_proj_residual
"""The residual kept only where IEEE arithmetic runs it: reciprocal(1e38) is a subnormal greater
than 0 in PyTorch and 0 on the GPU (MUFU's rcp.approx.ftz flushes subnormal results).  Pure
epilogue math, no text and no attribute, so no static rule sees it; the reference lowering flushes
as MUFU does, so the CPU sees the residual dropped, as the GPU would."""

from coda_agent.primitives import Tile, epilogue, gemm, reciprocal, where

BIG = 1.0e38


@epilogue()
def add_residual(acc, residual: Tile):
    keep = where(reciprocal(acc * 0.0 + BIG) > 0.0, 1.0, 0.0)
    return {"D": acc + keep * residual}


def forward(attn, Wo, residual):
    return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}


def backward(saved, dy, needs):
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
