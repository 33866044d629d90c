"""Inverse RoPE in the epilogue of the GEMMs that produce the rotated gradients.

In the attention backward, d(q_rot) = dS @ k_rot and d(k_rot) = dS^T @ q_rot are
GEMMs; RoPE's backward is the inverse (transposed) rotation of each pair,
(e, o) -> (e cos a + o sin a, -e sin a + o cos a), so it is applied to the
accumulator before the store and the kernel writes the gradients w.r.t. the
pre-RoPE q and k directly (what the QKV projection's backward consumes).

The angle pos * freq (ColVec times RowVec, fp32) goes straight to the
catalogue's sin/cos, which reduce it by 2*pi before the fast hardware path, so
long positions stay accurate.  The per-pair frequencies are duplicated onto both
lanes of each pair once per call (an O(D) aux kernel)."""

from coda_agent.primitives import ColVec, RowVec, cos, epilogue, gemm, interleave_columns, pack, sin, unpack


@epilogue(pairs="acc")
def rope_inverse(acc, pos: ColVec, freq: RowVec):
    e, o = unpack(acc)
    f, _ = unpack(freq)
    a = pos * f  # fp32; sin/cos reduce it by 2*pi themselves (angles reach ~1e5 rad)
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c + o * s, o * c - e * s)}


def forward(dS, q, k, pos, inv_freq):
    f = inv_freq.view(1, -1)
    freq = interleave_columns(f, f).view(-1)
    dq = gemm(dS, k, rope_inverse, pos=pos, freq=freq)["D"]
    dk = gemm(dS.t(), q, rope_inverse, pos=pos, freq=freq)["D"]
    return {"dq": dq, "dk": dk}
