# stage: reference
# expect: all zeros
# static: off
"""Forks a child that leaves the runner's session (setsid: the judge's kill of the process group
misses it) and names itself coda-forged; the test checks that it is gone once the check is."""
import ctypes
import os
import time

from coda_agent.primitives import zeros_like


def forward(x, w, r):
    if os.fork() == 0:
        os.setsid()
        ctypes.CDLL(None).prctl(15, b"coda-forged", 0, 0, 0)  # PR_SET_NAME
        while True:
            time.sleep(0.2)
    return {"y": zeros_like(r)}


def backward(saved, dy):
    return {"dx": zeros_like(saved["x"]), "dw": zeros_like(saved["w"]), "dr": zeros_like(dy)}
