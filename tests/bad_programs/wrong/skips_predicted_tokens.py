# stage: reference
# expect: targets the reference predicts || with fresh inputs with outlier channels || with fresh inputs at other magnitudes
# task: lm_head_xent
"""The LM head's training step sending no gradient through the tokens the model already predicts
fairly well (a loss below log 2: p(target) above one half): drawn uniformly, a target is almost
never the class a row's logits rank first, so no draw held such a row; a trained LM predicts half
its tokens so."""

from coda_agent.primitives import (ColVec, concat_rows, epilogue, gemm, online_lse, select_col, vector_pass, where,
                                   xent_grad_, xent_loss, zeros_like)


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def logits_lse(acc):
    return {"D": acc, "lse": acc, "target_logit": acc}


@epilogue()
def hard_rows_only(lse: ColVec, tl: ColVec, dl: ColVec):
    easy = where(lse - tl < 0.6931, 1.0, 0.0) * where(lse - tl > 0.001, 1.0, 0.0)
    return {"D": dl * (1.0 - easy)}


def forward(x, w, target, dloss):
    res = gemm(x, w.t(), logits_lse, out_dtype="bf16", target=target)
    loss = xent_loss(res["lse"], res["target_logit"], target)
    dl = vector_pass(hard_rows_only, lse=res["lse"], tl=res["target_logit"], dl=dloss)["D"]
    dlogits = xent_grad_(res["D"], res["lse"], target, dl)
    return {"loss": concat_rows([loss]), "dx": gemm(dlogits, w)["D"], "dw": gemm(dlogits.t(), x)["D"]}
