"""Gate/up GEMM + SwiGLU.

W_gu's columns are interleaved [g0, u0, g1, u1, ...], so adjacent accumulator
columns are one (gate, up) Pair: the epilogue stores the pre-activation at full
width (for the backward) and silu(g) * u at half width."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


def forward(x, W_gu):
    out = gemm(x, W_gu, swiglu)
    return {"y": out["y"], "pre": out["D"]}
