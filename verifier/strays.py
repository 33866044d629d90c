"""Processes a runner leaves behind, ended when the runner ends.

A runner is a session of its own (``sandbox.enter`` calls ``setsid``), and the judge kills its
process group when it ends it.  A child that calls ``setsid`` itself leaves both, and where the
runner has no PID namespace (every GPU runner: CUDA IPC between judge and runner needs the PIDs
shared; a CPU runner under ``CODA_SANDBOX=uid`` or ``none``) that child outlives the runner.  What
it runs then (kernels kept on the GPU, a busy host) slows whatever the judge does next: the
baselines timed alone after the runner ends (:mod:`.timing`, which trusts those times to cap the
baselines'), the next program's calls.

So the judge is the subreaper of everything below it (``prctl(PR_SET_CHILD_SUBREAPER)``, in
:func:`adopt`): an orphan below it becomes its child instead of init's, and no process a runner
starts can leave the judge's tree.  When a runner ends (:func:`release`), the judge ends every
process below it that belongs to none of the sessions it keeps: its own (its torch.compile
workers, the zygote on a machine without CUDA) and those of the runners still live.  It does so
in passes, since ending a stray makes its children the judge's, until a pass finds none; each
pass kills every stray it saw at once, so a tree is ended from the top faster than a program that
is no longer running can rebuild it.  It reaps the strays that were its children, and no other:
a runner's exit status is its ``Popen``'s (or the zygote's) to collect.

Only a process that called :func:`adopt` sweeps: a test that builds a runner in its own process
keeps its other children (a pytest worker's judges are sessions of their own).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

_PR_SET_CHILD_SUBREAPER = 36
PASSES = 50  # sweeps per released runner, at most
REAP_S = 2.0  # how long a killed child may take to become reapable (one in the GPU driver takes a while)

_adopted = False
_live: set[int] = set()  # the runners' pids, each its own session's id


def adopt() -> bool:
    """Make this process (the judge) the subreaper of its descendants; True where the kernel took it."""
    global _adopted
    _adopted = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return _adopted


def kill_group(pid: int) -> None:
    """SIGKILL runner ``pid``'s process group, and ``pid`` itself where it is no group's leader (yet)."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def register(pid: int) -> None:
    """A runner started: its session is kept until :func:`release`."""
    _live.add(pid)


def release(pid: int) -> int:
    """A runner ended (and was reaped): end what it left below this process.  Returns how many
    processes that ended (0 where this process did not :func:`adopt`, or where ``pid`` was released
    already: a sweep ends when none is left, so a runner's strays take one)."""
    if pid not in _live:
        return 0
    _live.discard(pid)
    return end_strays(runner=pid) if _adopted else 0


def _table() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, session id) of every process this one can see."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # gone since the listing
            continue
        out[int(name)] = parse_stat(stat)
    return out


def parse_stat(stat: str) -> tuple[str, int, int]:
    """(state, parent pid, session id) from a /proc/PID/stat line.  The command name, in
    parentheses, is the process's to choose (spaces and parentheses included): the fields are read
    after the last ')'."""
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def strays(table: dict[int, tuple[str, int, int]] | None = None) -> list[int]:
    """The processes below this one in no session it keeps, zombies included.  A live runner's
    tree is its own until it ends: a CPU runner's PID namespace holds its init and its program in a
    session of their own, and they end with it."""
    table = _table() if table is None else table
    keep = {os.getsid(0), *_live}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(os.getpid(), ()))
    while stack:
        pid = stack.pop()
        if pid in _live:
            continue
        stack.extend(children.get(pid, ()))
        if table[pid][2] not in keep:
            found.append(pid)
    return found


def end_strays(runner: int = 0) -> int:
    """Kill every stray, pass after pass until none is left, and reap those that are this process's
    children but ``runner`` (its exit status is its ``Popen``'s); returns how many it killed."""
    me, killed = os.getpid(), set()
    for _ in range(PASSES):
        table = _table()
        found = strays(table)
        alive = [p for p in found if table[p][0] != "Z"]
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed.update(alive)
        _reap([p for p in found if table[p][1] == me and p != runner])
        if not alive:
            break
    return len(killed)


def _reap(pids: list[int]) -> None:
    deadline = time.monotonic() + REAP_S
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped already, or not ours
                done = pid
            if done:
                waiting.discard(pid)
        if waiting:
            time.sleep(0.005)
