# stage: reference
# expect: all zeros
# static: off
"""Leaves state behind where a read-only file system does not reach: a file in /dev/shm (a tmpfs
of the machine's RAM) and a SysV shared-memory segment, both of which outlive their process.  The
test checks that neither is on the machine after the check."""
import ctypes

from coda_agent.primitives import zeros_like


def forward(x, w, r):
    try:
        with open("/dev/shm/coda-forged", "w") as f:
            f.write("x" * 4096)
    except OSError:
        pass
    ctypes.CDLL(None).shmget(0xC0DAF0, 4096, 0o1666)  # IPC_CREAT | 0666
    return {"y": zeros_like(r)}


def backward(saved, dy):
    return {"dx": zeros_like(saved["x"]), "dw": zeros_like(saved["w"]), "dr": zeros_like(dy)}
