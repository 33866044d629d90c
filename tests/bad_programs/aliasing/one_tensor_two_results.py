# stage: reference
# expect: `dx` shares memory with the result `dattn`: every result must be a tensor of its own (only an upstream gradient may be returned as it is); where two results hold the same values
# task: gpt2/out_proj_residual
"""One tensor returned as two gradients of the same shape: the judge names the fix (each result a
tensor of its own), before any value is compared."""
from coda_agent.primitives import RowVec, Tile, epilogue, gemm, row_sum, tile_pass


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(attn, x, w_o, b_o):
    return {"h": gemm(attn, w_o.t(), bias_residual, b=b_o, x=x)["D"]}


def backward(saved, dh):
    dattn = gemm(dh, saved["w_o"])["D"]
    return {"dattn": dattn, "dw_o": gemm(dh.t(), saved["attn"])["D"],
            "db_o": tile_pass(bias_grad, dy=dh)["db"], "dx": dattn}
