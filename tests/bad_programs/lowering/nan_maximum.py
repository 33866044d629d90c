# stage: reference
# expect: differs from the reference
# task: out_proj_residual
"""The residual kept only where maximum propagates a NaN: torch.maximum(nan, 0) is NaN, the GPU's
FMNMX gives 0 (IEEE maxNum).  The NaN is made and consumed inside the epilogue, so no output
shows it; the reference lowering's maximum is maxNum too, so the CPU sees the residual dropped."""

from coda_agent.primitives import Tile, epilogue, gemm, maximum, sqrt, where


@epilogue()
def add_residual(acc, residual: Tile):
    nan = sqrt(acc * 0.0 - 1.0)
    drop = where(maximum(nan, 0.0) == 0.0, 1.0, 0.0)
    return {"D": acc + (1.0 - drop) * residual}


def forward(attn, Wo, residual):
    return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}


def backward(saved, dy, needs):
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
