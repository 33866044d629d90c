"""LM head + cross-entropy forward: one logits GEMM that never writes the logits.

The epilogue folds every accumulator element into two per-row statistics: the
online log-sum-exp across all vocabulary tiles and the logit at the row's
target column.  No "D" is returned, so no (T, V) tensor is stored; xent_loss
finishes loss = lse - target_logit (an O(T) aux kernel).
"""

from coda_agent.primitives import epilogue, gemm, online_lse, select_col, xent_loss


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def lse_and_target(acc):
    return {"lse": acc, "target_logit": acc}


def forward(x, w, target):
    stats = gemm(x, w.t(), lse_and_target, target=target)
    loss = xent_loss(stats["lse"], stats["target_logit"], target)
    return {"loss": loss, "lse": stats["lse"]}
