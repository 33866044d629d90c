"""The runner zygote: imports torch, the catalogue and quack once, then forks a runner per program.

Importing torch, the catalogue and the quack and CuTeDSL modules its cute
lowering loads on first use takes seconds; a judge that
checks many programs (a batch, the test suite) would pay it for each.  The
zygote pays it once and forks: a forked child is a fresh process that already
has the modules, and it enters its walls (:func:`sandbox.enter`) before it
loads the program.  It is used only without CUDA: a process that has touched
the driver cannot fork a working child, and the zygote never initialises it
(it refuses to serve if anything did).  On a GPU machine the judge starts each
runner as a fresh process instead.

quack and CuTeDSL (about 5 s of CPU, twice torch's import) are loaded only
for a judge whose checks may compile (``compiles``: its Verifier runs the
compile stage): without CUDA no other stage uses them, and a judge of the
static and reference stages alone (a test session starts many) does without.
Nor does it load torch._dynamo (some 900 modules, nearly as long as torch):
an eager catalogue launch skips torch's dispatcher (``primitives/dispatch.py``),
whose first custom-op call is what imports it; quack's modules bring it along.

Protocol on the control socket (a Unix socket pair, the judge holding the
other end): length-prefixed JSON.  ``{"op": "fork", "plan": ..., "env": ...}``
comes with two file descriptors (the runner's channel and its log pipe) and is
answered ``{"pid": N}``.  ``{"op": "wait", "pid": N, "timeout": s}`` answers the
runner's exit status once it has ended (the zygote is its parent), or null.
The zygote is non-dumpable, so a runner that keeps the judge's uid cannot
ptrace its way back into a process with privileges.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
START_S = 600.0  # the zygote's imports, at most (quack and CuTeDSL with ``compiles``, on a slow disk)
ANSWER_S = 30.0  # a fork, or a status past the wait asked for: the zygote answers at once


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    (size,) = struct.unpack(">I", _exact(sock, 4))
    msg, fds, _, _ = socket.recv_fds(sock, size, 2)
    while len(msg) < size:
        msg += _exact(sock, size - len(msg))
    return json.loads(msg), list(fds)


def _exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def send(sock: socket.socket, obj: dict, fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(body)))
    if fds:
        socket.send_fds(sock, [body], list(fds))
    else:
        sock.sendall(body)


def recv_reply(sock: socket.socket, timeout: float | None = None) -> dict:
    """One reply; ``socket.timeout`` (an OSError) when none is complete within ``timeout`` s."""
    sock.settimeout(timeout)
    try:
        (size,) = struct.unpack(">I", _exact(sock, 4))
        return json.loads(_exact(sock, size))
    finally:
        sock.settimeout(None)


def _fork(control: socket.socket, req: dict, fds: list[int]) -> int:
    from coda_agent.verifier import runner, sandbox

    channel_fd, log_fd = fds
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            control.close()
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            # The zygote's own environment is a runner's (the allow-list, sandbox.runner_env); this
            # runner's paths go on top.  quack read QUACK_CACHE_DIR when the zygote imported it: the
            # value is relative (sandbox.RUNNER_ENV), so it names this runner's scratch.
            os.environ.update(req["env"])
            tempfile.tempdir = None  # computed once from TMPDIR, in the zygote: recompute it here
            runner.start(channel_fd, sandbox.Plan(**req["plan"]), keep=())
        except BaseException:  # noqa: BLE001 - a forked child must never return into the zygote's loop
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(channel_fd)
    os.close(log_fd)
    return pid


def _wait(statuses: dict[int, int], pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while pid not in statuses:
        try:
            got, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left: this one was reaped and asked for before
            return None
        if got:
            statuses[got] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= deadline:
            return None
        else:
            time.sleep(0.01)
    return statuses.pop(pid)


class Zygote:
    """The judge's handle on its zygote process (this module's :func:`main`).  :meth:`start`
    launches it without waiting, so its imports overlap the judge's; the first fork waits."""

    def __init__(self, compiles: bool) -> None:
        from coda_agent.verifier import sandbox

        self.compiles = compiles
        self.cwd = tempfile.mkdtemp(prefix="zygote-", dir=sandbox.runners_root())
        # The runners' own environment: libraries read some of it at import, here.
        self.env = sandbox.runner_env(sandbox.Plan(namespaces=False, scratch=self.cwd), sandbox.RUNNER_ENV)
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready = False

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        mine, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "coda_agent.verifier.zygote", str(theirs.fileno()),
                *(["--compiles"] if self.compiles else [])]
        self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=self.env, cwd=self.cwd,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.ready = mine, False

    def fork(self, plan: Any, env: dict[str, str], channel_fd: int, log_fd: int) -> int:
        """A runner with ``plan`` (a :class:`sandbox.Plan`) and ``env``; returns its pid.  A zygote
        that does not answer (an earlier program's runner stopped or killed it, where its walls
        let it signal the zygote) is replaced once."""
        for attempt in (1, 2):
            self.start()
            try:
                if not self.ready:
                    hello = recv_reply(self.sock, START_S)
                    if not hello.get("ready"):
                        raise RuntimeError(f"the runner zygote did not start: {hello.get('error')}")
                    self.ready = True
                send(self.sock, {"op": "fork", "plan": vars(plan), "env": env}, (channel_fd, log_fd))
                return recv_reply(self.sock, ANSWER_S)["pid"]
            except (EOFError, OSError) as e:  # socket.timeout is an OSError
                self._end()
                if attempt == 2:
                    raise RuntimeError(f"the runner zygote does not answer ({type(e).__name__}: {e})") from None
        raise AssertionError("unreachable")

    def status(self, pid: int, timeout: float) -> int | None:
        """The runner's exit status, None while it runs; a zygote that does not answer within
        ``timeout`` plus :data:`ANSWER_S` is ended (its runners with it) and answers None."""
        try:
            send(self.sock, {"op": "wait", "pid": pid, "timeout": timeout})
            return recv_reply(self.sock, timeout + ANSWER_S)["status"]
        except (EOFError, OSError):  # the zygote is gone (its children with it), or stopped
            self._end()
            return None

    def _end(self) -> None:
        """Kill the zygote (stopped or not; its runners die with it) so that :meth:`start` makes a
        fresh one."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.sock is not None:
            self.sock.close()
        self.ready = False

    def close(self) -> None:
        from coda_agent.verifier.trees import remove_tree

        if self.proc is not None:
            self.sock.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        remove_tree(self.cwd)


def main(control_fd: int, compiles: bool) -> int:
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # with its judge (one thread)
    import torch

    # The imports every runner would otherwise repeat: the catalogue, and what its cute lowering
    # imports on first use (the compile stage's runner uses it at once).
    if compiles:
        import cutlass.cute  # noqa: F401
        import quack.epilogue.frontend  # noqa: F401
        import quack.gemm_runtime.host  # noqa: F401
        import quack.gemm_sm90  # noqa: F401

    import coda_agent.primitives  # noqa: F401
    from coda_agent.verifier import program, runner  # noqa: F401

    control = socket.socket(fileno=control_fd)
    if torch.cuda.is_initialized():
        send(control, {"ready": False, "error": "CUDA was initialised while importing; cannot fork runners"})
        return 1
    send(control, {"ready": True})
    statuses: dict[int, int] = {}
    while True:
        try:
            req, fds = _recv(control)
        except (EOFError, ConnectionError):
            return 0
        if req["op"] == "fork":
            send(control, {"pid": _fork(control, req, fds)})
        else:
            send(control, {"status": _wait(statuses, req["pid"], req["timeout"])})


if __name__ == "__main__":
    code = main(int(sys.argv[1]), "--compiles" in sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing is buffered; tearing down the catalogue's imports takes seconds
