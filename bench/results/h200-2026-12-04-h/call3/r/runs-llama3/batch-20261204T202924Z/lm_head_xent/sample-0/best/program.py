"""LM head + cross-entropy, forward and backward as one bounded-memory training
step: three GEMMs per token chunk, no logits recompute.

dloss (the per-row weight of each loss, 1/T for a mean) is an input, so the
gradient can be formed while the logits chunk is still in memory:

    for each chunk of rows:
        logits = x_c @ w^T              GEMM 1: D = the bf16 logits chunk, plus
                                        online_lse and the target logit
        loss_c = lse - target_logit     aux xent_loss
        logits -> dlogits               aux xent_grad_, in place:
                                        (softmax - onehot) * dloss
        dx[c] = dlogits @ w             GEMM 2, into its slice of dx
        dw   += dlogits^T @ x_c         GEMM 3, reduce-added into the bf16 dw

Only one (chunk, V) logits buffer exists at a time, sized by LOGITS_BYTES:
1024 rows at V = 128256 (250 MiB).  Beyond that the step holds only its
outputs, dx and dw in bf16 (0.49 GiB at LLaMA-3 1B, the largest term): dw is
summed across chunks in bf16 by the reduce-add store, 1.1-1.3x the bf16
reference's error at 1B (bench/results/h200-2026-11-29-d, lm_head_bf16_dw).
The budget is the fastest measured with the bf16 dw (H200, LLaMA-3 1B, the
first of the sweeps in bench/results/h200-2026-11-29-d/lm-head-bf16/): 37.4 ms
and 0.80 GiB peak at 256 MiB, 38.1 ms and 1.05 GiB at 512 MiB.  (With an fp32
dw, every chunk re-reads and rewrites 1 GiB of it and 512 MiB is fastest:
37.0 ms, 1.54 GiB.)
"""

from coda_agent.primitives import (concat_rows, epilogue, gemm, online_lse, select_col, xent_grad_,
                                   xent_loss, zeros_like)

LOGITS_BYTES = 256 * 2**20  # the bf16 logits chunk alive at once


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def logits_lse(acc):
    return {"D": acc, "lse": acc, "target_logit": acc}


def forward(x, w, target, dloss):
    t, v = x.shape[0], w.shape[0]
    # Rows a multiple of 128 (whole M tiles) within LOGITS_BYTES; a problem whose
    # logits fit the budget runs as one chunk (dw is then one GEMM, rounded once).
    chunk = min(t, max(128, LOGITS_BYTES // (2 * v) // 128 * 128))
    dx = zeros_like(x)
    dw = None
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        x_c = x[r0:r1]
        t_c = target[r0:r1]
        res = gemm(x_c, w.t(), logits_lse, out_dtype="bf16", target=t_c)
        losses.append(xent_loss(res["lse"], res["target_logit"], t_c))
        dlogits = xent_grad_(res["D"], res["lse"], t_c, dloss[r0:r1])
        gemm(dlogits, w, accumulate_into=dx[r0:r1])
        if dw is None:
            dw = gemm(dlogits.t(), x_c)["D"]
        else:
            gemm(dlogits.t(), x_c, accumulate_into=dw)
        # Drop this chunk's logits before the next chunk's GEMM allocates its own:
        # otherwise two chunks are live at once (measured on the H200: 3.0 GiB peak
        # instead of 2.0 at LLaMA-3 1B).
        del res, dlogits
    return {"loss": concat_rows(losses), "dx": dx, "dw": dw}
