# stage: reference
# expect: at other magnitudes || wrong as a whole
# task: swiglu_fwd
"""Gate/up GEMM + SwiGLU with values below 0.01 flushed to zero: a tensor's tolerance follows its
largest values, so at unit scale the flushed ones hide under it; activations at a small scale
lose everything."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack, where


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    y = silu(g) * u
    return {"D": pack(where(g * g < 0.0001, 0.0, g), where(u * u < 0.0001, 0.0, u)),
            "y": where(y * y < 0.0001, 0.0, y)}


def forward(x, W_gu):
    out = gemm(x, W_gu, swiglu)
    return {"y": out["y"], "pre": out["D"]}
