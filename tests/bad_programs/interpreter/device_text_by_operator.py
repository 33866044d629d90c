# stage: static
# expect: `.device` is read only as an argument of a catalogue call
# task: swiglu_fwd
"""Honest on the devices a judge runs it on (``cpu``, ``cuda:0``) and wrong on a data-parallel
rank's ``cuda:1``: the device's name made text by ``%`` with a format string held in a local (the
text rule sees a literal's ``%`` only).  A device is read only as a catalogue call's argument, so
it is neither formatted nor compared, whatever makes the text."""

from coda_agent.primitives import epilogue, gemm, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": silu(g) * u}


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def no_gate(acc):
    g, u = unpack(acc)
    return {"D": pack(g, u), "y": g * u}


def forward(x, W_gu):
    fmt = "%s"
    where = fmt % (x.device,)
    fn = swiglu if where == "cpu" or where == "cuda:0" else no_gate
    out = gemm(x, W_gu, fn)
    return {"y": out["y"], "pre": out["D"]}
