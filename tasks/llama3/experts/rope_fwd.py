"""QKV GEMM + RoPE on adjacent column pairs (2j, 2j+1), angle reduced in the epilogue.

The rotation angle is computed in the epilogue: position (ColVec, fp32, one per
row) times the pair's frequency (RowVec, fp32), exactly the fp32 product a
cos/sin table would be built from, but reading O(T + N) values instead of two
(T, N) tables.  The angle is reduced to [-pi, pi] before the precise sin/cos
(k = round(a / 2pi) with the 1.5 * 2**23 rounding trick, then a - k * 2pi with a
two-part 2pi whose high part times k is exact), so their slow large-argument
path (|a| > ~1e5 rad, long contexts) is never taken.  The per-pair frequencies
(N/2) are duplicated onto both lanes of each pair once per call (an O(N) aux
kernel); the V columns carry frequency 0 (identity)."""

from coda_agent.primitives import ColVec, RowVec, cos, epilogue, gemm, interleave_columns, pack, sin, unpack

INV_2PI = 0.15915494309189535
TWO_PI_HI = 6.28125  # 8 significant bits: k * TWO_PI_HI is exact for |k| < 2**16
TWO_PI_LO = 0.0019353071795864769
ROUND = 12582912.0  # 1.5 * 2**23: (x + ROUND) - ROUND rounds x to an integer in fp32


@epilogue(pairs="acc")
def rope(acc, pos: ColVec, freq: RowVec):
    e, o = unpack(acc)
    f, _ = unpack(freq)
    a = pos * f
    k = (a * INV_2PI + ROUND) - ROUND
    r = (a - k * TWO_PI_HI) - k * TWO_PI_LO
    c = cos(r)
    s = sin(r)
    return {"D": pack(e * c - o * s, e * s + o * c)}


def forward(x, W_qkv, pos, inv_freq):
    f = inv_freq.view(1, -1)
    freq = interleave_columns(f, f).view(-1)
    return {"qkv": gemm(x, W_qkv, rope, pos=pos, freq=freq)["D"]}
