"""The judge's handle on a runner: starting it, asking it, and reading what it says as untrusted.

:class:`Remote` is one runner process (:mod:`.runner`) for one program,
started behind its walls (:mod:`.sandbox`), from the zygote on a machine
without CUDA (:class:`Zygote`) or as a fresh process on a GPU machine.  Every
reply goes through :meth:`Remote.request`, which turns whatever the runner
does into either a message the caller then validates field by field, or a
:class:`CandidateError` (the program's failure, hence a rejection): a reply
that is not well-formed, a reply too large, no reply before the deadline, a
closed channel (the runner died: the exit status and the tail of its log say
how), or an ``error`` the runner reports.  Nothing here is ever executed or
unpickled.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from coda_agent import storage
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import sandbox
from coda_agent.verifier import strays
from coda_agent.verifier.disk import DiskWatch
from coda_agent.verifier.program import CandidateError
from coda_agent.verifier.trees import remove_tree
from coda_agent.verifier.wire import Channel, PeerGone, Timeout, WireError
from coda_agent.verifier.zygote import Zygote

LOG_TAIL = 64 << 10
START_TIMEOUT_S = 120.0  # a runner's imports and CUDA start, at most


class WallsTooHigh(RuntimeError):
    """CUDA does not work behind the walls asked for (found before any program ran)."""


class RunnerTimeout(CandidateError):
    """The runner gave no reply within the time it was allowed (it has been killed)."""


class _LogTail:
    """The last :data:`LOG_TAIL` bytes of a pipe, read by a thread of its own."""

    def __init__(self, fd: int):
        self.buf: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._drain, args=(fd,), daemon=True)
        self.thread.start()

    def _drain(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as f:
            while chunk := f.read(1 << 16):
                with self.lock:
                    self.buf.append(chunk)
                    self.size += len(chunk)
                    while self.size > LOG_TAIL and len(self.buf) > 1:
                        self.size -= len(self.buf.popleft())

    def text(self) -> str:
        self.thread.join(timeout=0.5)
        with self.lock:
            return b"".join(self.buf).decode(errors="replace")[-LOG_TAIL:]


def seed_tuned_configs(plan: sandbox.Plan, env: dict[str, str]) -> Path:
    """Copy the judge's tuning cache to where ``storage.cache_dir`` points in the runner's
    environment ``env`` (under its scratch directory), readable by the runner's uid.  A copy, so a
    program can change nothing but the tiles of its own run, which any program may pin anyway."""
    folder = storage.cache_dir("tuning", env)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in verdict_cache.tuned_configs().items():
        (folder / name).write_bytes(data)
    # From the first folder made under the scratch directory (.cache, where the runner's other
    # caches go too): the runner's own, not the judge's.
    sandbox.give(plan, Path(plan.scratch) / folder.relative_to(plan.scratch).parts[0])
    return folder


class Remote:
    """One runner process for one program (module docstring)."""

    def __init__(self, source: str, scratch: Path, cuda: bool, zygote_: Zygote | None, cpu_seconds: int,
                 mode: str | None = None):
        self.cuda = cuda
        self.plan = sandbox.plan_for(source, scratch, cuda, cpu_seconds, mode)
        os.symlink(self.plan.writable[0], os.path.join(self.plan.scratch, "kernels"))
        env = sandbox.runner_env(self.plan, sandbox.RUNNER_ENV)
        if cuda:
            seed_tuned_configs(self.plan, env)
        else:  # a CPU runner on a GPU machine sees no GPU (and keeps its address-space limit)
            env["CUDA_VISIBLE_DEVICES"] = ""
        mine, theirs = socket.socketpair()
        log_r, log_w = os.pipe()
        self.zygote = zygote_ if not cuda else None
        self.proc: subprocess.Popen | None = None
        if self.zygote is not None:
            self.pid = self.zygote.fork(self.plan, env, theirs.fileno(), log_w)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coda_agent.verifier.runner", str(theirs.fileno()), json.dumps(vars(self.plan))],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log_w, stderr=log_w, env=env,
                cwd=self.plan.scratch)
            self.pid = self.proc.pid
        strays.register(self.pid)  # what it leaves behind ends when it ends (strays.py)
        theirs.close()
        os.close(log_w)
        self.disk = DiskWatch([self.plan.scratch, *self.plan.writable], self.pid)  # disk.py
        self.log = _LogTail(log_r)
        self.channel = Channel(mine)
        self.dead = False
        self.exit_status: int | None = None
        try:  # no program has run yet: a runner that does not start is the machine's problem
            hello, _ = self.channel.recv(START_TIMEOUT_S)
        except WireError as e:
            self.kill()
            raise RuntimeError(f"the runner did not start ({e}); its log:\n{self.log.text()[-3000:]}") from None
        if not hello.get("ready"):
            self.kill()
            if hello.get("cuda_failed"):
                raise WallsTooHigh(str(hello.get("error")))
            raise RuntimeError(f"the runner could not build its walls: {hello.get('error')} "
                               "(CODA_SANDBOX=uid or none lowers them; see verifier/sandbox.py)")
        self.walls = str(hello.get("walls", ""))
        if cuda:
            self._check_probe(hello.get("probe"))

    def _check_probe(self, desc: Any) -> None:
        """The judge reads the runner's probe tensor through CUDA IPC: both directions of the
        transport the GPU stages use work behind these walls."""
        from coda_agent.verifier.cuda_ipc import probe_reads_back  # the judge's CUDA: only on a GPU machine

        try:
            ok = probe_reads_back(desc)
        except Exception as e:  # noqa: BLE001 - no program has run: the walls are the cause
            self.kill()
            raise WallsTooHigh(f"CUDA IPC from a runner behind {self.walls} fails: {type(e).__name__}: {e}") from None
        if not ok:
            self.kill()
            raise WallsTooHigh(f"CUDA IPC from a runner behind {self.walls} reads wrong values")

    def request(self, header: dict[str, Any], blobs: Sequence[bytes | memoryview] = (), timeout: float | None = None,
                max_bytes: int = 0) -> dict[str, Any]:
        """Send ``header`` and return the reply's JSON, its blobs (at most ``max_bytes``) in
        ``reply["_blobs"]``."""
        if self.dead:
            raise CandidateError("the runner is gone (an earlier request ended it)")
        try:
            self.channel.send(header, blobs)
            reply, got = self.channel.recv(timeout, max_bytes)
        except PeerGone:
            self.dead = True
            raise CandidateError(f"the program ended the runner process ({self._death()})",
                                 log=self.log.text()[-3000:]) from None
        except Timeout:
            self.kill()
            raise RunnerTimeout(f"no reply to `{header.get('op')}` within {timeout:.0f} s",
                                log=self.log.text()[-3000:]) from None
        except WireError as e:
            self.kill()
            raise CandidateError(f"the runner's reply to `{header.get('op')}` is unusable: {e}",
                                 log=self.log.text()[-3000:]) from None
        if "error" in reply:
            err = reply["error"] if isinstance(reply["error"], dict) else {"message": str(reply["error"])}
            line = err.get("line")
            raise CandidateError(str(err.get("message", "the runner reported an error"))[:4000],
                                 line if type(line) is int else None, str(err.get("log", ""))[:8000])
        reply["_blobs"] = got
        return reply

    def _death(self) -> str:
        status = self._status(5.0)
        if self.disk.over:
            return self.disk.over
        log = self.log.text()
        if "illegal memory access" in log or "illegal address" in log:
            return "an illegal memory access in a kernel"
        if status is None:
            return "it closed its channel"
        if status < 0:
            try:
                return f"killed by {signal.Signals(-status).name}"
            except ValueError:
                return f"killed by signal {-status}"
        return f"exit code {status}"

    def _status(self, timeout: float) -> int | None:
        """The runner's exit status once it has ended (None while it runs)."""
        if self.exit_status is None and self.proc is not None:
            try:
                self.exit_status = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        elif self.exit_status is None:
            self.exit_status = self.zygote.status(self.pid, timeout)
        return self.exit_status

    def kill(self) -> None:
        self.dead = True
        if self.exit_status is None:
            strays.kill_group(self.pid)
            self._status(10.0)
        strays.release(self.pid)  # the processes it started that left its session

    def close(self) -> None:
        """End the runner (it exits when its channel closes), reap it, remove its scratch directory."""
        self.channel.close()
        if self._status(10.0) is None:
            self.kill()
        else:
            strays.release(self.pid)
        self.disk.stop()
        remove_tree(self.plan.scratch)
        if self.disk.over:  # what it wrote there would outlive the check
            remove_tree(Path(self.plan.writable[0]))
