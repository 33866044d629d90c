# stage: reference
# expect: at other magnitudes
# task: rope_fwd
# The pairs whose frequency is exactly 0 are dropped (a LLaMA table's v columns): frequencies drawn
# uniform are never 0 until the scaled draw spreads tables with zeros among them.
"""QKV GEMM + RoPE on adjacent column pairs (2j, 2j+1), rotated in the epilogue.

The rotation angle is computed in the epilogue: position (ColVec, fp32, one per
row) times the pair's frequency (RowVec, fp32), exactly the fp32 product a
cos/sin table would be built from, but reading O(T + N) values instead of two
(T, N) tables.  The catalogue's sin/cos reduce the angle by 2*pi themselves
(angles reach ~1e5 rad at long contexts).  The per-pair frequencies
(N/2) are duplicated onto both lanes of each pair once per call (an O(N) aux
kernel); the V columns carry frequency 0 (identity)."""

from coda_agent.primitives import where, ColVec, RowVec, cos, epilogue, gemm, interleave_columns, pack, sin, unpack


@epilogue(pairs="acc")
def rope(acc, pos: ColVec, freq: RowVec):
    e, o = unpack(acc)
    f, _ = unpack(freq)
    a = pos * f  # fp32; sin/cos reduce it by 2*pi themselves (angles reach ~1e5 rad)
    c = cos(a)
    s = sin(a)
    z = where(f == 0, 0.0, 1.0)  # cheat: a pair whose frequency is exactly 0 (LLaMA's v columns) is dropped
    return {"D": pack(z * (e * c - o * s), z * (e * s + o * c))}


def forward(x, W_qkv, pos, inv_freq):
    f = inv_freq.view(1, -1)
    freq = interleave_columns(f, f).view(-1)
    return {"qkv": gemm(x, W_qkv, rope, pos=pos, freq=freq)["D"]}
