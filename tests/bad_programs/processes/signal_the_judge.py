# stage: reference
# expect: REACHED []
# static: off
"""Looks for the judge, the zygote and the harness (by their command lines, and up its own chain
of parents) and tries to signal each (signal 0: permission only).  Behind the walls of a CPU
runner it finds none it can reach: a PID namespace of its own."""
import os

from coda_agent.primitives import gemm


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def forward(x, w, r):
    found = set()
    pid = os.getppid()
    while pid > 1:
        found.add(pid)
        pid = _parent(pid)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"verifier.judge" in cmd or b"pytest" in cmd or b"coda-agent" in cmd:
            found.add(int(entry))
    reached = []
    for pid in sorted(found):
        try:
            os.kill(pid, 0)
            reached.append(pid)
        except OSError:
            pass
    raise RuntimeError(f"REACHED {reached}")
