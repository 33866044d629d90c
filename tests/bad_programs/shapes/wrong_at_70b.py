# stage: correctness
# expect: llama3-70b
# needs: gpu
# task: out_proj_residual
"""Skips the residual at the LLaMA-3 70B width only, a set a fixed list of checks never reached."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(attn, Wo, residual):
    if attn.shape[1] == 8192:
        return {"y": gemm(attn, Wo)["D"]}
    return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}


def backward(saved, dy):
    dattn = gemm(dy, saved["Wo"].t())["D"]
    dWo = gemm(saved["attn"].t(), dy)["D"]
    return {"dattn": dattn, "dWo": dWo, "dresidual": dy}
