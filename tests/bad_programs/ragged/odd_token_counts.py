# stage: reference
# expect: small+odd (T=
# task: swiglu_fwd
"""Right at every token count that is a multiple of 8, which every named set and the beyond set
hold, and wrong at the others (a program that took its numbers only from the task file's sets)."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu_rough(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": g * u}


def forward(x, W_gu):
    out = gemm(x, W_gu, swiglu if x.shape[0] % 8 == 0 else swiglu_rough)
    return {"y": out["y"], "pre": out["D"]}
