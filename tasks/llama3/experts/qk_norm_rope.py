"""QKV projection + per-head QK-norm + RoPE: one GEMM per projection.

q and k: one GEMM each whose epilogue reads the per-(row, head) inverse RMS of
its own raw accumulator (``head_rstd``: the kernel computes
rsqrt(mean(acc^2 over the head's D columns) + eps) in a pre-pass over the tile
before any store; the head width and the task's eps are given at the call,
``rstd=(D, eps)``), multiplies
by it and by the head's gamma (RowVec: the (heads, D) table viewed flat, one
value per output column) and rotates adjacent pairs (2j, 2j+1) by
pos[t] * inv_freq[head, j] (pos a ColVec, the frequency a RowVec with each
pair's value on both lanes).  v is a plain GEMM.  The three weights are
separate tensors, so one fused QKV GEMM would need a copy of them per call;
three GEMMs over the same x cost the same FLOPs.

sin/cos take the raw angle: the catalogue reduces it by 2*pi (positions reach 1e5).
"""

from coda_agent.primitives import (ColVec, HeadStat, RowVec, cos, epilogue, gemm, head_rstd,
                                   interleave_columns, pack, sin, unpack)


@epilogue(pairs="acc", head_stats={"rstd": head_rstd()})  # eps comes with the head width at the call
def norm_rope(acc, rstd: HeadStat, gamma: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc * rstd * gamma)
    f, _ = unpack(freq)
    a = pos * f  # fp32; sin/cos reduce it by 2*pi themselves (angles reach ~1e5 rad)
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


def forward(x, wq, wk, wv, q_gamma, k_gamma, pos, inv_freq, eps):
    nq, d = q_gamma.shape
    freq = interleave_columns(inv_freq, inv_freq)  # (heads, D): each pair's frequency on both lanes
    q = gemm(x, wq.t(), norm_rope, rstd=(d, eps), gamma=q_gamma.view(-1), pos=pos, freq=freq[:nq].view(-1))
    k = gemm(x, wk.t(), norm_rope, rstd=(d, eps), gamma=k_gamma.view(-1), pos=pos, freq=freq[nq:].view(-1))
    return {"q": q["D"], "k": k["D"], "v": gemm(x, wv.t())["D"]}
