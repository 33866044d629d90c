"""Attention output projection + residual add: y = attn @ Wo + residual.

Forward: one GEMM whose epilogue loads the residual tile and adds it to the
accumulator.  Backward: dattn = dy @ Wo^T and dWo = attn^T @ dy (plain GEMMs);
the residual's gradient is dy itself (no kernel at all).  A frozen Wo (LoRA, a
frozen base: ``needs`` lacks dWo) skips its GEMM."""

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(attn, Wo, residual):
    return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}


def backward(saved, dy, needs):
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
