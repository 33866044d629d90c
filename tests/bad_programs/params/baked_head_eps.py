# stage: reference
# expect: with params eps=
# task: qk_norm_rope
# The per-head statistic compiled for the task's eps (head_rstd(eps=1e-6)) while the eps of the
# call is ignored: a kernel for one model's eps, passed off as one for every model's.
"""QKV projection + per-head QK-norm + RoPE with the head statistic's eps fixed in the program."""

from coda_agent.primitives import (ColVec, HeadStat, RowVec, cos, epilogue, gemm, head_rstd,
                                   interleave_columns, pack, sin, unpack)


@epilogue(pairs="acc", head_stats={"rstd": head_rstd(eps=1e-6)})
def norm_rope(acc, rstd: HeadStat, gamma: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc * rstd * gamma)
    f, _ = unpack(freq)
    a = pos * f
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


def forward(x, wq, wk, wv, q_gamma, k_gamma, pos, inv_freq, eps):
    nq, d = q_gamma.shape
    freq = interleave_columns(inv_freq, inv_freq)
    q = gemm(x, wq.t(), norm_rope, rstd=d, gamma=q_gamma.view(-1), pos=pos, freq=freq[:nq].view(-1))
    k = gemm(x, wk.t(), norm_rope, rstd=d, gamma=k_gamma.view(-1), pos=pos, freq=freq[nq:].view(-1))
    return {"q": q["D"], "k": k["D"], "v": gemm(x, wv.t())["D"]}
