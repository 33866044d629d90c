"""Final LayerNorm + tied LM head + cross-entropy, forward and backward as one
bounded-memory training step: three GEMMs per token chunk, no logits recompute.

LN(h) is materialized once (row_stats, then normalize_rows): it is both the
logits GEMM's A operand and the dwte GEMM's B operand, so the rank-1 form
would save nothing here.  dloss is an input, so each chunk's gradient is
formed while its logits are still in memory (as in the LLaMA suite's
lm_head_xent):

    for each chunk of rows:
        logits = ln_c @ wte^T         GEMM 1: the bf16 logits chunk, online_lse
                                      and the target logit
        loss_c = lse - target_logit   aux xent_loss
        logits -> dlogits             aux xent_grad_, in place
        dln[c] = dlogits @ wte        GEMM 2, into its slice of dln; the epilogue
                                      reduces s1 = sum_cols(gamma * dln) and
                                      s2 = sum_cols(gamma * dln * xhat): the chunk's
                                      rows are whole (K = V), so the sums are final
        dwte  += dlogits^T @ ln_c     GEMM 3, reduce-added into the bf16 dwte

then the LayerNorm backward dh = rstd * (gamma * dln - (s1 + xhat * s2) / H),
with per-row coefficients computed once per row (vector_pass), is one pass
over dln and h without a GEMM that also reduces dgamma and dbeta.

Floor: 3 GEMMs per chunk as in the LLaMA suite's step; beyond them, a read of h
for the statistics, a read of h and a write of LN(h), the read of h in GEMM 2's
epilogue and the final pass (read dln and h, write dh).  One (chunk, V) logits
buffer is alive at a time, sized by LOGITS_BYTES."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, concat_rows, epilogue, gemm,
                                   normalize_rows, online_lse, row_stats, row_sum, select_col, tile_pass,
                                   vector_pass, xent_grad_, xent_loss, zeros_like)

LOGITS_BYTES = 256 * 2**20  # the bf16 logits chunk alive at once


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def logits_lse(acc):
    return {"D": acc, "lse": acc, "target_logit": acc}


@epilogue(reductions={"s1": col_sum(), "s2": col_sum()})
def ln_grad_stats(acc, h: Tile, mean: ColVec, rstd: ColVec, gamma: RowVec):
    gg = gamma * acc
    return {"D": acc, "s1": gg, "s2": gg * (h - mean) * rstd}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    # xhat = rstd * h + r0;  dh = rstd * gamma * dln + p * h + q
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(reductions={"dgamma": row_sum(), "dbeta": row_sum()})
def ln_backward(dln: Tile, h: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec):
    return {"D": rstd * gamma * dln + p * h + q, "dgamma": dln * (rstd * h + r0), "dbeta": dln}


def forward(h, gamma, beta, wte, target, dloss, eps):
    t, v = h.shape[0], wte.shape[0]
    stats = row_stats(h, eps)
    mean, rstd = stats["mean"], stats["rstd"]
    ln = normalize_rows(h, rstd, gamma, mean=mean, beta=beta)
    # Rows a multiple of 128 (whole M tiles) within LOGITS_BYTES; a problem whose
    # logits fit the budget runs as one chunk (dwte is then one GEMM, rounded once).
    chunk = min(t, max(128, LOGITS_BYTES // (2 * v) // 128 * 128))
    dln = zeros_like(h)
    dwte = None
    losses, s1, s2 = [], [], []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        ln_c, t_c = ln[r0:r1], target[r0:r1]
        res = gemm(ln_c, wte.t(), logits_lse, out_dtype="bf16", target=t_c)
        losses.append(xent_loss(res["lse"], res["target_logit"], t_c))
        dlogits = xent_grad_(res["D"], res["lse"], t_c, dloss[r0:r1])
        g = gemm(dlogits, wte, ln_grad_stats, accumulate_into=dln[r0:r1], h=h[r0:r1], mean=mean[r0:r1],
                 rstd=rstd[r0:r1], gamma=gamma)
        s1.append(g["s1"])
        s2.append(g["s2"])
        if dwte is None:
            dwte = gemm(dlogits.t(), ln_c)["D"]
        else:
            gemm(dlogits.t(), ln_c, accumulate_into=dwte)
        # Drop this chunk's logits before the next chunk's GEMM allocates its own.
        del res, dlogits, g
    k = vector_pass(ln_grad_coeffs, mean=mean, rstd=rstd, s1=concat_rows(s1), s2=concat_rows(s2),
                    inv_dim=1.0 / h.shape[1])
    d = tile_pass(ln_backward, dln=dln, h=h, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"], gamma=gamma)
    return {"loss": concat_rows(losses), "dh": d["D"], "dgamma": d["dgamma"], "dbeta": d["dbeta"],
            "dwte": dwte}
