"""The runner's walls (coda_agent.verifier.sandbox), tried from inside: a forked child enters
them as a runner does and reports what it can still do.  The child uses only modules already
imported, so it needs nothing from the file system once the walls are up."""

from __future__ import annotations

import ctypes
import getpass
import encodings.idna  # noqa: F401 - the child resolves an address after the walls are up
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from coda_agent.verifier import sandbox, trees

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="namespaces and uid changes need root")


def _try(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return e.strerror or type(e).__name__


def _write(path: str) -> None:
    with open(path, "w") as f:
        f.write("x")


def _write_value(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _probe(plan: sandbox.Plan, targets: dict[str, str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Fork, enter ``plan``'s walls in the child (with ``env`` as its environment), and try
    everything; the child's findings."""
    r, w = os.pipe()
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # the parent is non-dumpable, as the judge and harness are
    judge = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out: dict[str, str] = {}
        try:
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            walls = sandbox.enter(plan, keep_fds=(w,))
            out["walls"] = walls.describe()
            out["uid"] = str(os.getuid())
            try:  # torch's inductor cache path asks for the user name (a runner's uid has no passwd entry)
                out["user"] = getpass.getuser()
            except KeyError as e:
                out["user"] = f"KeyError: {e}"
            for name, path in targets.items():
                out[name] = _try(lambda p=path: _write(p))
            out["read secret"] = _try(lambda: open(targets["secret"]).read() and None)
            if "verdict key" in targets:
                out["read verdict key"] = _try(lambda: open(targets["verdict key"]).read() and None)
            out["network"] = _try(lambda: socket.create_connection(("10.255.255.1", 80), timeout=1))
            out["parent memory"] = _try(lambda: open(f"/proc/{os.getppid()}/mem", "rb").read(1))
            out["proc sysctl"] = _try(lambda: _write("/proc/sys/vm/drop_caches"))
            libc = ctypes.CDLL(None, use_errno=True)
            out["remount rw"] = "ok" if libc.mount(None, b"/", None, 32 | 4096, None) == 0 else \
                os.strerror(ctypes.get_errno())
            out["signal parent"] = _try(lambda: os.kill(os.getppid(), 0))
            out["signal judge"] = _try(lambda: os.kill(judge, 0))
            out["processes"] = str(len([p for p in os.listdir("/proc") if p.isdigit()]))
            with open("/proc/self/oom_score_adj") as f:
                out["oom score"] = f.read().strip()
            out["lower oom score"] = _try(lambda: _write_value("/proc/self/oom_score_adj", "0"))
            out["escape the group"] = _try(lambda: os.kill(0, 0))
            out["shm"] = _try(lambda: _write(f"/dev/shm/coda-sandbox-probe-{judge}"))
            libc.shmget.restype = ctypes.c_int
            out["sysv shm"] = str(libc.shmget(0x5EED0000 + judge % 0xFFFF, 4096, 0o1600))
        except Exception as e:  # noqa: BLE001 - the child reports, never raises into pytest
            out["error"] = f"{type(e).__name__}: {e}"
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        found = json.loads(f.read() or "{}")
    os.waitpid(pid, 0)
    # What the child left on the machine (a child without namespaces leaves it: removed here).
    shm = Path(f"/dev/shm/coda-sandbox-probe-{judge}")
    found["shm left"] = str(shm.exists())
    shm.unlink(missing_ok=True)
    key = 0x5EED0000 + judge % 0xFFFF
    found["sysv left"] = str(_sysv_segment(key))
    libc = ctypes.CDLL(None)
    libc.shmget.restype = ctypes.c_int
    if (shmid := libc.shmget(key, 0, 0)) >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    return found


@pytest.fixture
def places(tmp_path):
    scratch = sandbox.runners_root() / f"test-{os.getpid()}-{tmp_path.name}"
    plan = sandbox.plan_for("print('the program')", scratch, cuda=False, cpu_seconds=60)
    secret = tmp_path / "secret"
    secret.write_text("judge's key")
    secret.chmod(0o600)
    repo = Path(__file__).resolve().parent
    yield plan, {"scratch": os.path.join(plan.scratch, "out"), "kernels": os.path.join(plan.writable[0], "o"),
                 "tmp": "/tmp/coda-sandbox-probe", "repo": str(repo / "coda-sandbox-probe"),
                 "cache": str(tmp_path / "forged.json"), "secret": str(secret)}
    shutil.rmtree(scratch, ignore_errors=True)


@needs_root
def test_namespaces_and_no_capabilities(places):
    plan, targets = places
    plan.uid = None  # the judge's uid without its capabilities: what the machine that runs CI gets
    # The verdict cache's signing key: root reads any file, so the folder is covered, not locked.
    key = Path(plan.hidden[0]) / ".key"
    key.write_bytes(b"the judge's signing key")
    targets["verdict key"] = str(key)
    found = _probe(plan, targets)
    assert "error" not in found, found
    assert found["read verdict key"] == "Permission denied"  # an empty tmpfs of mode 000 over the folder
    assert found["verdict key"] != "ok" and key.read_bytes() == b"the judge's signing key"
    assert found["walls"] == "clean env, no network, read-only fs, own processes, the judge's uid, no capabilities"
    assert found["scratch"] == found["kernels"] == "ok"
    assert found["tmp"] == found["repo"] == found["cache"] == found["proc sysctl"] == "Read-only file system"
    assert found["network"] == "Network is unreachable"
    assert found["remount rw"] == "Operation not permitted"  # no CAP_SYS_ADMIN: the walls stay up
    assert found["parent memory"] in ("Permission denied", "Operation not permitted")
    assert not Path(targets["tmp"]).exists() and not Path(targets["repo"]).exists()
    # Its own PID namespace: no process outside it can be named (the judge, the zygote), and
    # /proc lists its own; its own IPC namespace and /dev/shm: what it leaves there dies with it.
    assert found["signal judge"] == "No such process"
    assert int(found["processes"]) <= 3
    # The OOM killer's first choice, for good: a runner whose children fill the host's memory
    # loses them, not the judge or the harness.
    assert found["oom score"] == "1000" and found["lower oom score"] != "ok"
    assert found["shm"] == "ok" and found["shm left"] == "False"
    assert int(found["sysv shm"]) >= 0 and found["sysv left"] == "False"


def _sysv_segment(key: int) -> bool:
    """Whether the machine's IPC namespace holds a SysV shared-memory segment with ``key``."""
    rows = [line.split() for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    return any(int(row[0]) & 0xFFFFFFFF == key for row in rows if row)


@needs_root
def test_a_uid_of_its_own(places):
    plan, targets = places
    plan.uid = sandbox.program_uid("print('the program')")  # as if the installation were world-readable
    for d in (plan.scratch, *plan.writable):
        sandbox._chown_tree(Path(d), plan.uid)
    found = _probe(plan, targets, env=sandbox.runner_env(plan, sandbox.RUNNER_ENV))
    assert "error" not in found, found
    assert found["uid"] == str(plan.uid) and f"uid {plan.uid}" in found["walls"]
    assert found["user"] == "coda-runner"
    assert found["scratch"] == "ok"
    assert found["read secret"] == "Permission denied"
    assert found["signal parent"] == "Operation not permitted"  # its init is root
    assert found["signal judge"] == "No such process"


def test_each_program_has_its_own_uid_and_kernel_cache():
    a, b = "print(1)", "print(2)"
    assert sandbox.program_uid(a) == sandbox.program_uid(a) != sandbox.program_uid(b)
    assert sandbox.program_uid(a) >= sandbox.UID_BASE
    assert sandbox.kernel_cache_dir(a) != sandbox.kernel_cache_dir(b)


def test_no_walls_but_a_clean_environment(places, monkeypatch, tmp_path):
    targets = {"secret": places[1]["secret"], "here": str(tmp_path / "written")}
    monkeypatch.setenv("CODA_SANDBOX", "none")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    plan = sandbox.plan_for("print(3)", tmp_path / "scratch", cuda=False, cpu_seconds=60)
    assert not plan.namespaces and plan.uid is None and not plan.drop_privileges
    env = sandbox.runner_env(plan, sandbox.RUNNER_ENV)
    assert "OPENAI_API_KEY" not in env and not any(k.startswith("CODA_") for k in env)
    assert env["HOME"] == env["TMPDIR"] == plan.scratch
    found = _probe(plan, targets)
    assert found["walls"].startswith("clean env, network, writable fs") and found["here"] == "ok"
    assert found["oom score"] == "1000"  # layer 1: on every machine


def test_an_unknown_sandbox_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv("CODA_SANDBOX", "paranoid")
    with pytest.raises(sandbox.SandboxError, match="choose one of auto, uid, none"):
        sandbox.mode()


def test_walls_come_down_one_mode_at_a_time_and_the_report_says_why(monkeypatch):
    """Where CUDA fails in a fresh runner (before any program), the judge lowers its mode:
    auto -> uid -> none, each step with the reason; below none it gives up with the error."""
    from coda_agent.verifier.check import Judge

    assert [sandbox.weaker(m) for m in sandbox.MODES] == ["uid", "none", None]
    monkeypatch.delenv("CODA_SANDBOX", raising=False)
    judge = Judge(emit=lambda obj: None, zygote=None, compiles=False)
    assert judge.sandbox_mode == {False: "auto", True: "auto"}
    judge.lower_walls(True, "CUDA does not start behind no network: cudaGetDeviceCount")
    judge.lower_walls(True, "CUDA does not start behind uid 1500000007")
    assert judge.sandbox_mode == {False: "auto", True: "none"}  # CPU runners keep every wall
    assert judge.lowered[0].startswith("auto -> uid (CUDA does not start behind no network")
    with pytest.raises(RuntimeError, match="even with CODA_SANDBOX=none: boom"):
        judge.lower_walls(True, "boom")


def _descendants(top: int) -> set[int]:
    """``top`` and every process below it, from the machine's /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, grew = {top}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def _running(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def test_a_runner_dies_with_the_process_that_started_it(tmp_path):
    """A runner busy in a program never outlives its judge: once the walls are up, the end
    of its parent kills it (PR_SET_PDEATHSIG, set after the uid change that would clear it).
    Behind the full walls (root) nothing the program started does either, not even a child
    that left the runner's session, which a kill of the runner's process group misses: the
    runner's PID namespace ends with it."""
    import subprocess
    import sys
    import time

    plan = sandbox.plan_for("while True: pass", tmp_path / "scratch", cuda=False, cpu_seconds=60)
    child = (f"import os, sys, time; from coda_agent.verifier import sandbox; "
             f"plan = sandbox.Plan(**{vars(plan)!r}); "
             f"pid = os.fork()\n"
             f"if pid == 0:\n"
             f"    print(os.getpid(), flush=True); sandbox.enter(plan, keep_fds=(1,))\n"
             f"    if os.fork() == 0:\n"
             f"        os.setsid()\n"
             f"    while True: time.sleep(0.05)\n"
             f"time.sleep(3); os._exit(0)")
    parent = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    top = int(parent.stdout.readline())
    time.sleep(1.5)
    started = _descendants(top)
    assert len(started) >= (4 if ROOT else 2), started  # keeper, init, runner, the escapee (without: runner, escapee)
    parent.wait(timeout=60)
    deadline = time.time() + 10
    while time.time() < deadline and any(_running(p) for p in started):
        time.sleep(0.1)
    left = [p for p in started if _running(p)]
    if not ROOT:  # without namespaces a child that left the session survives: only the runner is bound
        left = [p for p in left if p != top]
        assert top not in left
        for p in left:
            os.kill(p, 9)
        return
    assert not left, left


def test_a_gpu_runner_reads_its_own_copy_of_the_tuned_configs(places, monkeypatch, tmp_path):
    """The tile winners bench/run.py stored reach a runner (whose HOME and cache folders are its
    scratch) as a copy it can read as its own uid: its gemm() lookups find them, and what it writes
    there stays in its scratch.  Their digest is part of a GPU verdict's key."""
    import subprocess
    import sys

    from coda_agent.primitives.tile_config import TileConfig
    from coda_agent.primitives.tuning import TuningCache
    from coda_agent.verifier import cache as verdict_cache
    from coda_agent.verifier.remote import seed_tuned_configs

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "judge-cache"))
    before = verdict_cache.tuned_digest(verdict_cache.tuned_configs())
    key = "a" * 32
    TuningCache().put(key, TileConfig(128, 128, 2, 1, True), {"128x128 c2x1 pingpong": 1.0})
    assert verdict_cache.tuned_digest(verdict_cache.tuned_configs()) != before
    plan = places[0]
    env = sandbox.runner_env(plan, sandbox.RUNNER_ENV)
    folder = seed_tuned_configs(plan, env)
    assert folder.is_relative_to(plan.scratch)
    child = f"""
from coda_agent import storage
from coda_agent.primitives.tuning import TuningCache
print(storage.cache_dir("tuning"), TuningCache().get({key!r}))
(storage.cache_dir("tuning") / "{key}.json").write_text("forged")
"""
    r = subprocess.run([sys.executable, "-c", child], env=env,
                       cwd=plan.scratch, capture_output=True, text=True, user=plan.uid, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(folder), "128x128", "c2x1", "pingpong"]
    assert TuningCache().get(key) == TileConfig(128, 128, 2, 1, True)  # the judge's own entry is untouched


def _deep_tree(top: Path, depth: int) -> None:
    """``depth`` nested directories under ``top``, each with a file and a symlink out of the tree,
    made as a program makes them (relative to a descriptor: the full path is far past PATH_MAX)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        os.symlink("/etc", "etc", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def test_the_judge_removes_any_tree_a_program_leaves(tmp_path, monkeypatch):
    """A runner's scratch and kernel cache are the program's to fill: 1500 nested directories
    made shutil.rmtree raise RecursionError (ignore_errors does not cover it) in the judge, at
    the end of the check and, from a kernel cache the program aged, at every judge's start."""
    scratch = tmp_path / "scratch"
    _deep_tree(scratch, 1500)
    trees.remove_tree(scratch)
    assert not scratch.exists() and Path("/etc/passwd").exists()  # symlinks removed, never followed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # runners_root() under tmp_path
    aged = sandbox.runners_root() / "kernels" / "0123456789abcdef01234567"
    _deep_tree(aged, 1500)
    os.utime(aged, (0, 0))
    fresh = sandbox.runners_root() / "kernels" / "fresh"
    fresh.mkdir()
    sandbox.prune_kernel_caches(time.time())
    assert not aged.exists() and fresh.exists()
    trees.remove_tree(tmp_path / "missing")  # nothing there: nothing to do, nothing raised
