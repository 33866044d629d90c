"""LM head + cross-entropy with soft-capped logits (Gemma-2, Gemma-3), one bounded-memory training
step: lm_head_xent's three GEMMs per token chunk, with the cap in the logits GEMM's epilogue and
its derivative in the pass that turns the chunk into dlogits.

    for each chunk of rows:
        c = cap * tanh(x_c @ w^T / cap)   GEMM 1: D = the capped logits chunk in fp32, plus
                                          online_lse and the target logit of c
        loss_c = lse - target_logit       aux xent_loss
        dlogits = (softmax(c) - onehot(target)) * dloss * (1 - (c / cap)^2)
                                          a tile pass over the chunk, bf16 (0 on padding rows)
        dx[c] = dlogits @ w               GEMM 2, into its slice of dx
        dw   += dlogits^T @ x_c           GEMM 3, reduce-added into the bf16 dw

The capped logits are kept in fp32: near a cap of 30 a bf16 rounding moves a logit by up to 1/16
(half a bf16 step there), which the softmax turns into a 6% change of that token's probability.  So the chunk's budget,
LOGITS_BYTES, holds half as many rows as lm_head_xent's bf16 chunk.
"""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, column_index, concat_rows, epilogue, exp, gemm,
                                   online_lse, reciprocal, select_col, tile_pass, to_fp32, where, xent_loss, zeros_like)

LOGITS_BYTES = 256 * 2**20  # the fp32 capped-logits chunk alive at once


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def capped_logits(acc, cap: Scalar, two_inv_cap: Scalar):
    # cap * tanh(acc / cap) as cap - 2 cap / (exp(2 acc / cap) + 1): exact at both saturations (exp
    # gives inf or 0) and within cap * 1e-7 everywhere, all a logit needs, on the fast exp and
    # reciprocal; the catalogue's tanh, libdevice's tanhf, keeps more registers live than this
    # epilogue's 128x128 pingpong tile holds beside online_lse and select_col (3 spills)
    c = cap - 2.0 * cap * reciprocal(exp(acc * two_inv_cap) + 1.0)
    return {"D": c, "lse": c, "target_logit": c}


@epilogue()
def dcapped(lg: Tile, lse: ColVec, tgt: ColVec, dloss: ColVec, col: RowVec, inv_cap: Scalar):
    t = lg * inv_cap
    p = exp(lg - lse) - where(col == tgt, 1.0, 0.0)
    p = where(tgt < 0.0, 0.0, p)  # a padding row (target -100) gets no gradient, as it gets no loss
    return {"D": p * dloss * (1.0 - t * t)}


def forward(x, w, target, dloss, cap):
    t, v = x.shape[0], w.shape[0]
    chunk = min(t, max(128, LOGITS_BYTES // (4 * v) // 128 * 128))  # whole M tiles within the budget
    col = column_index(v, x.device)
    tgt = to_fp32(target)
    dx = zeros_like(x)
    dw = None
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        x_c, t_c = x[r0:r1], target[r0:r1]
        res = gemm(x_c, w.t(), capped_logits, out_dtype="fp32", target=t_c, cap=cap,
                   two_inv_cap=2.0 / cap)
        losses.append(xent_loss(res["lse"], res["target_logit"], t_c))
        dl = tile_pass(dcapped, lg=res["D"], lse=res["lse"], tgt=tgt[r0:r1], dloss=dloss[r0:r1], col=col,
                       inv_cap=1.0 / cap, out_dtype="bf16")["D"]
        gemm(dl, w, accumulate_into=dx[r0:r1])
        if dw is None:
            dw = gemm(dl.t(), x_c)["D"]
        else:
            gemm(dl.t(), x_c, accumulate_into=dw)
        del res, dl  # before the next chunk's GEMM allocates its own logits
    return {"loss": concat_rows(losses), "dx": dx, "dw": dw}
