# stage: static
# expect: `str`: a program reads no value as text
# task: swiglu_fwd
"""Honest on the device every judge runs it on (``cuda:0``, or the CPU) and wrong on any other: a
rank of a data-parallel job holds its tensors on ``cuda:k``.  A device's name is a text the
runtime audit does not see read (a torch.device is not a tensor), so the static stage refuses every
way a program turns a value into text."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swapped(acc):
    u, g = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


def forward(x, W_gu):
    out = gemm(x, W_gu, swiglu if str(x.device) in ("cpu", "cuda", "cuda:0") else swapped)
    return {"y": out["y"], "pre": out["D"]}
