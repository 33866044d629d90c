# stage: reference
# expect: out shares memory with A
# task: out_proj_residual
"""Attention output projection plus residual, with D written over the GEMM's own A operand
(through a view of it: an identity check would not see it).  The reference lowering
computes D into a fresh buffer and then poisons `out`, so the CPU tier sees a correct result;
the SM90 kernel stores D tiles into A while other CTAs of the same row block still read A.  The
destination is refused where it shares memory with anything the call reads, in every lowering."""

from coda_agent.primitives import Tile, epilogue, gemm, tile_pass


@epilogue()
def copy(x: Tile):
    return {"D": x}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(attn, Wo, residual):
    if attn.shape[1] != Wo.shape[1]:
        return {"y": gemm(attn, Wo, add_residual, residual=residual)["D"]}
    a = tile_pass(copy, x=attn)["D"]  # a buffer of the program's own, dead after the GEMM
    return {"y": gemm(a, Wo, add_residual, residual=residual, out=a.view(a.shape))["D"]}


def backward(saved, dy):
    return {"dattn": gemm(dy, saved["Wo"].t())["D"], "dWo": gemm(saved["attn"].t(), dy)["D"],
            "dresidual": dy}
