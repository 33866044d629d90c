# stage: reference
# expect: all zeros
# static: off
"""Stops (SIGSTOP) its parent, where it can name it the zygote that forks every later runner of
this judge: the next program's check would wait for a fork that never comes (the judge also
waits only so long for its zygote).  Then answers zeros."""
import os
import signal

from coda_agent.primitives import zeros_like


def forward(x, w, r):
    os.kill(os.getppid(), signal.SIGSTOP)
    return {"y": zeros_like(r)}


def backward(saved, dy):
    return {"dx": zeros_like(saved["x"]), "dw": zeros_like(saved["w"]), "dr": zeros_like(dy)}
