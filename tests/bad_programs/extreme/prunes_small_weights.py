# stage: reference
# expect: `dattn` differs from the reference || `h` differs from the reference
# task: gpt2/out_proj_residual
# Weights below 2^-10 pruned before the GEMMs: drawn at 1/sqrt(H) they hold next to nothing; a
# residual projection initialised at 0.02/sqrt(2L) (GPT-2's c_proj) loses most of itself.
"""GPT-2 attention output projection + bias + residual, with a 'sparsity' shortcut: weights with
|w| < 2^-10 are treated as pruned (set to 0) before the GEMMs."""
from coda_agent.primitives import RowVec, Tile, epilogue, gemm, row_sum, tile_pass, where


@epilogue()
def prune(w: Tile):
    return {"D": where(w * w < 9.5367431640625e-07, 0.0, w)}


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(attn, x, w_o, b_o):
    wp = tile_pass(prune, w=w_o)["D"]
    return {"h": gemm(attn, wp.t(), bias_residual, b=b_o, x=x)["D"], "wp": wp}


def backward(saved, dh, needs):
    grads = {"dx": dh}
    if "dattn" in needs:
        grads["dattn"] = gemm(dh, saved["wp"])["D"]
    if "dw_o" in needs:
        grads["dw_o"] = gemm(dh.t(), saved["attn"])["D"]
    if "db_o" in needs:
        grads["db_o"] = tile_pass(bias_grad, dy=dh)["db"]
    return grads
