# stage: performance
# expect: baselines capped
# static: off
"""A third slower than its GEMMs (the weight gradient's GEMM runs twice), and honest in every call;
but from the performance stage's load on, a thread of its own keeps the GPU busy whenever the runner
waits for a request (the main thread blocked reading its channel), which is when the judge times a
baseline: short sleep kernels from another context, whose time slices the judge's kernels wait
through.  Every baseline ran slower than alone and the program, which stops while it is called, did
not: its ratio to the plain GEMMs came out below 1.  The baselines are now timed again with the
runner ended, and capped at their times alone."""
import sys
import threading
import time

import torch

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def _serving_state():
    """The runner's State (the `serve` loop's local) and whether its main thread waits for a request."""
    f = sys._current_frames().get(threading.main_thread().ident)
    waiting, st = False, None
    while f is not None:
        waiting = waiting or f.f_code.co_name in ("_read", "recv")
        if f.f_code.co_name == "serve":
            st = f.f_locals.get("st")
        f = f.f_back
    return st, waiting


def _interfere():
    stream = None
    while True:
        st, waiting = _serving_state()
        if st is not None and waiting and "performance" in getattr(st, "programs", {}):
            stream = stream or torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(200_000)
            stream.synchronize()
        else:
            time.sleep(0.0002)


if torch.cuda.is_available() and not torch.__dict__.get("_coda_forged_interferer"):
    torch.__dict__["_coda_forged_interferer"] = threading.Thread(target=_interfere, daemon=True)
    torch.__dict__["_coda_forged_interferer"].start()


def forward(x, w, r):
    return {"y": gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    gemm(saved["x"].t(), dy)
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
