# stage: reference
# expect: all zeros
# static: off
"""Wrong, so rejected; when the judge closes its channel (the check is over, the judge waits for
the runner to exit) it kills the judge, before the judge says the check is done: a harness that
read that as the verifier's own failure turned the rejection into `error`."""
import os
import signal
import sys

from coda_agent.primitives import zeros_like

wire = sys.modules["coda_agent.verifier.wire"]
recv = wire.Channel.recv


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def killing_recv(self, *args, **kwargs):
    try:
        return recv(self, *args, **kwargs)
    except wire.PeerGone:
        judge = _parent(os.getppid())
        if judge > 1:
            os.kill(judge, signal.SIGKILL)
        raise


wire.Channel.recv = killing_recv


def forward(x, w, r):
    return {"y": zeros_like(r)}


def backward(saved, dy):
    return {"dx": zeros_like(saved["x"]), "dw": zeros_like(saved["w"]), "dr": zeros_like(dy)}
