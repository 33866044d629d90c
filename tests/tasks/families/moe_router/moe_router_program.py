"""A MoE router for any expert count: probs = softmax(x @ w_r^T) in fp32, and its backward.

A GEMM's rows must be multiples of 16 bytes, and 60 experts are not: the weight is padded
with zero rows to a multiple of 8 (``pad``), whose logits the epilogue masks to -1e30 so the
online log-sum-exp skips them; the tile pass reads back the first E columns.  The backward
folds s = sum_e p_e dp_e per row, writes dlogits = p (dp - s) in bf16 over the padded width
(its padding columns are 0), and runs dx = dlogits @ w_pad and dw = dlogits^T @ x, keeping
dw's first E rows.
"""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, column_index, epilogue, exp, gemm,
                                   online_lse, pad, tile_pass, where)


@epilogue(reductions={"lse": online_lse()})
def logits_lse(acc, col: RowVec, experts: Scalar):
    lg = where(col < experts, acc, -1.0e30)
    return {"D": lg, "lse": lg}


@epilogue()
def softmax_rows(lg: Tile, lse: ColVec):
    return {"D": exp(lg - lse)}


@epilogue(reductions={"s": col_sum()})
def dot_rows(p: Tile, dp: Tile):
    return {"s": p * dp}


@epilogue()
def dsoftmax(p: Tile, dp: Tile, s: ColVec):
    return {"D": p * (dp - s)}


def forward(x, w_r):
    e = w_r.shape[0]
    w_pad = pad(w_r, rows=(e + 7) // 8 * 8)
    r = gemm(x, w_pad.t(), logits_lse, out_dtype="fp32", col=column_index(w_pad.shape[0], x.device),
             experts=float(e))
    probs = tile_pass(softmax_rows, lg=r["D"][:, :e], lse=r["lse"])["D"]
    return {"probs": probs, "w_pad": w_pad}


def backward(saved, dprobs):
    p, w_pad = saved["probs"], saved["w_pad"]
    width = w_pad.shape[0]
    s = tile_pass(dot_rows, p=p, dp=dprobs)["s"]
    dl = tile_pass(dsoftmax, p=pad(p, cols=width), dp=pad(dprobs, cols=width), s=s, out_dtype="bf16")["D"]
    return {"dx": gemm(dl, w_pad)["D"], "dw_r": gemm(dl.t(), saved["x"])["D"][:p.shape[1]]}
