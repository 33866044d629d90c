"""Attention output projection with bias + residual: h = x + attn @ w_o^T + b_o.

Forward: one GEMM whose epilogue adds the bias (RowVec) and the residual
(Tile).  Backward: dattn = dh @ w_o and dw_o = dh^T @ attn are plain GEMMs,
dx = dh needs no kernel, and the bias gradient sum_rows(dh) is one pass over
dh without a GEMM (no GEMM of this task produces dh; in a whole block the
epilogue that writes dh reduces it).

Floor: 3 GEMMs; beyond their operands, the residual read in the forward
epilogue and one read of dh for db_o."""

from coda_agent.primitives import RowVec, Tile, epilogue, gemm, row_sum, tile_pass


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum()})
def bias_grad(dy: Tile):
    return {"db": dy}


def forward(attn, x, w_o, b_o):
    return {"h": gemm(attn, w_o.t(), bias_residual, b=b_o, x=x)["D"]}


def backward(saved, dh, needs):
    grads = {"dx": dh}
    if "dattn" in needs:
        grads["dattn"] = gemm(dh, saved["w_o"])["D"]
    if "dw_o" in needs:  # a frozen weight (LoRA, a frozen base) skips its gradient GEMM
        grads["dw_o"] = gemm(dh.t(), saved["attn"])["D"]
    if "db_o" in needs:
        grads["db_o"] = tile_pass(bias_grad, dy=dh)["db"]
    return grads
