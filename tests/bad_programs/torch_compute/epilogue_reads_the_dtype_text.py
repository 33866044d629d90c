# stage: reference
# expect: an epilogue fn (or a helper it calls) applies `__get__` to its values
# static: off
# task: out_proj_residual
"""the epilogue tells the reference lowering (torch tensors) from the compiled kernel (CuTe
Float32 values) by the text of acc.dtype ("torch.float32" vs a cutlass type), with no tensor op:
it adds the residual only under the reference lowering; the sm_90a kernel drops it."""

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": {True: acc + residual, False: acc}["torch" in str(acc.dtype)]}


def forward(attn, Wo, residual):
    return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}


def backward(saved, dy, needs):
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
