# stage: reference
# expect: PyTorch compute in the program at line 25 (`__getitem__`
# task: lm_head_xent_fwd
"""Reads the int targets into Python without an operator: ``target[i]`` is a free view, and
``w[:t]`` with a 0-d tensor bound turns the bound into a size inside the free slice, so
``len(w[:target[i]])`` is the target.  With them the program branches on the data: right when
some targets are ignored (-100) and not all are even, as in the judge's draws; wrong otherwise."""
from coda_agent.primitives import epilogue, gemm, online_lse, select_col, xent_loss


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def lse_and_target(acc):
    return {"lse": acc, "target_logit": acc}


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def half_lse(acc):
    return {"lse": acc * 0.5, "target_logit": acc}


def forward(x, w, target):
    vocab = len(w)
    values = []
    for i in range(len(target)):
        values.append(len(w[:target[i]]))
    ignored = sum(1 for v in values if v == vocab - 100)
    even = sum(1 for v in values if v % 2 == 0)
    epi = lse_and_target if ignored > 0 and even < len(values) else half_lse
    stats = gemm(x, w.t(), epi, target=target)
    return {"loss": xent_loss(stats["lse"], stats["target_logit"], target), "lse": stats["lse"]}
