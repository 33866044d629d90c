# stage: reference
# expect: small+short (T=
# task: swiglu_fwd
"""A decode path: right at every token count the task's sets and the beyond and odd sets hold (256
and more, or odd), and wrong at a short aligned batch (a few decode steps, a short prompt), where it
takes another route whose pair lanes are swapped."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu_short(acc):
    u, g = unpack(acc)
    return {"D": pack(u, g), "y": silu(g) * u}


def forward(x, W_gu):
    t = x.shape[0]
    out = gemm(x, W_gu, swiglu_short if t < 256 and t % 8 == 0 else swiglu)
    return {"y": out["y"], "pre": out["D"]}
