"""LM head + cross-entropy with soft-capped logits (Gemma-2, Gemma-3), one bounded-memory training
step: lm_head_xent's three GEMMs per token chunk, with the cap in the logits GEMM's epilogue and
its derivative in the pass that turns the chunk into dlogits.

    for each chunk of rows:
        c = cap * tanh(x_c @ w^T / cap)   GEMM 1: D = the raw logits chunk in fp32, plus
                                          online_lse and the target logit of c
        loss_c = lse - target_logit       aux xent_loss
        dlogits = (softmax(c) - onehot(target)) * dloss * sech^2(logits / cap)
                                          a tile pass over the chunk, bf16 (0 on padding rows)
        dx[c] = dlogits @ w               GEMM 2, into its slice of dx
        dw   += dlogits^T @ x_c           GEMM 3, reduce-added into the bf16 dw

The logits chunk is kept raw in fp32, and the pass computes the cap and its slope from it: near
a cap of 30 a bf16 rounding moves a logit by up to 1/16 (half a bf16 step there), which the
softmax turns into a 6% change of that token's probability, and the slope of a saturated logit,
sech^2, is lost to cancellation in 1 - (c / cap)^2 of a rounded c.  So the chunk's budget,
LOGITS_BYTES, is twice lm_head_xent's bf16 one for as many rows, and never fewer rows than the
dx GEMM needs to fill the GPU (DX_TILES).
"""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, column_index, concat_rows, epilogue, exp, gemm,
                                   maximum, online_lse, reciprocal, select_col, tile_pass, to_fp32, where, xent_loss,
                                   zeros_like)

# The fp32 logits chunk alive at once, unless DX_TILES needs more rows: 1024 rows of LLaMA-3's
# 128256-token vocabulary, lm_head_xent's chunk.  Each chunk costs its launches' host time (an
# H100's host took 20-40 ms for the 32 chunks of 512 rows at T = 16384) and, with dw, a read and
# write of the whole dw (1 GiB at 8B).
LOGITS_BYTES = 512 * 2**20
# The dx GEMM of a chunk (rows x H, K = V) has (rows / 128) * (H / 128) output tiles, each a long
# K loop: fewer tiles than a Hopper's 132 SMs leave SMs idle for the whole GEMM (an H100 at
# LLaMA-3 1B, 512 rows, 64 tiles: the step ran at 1.97x its plain GEMMs).  So a chunk has rows
# for at least a wave of 128x128 tiles, whatever the budget.
DX_TILES = 128


def soft_cap(y):
    # tanh(y) within 3e-7 relative everywhere on the fast exp and reciprocal.  Below |y| = 0.45,
    # y * (1 + s * P(s)) with s = y^2 (P: a least-squares fit of tanh(y)/y, 7e-8 relative); above,
    # sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (exact at saturation), whose 1 - e cancels
    # below: its 6e-8 absolute error, times a large cap, is most of a small logit's error.  The
    # catalogue's tanh, libdevice's tanhf, keeps more registers live than the logits epilogue's
    # 128x128 pingpong tile holds beside online_lse and select_col (3 spills).
    s = y * y
    e = exp(-2.0 * maximum(y, -y))
    far = (1.0 - e) * reciprocal(1.0 + e)
    p = -0.33333245 + s * (0.1332911 + s * (-0.05333227 + s * 0.017996185))
    return where(s < 0.2025, y + y * s * p, where(y < 0.0, -far, far))


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def capped_logits(acc, cap: Scalar, inv_cap: Scalar):
    # D keeps the raw logit: the pass computes the cap and its slope from it (the slope near
    # saturation is sech^2, which 1 - (c / cap)^2 of a rounded c loses to cancellation)
    c = cap * soft_cap(acc * inv_cap)
    return {"D": acc, "lse": c, "target_logit": c}


@epilogue()
def dcapped(lg: Tile, lse: ColVec, tgt: ColVec, dloss: ColVec, col: RowVec, cap: Scalar, inv_cap: Scalar):
    y = lg * inv_cap
    t = soft_cap(y)
    e = exp(-2.0 * maximum(y, -y))
    r = reciprocal(1.0 + e)
    slope = where(y * y < 0.2025, 1.0 - t * t, 4.0 * e * r * r)  # sech^2(y), each form where it is exact
    p = exp(cap * t - lse) - where(col == tgt, 1.0, 0.0)
    p = where(tgt < 0.0, 0.0, p)  # a padding row (target -100) gets no gradient, as it gets no loss
    return {"D": p * dloss * slope}


def forward(x, w, target, dloss, cap):
    t, v = x.shape[0], w.shape[0]
    wave = 128 * -(-DX_TILES // -(-x.shape[1] // 128))  # rows whose dx GEMM fills a wave
    chunk = min(t, max(wave, LOGITS_BYTES // (4 * v) // 128 * 128))  # whole M tiles within the budget
    col = column_index(v, x.device)
    tgt = to_fp32(target)
    dx = zeros_like(x)
    dw = None
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        x_c, t_c = x[r0:r1], target[r0:r1]
        res = gemm(x_c, w.t(), capped_logits, out_dtype="fp32", target=t_c, cap=cap,
                   inv_cap=1.0 / cap)
        losses.append(xent_loss(res["lse"], res["target_logit"], t_c))
        dl = tile_pass(dcapped, lg=res["D"], lse=res["lse"], tgt=tgt[r0:r1], dloss=dloss[r0:r1], col=col,
                       cap=cap, inv_cap=1.0 / cap, out_dtype="bf16")["D"]
        gemm(dl, w, accumulate_into=dx[r0:r1])
        if dw is None:
            dw = gemm(dl.t(), x_c)["D"]
        else:
            gemm(dl.t(), x_c, accumulate_into=dw)
        del res, dl  # before the next chunk's GEMM allocates its own logits
    return {"loss": concat_rows(losses), "dx": dx, "dw": dw}
