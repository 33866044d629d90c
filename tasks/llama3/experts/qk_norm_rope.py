"""QKV projection + per-head QK-norm + RoPE, in two passes over q and k.

Pass 1, one GEMM per projection: store the raw product (its buffer shape is
reused for the output) and fold each row's squares per N tile.  With
tile_n == D (the head dim) an N tile is exactly one head, so the
col_sum(partials=True) result (T, heads) *is* the per-(row, head) sum of
squares; rms_rstd finishes it.  The partials are per N tile, not per head:
with tile_n a divisor of D a head would span D / tile_n adjacent partials (to
be summed); with any other tile_n (e.g. the default 192 against D = 128) a
partial mixes the tail of one head with the head of the next and the per-head
sums cannot be recovered, hence the explicit config.

Pass 2, per head: the head's D columns again (N = D), with an epilogue that
multiplies by the head's rstd (ColVec), its gamma row (RowVec) and rotates
adjacent pairs by pos * inv_freq (ColVec x RowVec), accumulated into the
head's column slice of a zero buffer.  The angle is reduced to [-pi, pi]
(k = round(a / 2pi) by the 1.5 * 2**23 trick, two-part 2pi) before sin/cos:
positions reach 1e5.
"""

from coda_agent.primitives import (ColVec, RowVec, TileConfig, col_sum, cos, epilogue, gemm,
                                   interleave_columns, pack, rms_rstd, sin, unpack, zeros_like)

INV_2PI = 0.15915494309189535
TWO_PI_HI = 6.28125  # 8 significant bits: k * TWO_PI_HI is exact for |k| < 2**16
TWO_PI_LO = 0.0019353071795864769
ROUND = 12582912.0  # 1.5 * 2**23: (x + ROUND) - ROUND rounds x to an integer in fp32


@epilogue(reductions={"sumsq": col_sum(partials=True)})
def head_sumsq(acc):
    return {"D": acc, "sumsq": acc * acc}


@epilogue(pairs="acc")
def norm_rope(acc, rstd: ColVec, gamma: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc)
    ge, go = unpack(gamma)
    f, _ = unpack(freq)
    a = pos * f
    k = (a * INV_2PI + ROUND) - ROUND
    r = (a - k * TWO_PI_HI) - k * TWO_PI_LO
    c = cos(r)
    s = sin(r)
    e = e * rstd * ge
    o = o * rstd * go
    return {"D": pack(e * c - o * s, e * s + o * c)}


def _norm_rope(x, w, gamma, freq, pos, eps):
    heads, d = gamma.shape
    cfg = TileConfig(tile_n=d, cluster_m=1)  # one N tile == one head
    raw = gemm(x, w.t(), head_sumsq, config=cfg)
    out = zeros_like(raw["D"])
    for hd in range(heads):
        c0 = hd * d
        # One rms_rstd per head: a ColVec must be contiguous on the GPU (quack refuses a
        # strided column slice of the (T, heads) result at launch).
        rstd = rms_rstd(raw["sumsq"][:, hd], d, eps)
        gemm(x, w[c0:c0 + d].t(), norm_rope, config=cfg, accumulate_into=out[:, c0:c0 + d],
             rstd=rstd, gamma=gamma[hd], pos=pos, freq=freq[hd])
    return out


def forward(x, wq, wk, wv, q_gamma, k_gamma, pos, inv_freq, eps):
    nq = q_gamma.shape[0]
    freq = interleave_columns(inv_freq, inv_freq)  # (heads, D): each pair's frequency on both lanes
    return {"q": _norm_rope(x, wq, q_gamma, freq[:nq], pos, eps),
            "k": _norm_rope(x, wk, k_gamma, freq[nq:], pos, eps),
            "v": gemm(x, wv.t())["D"]}
