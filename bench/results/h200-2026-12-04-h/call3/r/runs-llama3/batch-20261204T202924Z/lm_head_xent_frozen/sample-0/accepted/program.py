"""LM head + cross-entropy with a frozen head: lm_head_xent's step less its
weight gradient, two GEMMs per token chunk.

    for each chunk of rows:
        logits = x_c @ w^T              GEMM 1: D = the bf16 logits chunk, plus
                                        online_lse and the target logit
        loss_c = lse - target_logit     aux xent_loss
        logits -> dlogits               aux xent_grad_, in place
        dx[c] = dlogits @ w             GEMM 2, into its slice of dx

The chunk budget is lm_head_xent's (LOGITS_BYTES, measured there): one
(chunk, V) bf16 logits buffer alive at a time.
"""

from coda_agent.primitives import concat_rows, epilogue, gemm, online_lse, select_col, xent_grad_, xent_loss, zeros_like

LOGITS_BYTES = 256 * 2**20  # the bf16 logits chunk alive at once


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def logits_lse(acc):
    return {"D": acc, "lse": acc, "target_logit": acc}


def forward(x, w, target, dloss):
    t, v = x.shape[0], w.shape[0]
    chunk = min(t, max(128, LOGITS_BYTES // (2 * v) // 128 * 128))  # whole M tiles within the budget
    dx = zeros_like(x)
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        t_c = target[r0:r1]
        res = gemm(x[r0:r1], w.t(), logits_lse, out_dtype="bf16", target=t_c)
        losses.append(xent_loss(res["lse"], res["target_logit"], t_c))
        dlogits = xent_grad_(res["D"], res["lse"], t_c, dloss[r0:r1])
        gemm(dlogits, w, accumulate_into=dx[r0:r1])
        del res, dlogits  # before the next chunk's GEMM allocates its own logits
    return {"loss": concat_rows(losses), "dx": dx}
