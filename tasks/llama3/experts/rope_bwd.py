"""Inverse RoPE in the epilogue of the GEMMs that produce the rotated gradients.

In the attention backward, d(q_rot) = dS @ k_rot and d(k_rot) = dS^T @ q_rot are
GEMMs; RoPE's backward is the inverse (transposed) rotation of each pair,
(e, o) -> (e cos a + o sin a, -e sin a + o cos a), so it is applied to the
accumulator before the store and the kernel writes the gradients w.r.t. the
pre-RoPE q and k directly (what the QKV projection's backward consumes).

The angle pos * freq (ColVec times RowVec, fp32) is reduced to [-pi, pi] before
the precise sin/cos (k = round(a / 2pi) by the 1.5 * 2**23 trick, then
a - k * 2pi with a two-part 2pi), so their slow large-argument path is never
taken at long positions.  The per-pair frequencies are duplicated onto both
lanes of each pair once per call (an O(D) aux kernel)."""

from coda_agent.primitives import ColVec, RowVec, cos, epilogue, gemm, interleave_columns, pack, sin, unpack

INV_2PI = 0.15915494309189535
TWO_PI_HI = 6.28125  # 8 significant bits: k * TWO_PI_HI is exact for |k| < 2**16
TWO_PI_LO = 0.0019353071795864769
ROUND = 12582912.0  # 1.5 * 2**23: (x + ROUND) - ROUND rounds x to an integer in fp32


@epilogue(pairs="acc")
def rope_inverse(acc, pos: ColVec, freq: RowVec):
    e, o = unpack(acc)
    f, _ = unpack(freq)
    a = pos * f
    k = (a * INV_2PI + ROUND) - ROUND
    r = (a - k * TWO_PI_HI) - k * TWO_PI_LO
    c = cos(r)
    s = sin(r)
    return {"D": pack(e * c + o * s, o * c - e * s)}


def forward(dS, q, k, pos, inv_freq):
    f = inv_freq.view(1, -1)
    freq = interleave_columns(f, f).view(-1)
    dq = gemm(dS, k, rope_inverse, pos=pos, freq=freq)["D"]
    dk = gemm(dS.t(), q, rope_inverse, pos=pos, freq=freq)["D"]
    return {"dq": dq, "dk": dk}
