"""The runner's walls: what a candidate program can reach once it runs.

The judge plans each runner (:func:`plan_for`, :func:`runner_env`); the
runner calls :func:`enter` first thing, before it loads a program.  Layers,
each applied where the machine allows it and reported back
(``Report.versions["sandbox"]``):

1. **Always** (any machine, any user): a clean environment built from an
   allow-list (no API keys, no ``CODA_*`` markers, no inherited secrets); a
   fresh working directory that is also ``HOME`` and ``TMPDIR`` (empty, but
   for a GPU runner's copy of the tuned tile configurations); no file
   descriptor but its channel to the judge and its log pipe; a session of its
   own (the judge kills the whole group, which a child that calls ``setsid``
   leaves: layer 2 ends those); resource limits: no core files,
   caps on file size, open files and CPU seconds (a backstop behind the
   judge's wall-clock limits), and on the address space where no CUDA needs
   its large reservations; the OOM killer's first choice (``oom_score_adj``
   1000: children that fill the host's memory together end, not the judge).
2. **Namespaces** (``unshare(2)``; needs root): a private network namespace
   (nothing but a down loopback) and a private mount namespace in which every
   file system is read-only, /proc and /dev included (device nodes, the GPU's,
   still open read-write), except the scratch directory and the program's own
   kernel cache; and the verdict cache, whose signing key root could read, is
   covered by an empty read-only tmpfs (:data:`Plan.hidden`).  A CPU runner
   also gets PID and IPC namespaces of its own
   (:func:`_own_processes`: it can name no process outside, its /proc lists
   its own, and every process it starts, SysV segment it makes, dies with it)
   and a small private tmpfs on /dev/shm (the machine's is RAM that outlives
   a runner).  A GPU runner gets neither, and its /dev/shm, /dev/pts and
   /dev/mqueue stay as they are: legacy CUDA IPC between judge and runner
   needs PIDs and IPC shared.
3. **No privileges** (needs root to give them up): the bounding set emptied,
   root's special treatment locked off (securebits), every capability
   dropped, ``no_new_privs``, non-dumpable; and, where the GPU device nodes
   and the Python installation are world-accessible, a uid/gid of the
   program's own (derived from its digest) with no supplementary groups.
   Without capabilities the runner cannot undo its mounts, and the judge,
   the zygote and the harness are non-dumpable too, so it cannot ptrace or
   read the memory of any of them.

What this guarantees: with all three, a program that escapes every Python
rule can compute, waste its own time and memory, write its scratch directory
and its kernel cache, and lie on its channel; the verdict depends on nothing
it can reach.  If it keeps uid 0 (the Python installation is under a private
home directory, as on the machine the tests run on) it can still read what
root can read outside the folders it hides (and put it in an error message: keep
secrets out of files on verifier machines); from a GPU runner, or a CPU runner behind lower walls (a
CPU runner's namespace hides them), it can also signal root's processes:
killing the judge is a rejection, never the verifier's error (:mod:`.harness`), a
stopped zygote is replaced (:mod:`.zygote`), but it could kill other
processes of the machine.  A child it starts that leaves the runner's session
stays below the judge, its subreaper, which ends it when the runner ends
(:mod:`.strays`).  With layer 1 alone (``CODA_SANDBOX=none``, or a
harness that does not run as root) the program runs as the judge's user,
unconfined: it could overwrite files others read later (cached verdicts are
signed, :mod:`.cache`, with a key that user can read) or interfere with other
processes.  The judge's checks still decide the verdict of the program itself.

``CODA_SANDBOX``: ``auto`` (default: every layer the machine allows), ``uid``
(layers 1 and 3: for a machine where CUDA misbehaves inside namespaces) or
``none`` (layer 1).  A GPU runner proves that CUDA works behind its walls before
it accepts a program (it allocates a tensor and the judge reads it through CUDA
IPC, :mod:`.remote`); where it does not, the judge lowers the walls one mode at
a time (:func:`weaker`) for the rest of its life, and every report names the
walls it ran behind and why they were lowered.  No program has run in a probing
runner, so a program cannot lower its own walls.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import resource
import select
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from coda_agent import storage
from coda_agent.verifier.trees import remove_tree

MODES = ("auto", "uid", "none")

# Environment variables a runner may inherit (values from the judge's environment).
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH",
                 "CUTE_DSL_ARCH", "QUACK_ARCH")
# The runner's kernel caches, relative to its scratch directory (quack reads its variable at
# import, so a runner forked from the zygote finds its own), and one intra-op thread: the
# runner and the judge take turns, and idle OpenMP threads spinning in one starve the other
# (measured on 2 cores: a reference stage 15x slower with the default).  The compile stage's
# cubins go to a temporary directory of each compile's own (primitives/dsl_scope.py), in
# the runner's TMPDIR.
RUNNER_ENV = {"QUACK_CACHE_DIR": "kernels/quack", "TRITON_CACHE_DIR": "kernels/triton", "OMP_NUM_THREADS": "1"}
UID_BASE = 1_500_000_000  # runner uids: UID_BASE + 24 bits of the program's digest
FILE_SIZE_LIMIT = 1 << 30  # bytes one runner may write to one file (cubins, kernel objects)
OPEN_FILES_LIMIT = 4096
CPU_ADDRESS_SPACE = 24 << 30  # RLIMIT_AS without CUDA (an sm_90a compile stays far below it)

# mount(2) and unshare(2) flags, prctl(2) options
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_OPTION_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                 "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWPID, _CLONE_NEWIPC = 0x00020000, 0x40000000, 0x20000000, 0x08000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 1, 4, 24, 28
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 38, 47
_SECBITS_LOCKED_NOROOT = 0xEF  # noroot, no setuid fixup, no ambient raise, all locked (keep_caps off)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_UNTOUCHED = ("/dev/shm", "/dev/pts", "/dev/mqueue")  # mounts a CUDA runner leaves as they are
_UNTOUCHED_CPU = ("/dev/pts",)  # a CPU runner's: /dev/shm gets a tmpfs of its own, /dev/mqueue is read-only
SHM_BYTES = 64 << 20  # a CPU runner's private /dev/shm


class SandboxError(RuntimeError):
    """A wall the plan asks for could not be built; the runner must not run the program."""


@dataclass
class Plan:
    """What the judge asks for one runner (sent to it as JSON)."""

    namespaces: bool
    scratch: str  # the fresh working directory (HOME, TMPDIR)
    writable: list[str] = field(default_factory=list)  # other directories left writable (the kernel cache)
    hidden: list[str] = field(default_factory=list)  # directories covered by an empty tmpfs (the verdict cache)
    uid: int | None = None  # None: keep the judge's user
    drop_privileges: bool = False  # give up root's capabilities (as uid, when one is set)
    cpu_seconds: int = 3600
    cuda: bool = False


@dataclass
class Walls:
    """What :func:`enter` built, as the runner reports it."""

    network: bool = False
    read_only: bool = False
    processes: bool = False  # its own PID and IPC namespaces (a CPU runner)
    uid: int | None = None
    capabilities: bool = True
    address_space: bool = False

    def describe(self) -> str:
        parts = ["clean env", "no network" if self.network else "network",
                 "read-only fs" if self.read_only else "writable fs",
                 *(["own processes"] if self.processes else []),
                 f"uid {self.uid}" if self.uid is not None else "the judge's uid",
                 "capabilities" if self.capabilities else "no capabilities"]
        return ", ".join(parts)


def mode() -> str:
    value = os.environ.get("CODA_SANDBOX") or "auto"
    if value not in MODES:
        raise SandboxError(f"CODA_SANDBOX={value!r}: choose one of {', '.join(MODES)}")
    return value


def weaker(current: str) -> str | None:
    """The next mode down from ``current`` (None below ``none``)."""
    i = MODES.index(current)
    return MODES[i + 1] if i + 1 < len(MODES) else None


def program_uid(source: str) -> int:
    """A uid of the program's own: the same program always runs as the same stranger."""
    return UID_BASE + int(hashlib.sha256(source.encode()).hexdigest()[:6], 16)


def runners_root() -> Path:
    """Where runners' directories live: traversable by any uid (0711), listable by none."""
    root = Path(tempfile.gettempdir()) / "coda-runners"
    root.mkdir(mode=0o711, exist_ok=True)
    return root


KERNEL_CACHE_DAYS = 7  # a program's kernel cache unused this long is removed


def kernel_cache_dir(source: str) -> Path:
    """The program's own kernel caches (quack, Triton): only runners of the same source share
    them, so a program can poison nothing but its own later runs."""
    return runners_root() / "kernels" / hashlib.sha256(source.encode()).hexdigest()[:24]


def prune_kernel_caches(now: float) -> None:
    """Remove the kernel caches of programs not verified for :data:`KERNEL_CACHE_DAYS` (every
    candidate an LLM writes leaves one).  A program sets its own cache's times and fills it, so
    this must survive any tree (:func:`remove_tree`): every judge prunes as it starts."""
    for d in (runners_root() / "kernels").glob("*"):
        try:
            if now - d.stat().st_mtime > KERNEL_CACHE_DAYS * 86400:
                remove_tree(d)
        except FileNotFoundError:
            pass


def plan_for(source: str, scratch: Path, cuda: bool, cpu_seconds: int, m: str | None = None) -> Plan:
    """The walls this machine allows for a runner of ``source`` under mode ``m`` (default
    :func:`mode`); creates its directories."""
    m = m or mode()
    root = os.geteuid() == 0
    uid = program_uid(source) if m != "none" and root and _strangers_can_run(cuda) else None
    kernels = kernel_cache_dir(source)
    (kernels.parent).mkdir(mode=0o711, parents=True, exist_ok=True)
    for d in (scratch, kernels):
        d.mkdir(mode=0o700, exist_ok=True)
        os.utime(d)  # in use (prune_kernel_caches)
        if root:  # the runner's own, whoever it runs as (a program may have run under another plan before)
            _chown_tree(d, uid if uid is not None else 0)
    verdicts = storage.cache_dir("verdicts")  # its key signs cached verdicts (cache.py)
    verdicts.mkdir(mode=0o700, parents=True, exist_ok=True)  # a folder made later would not be covered
    return Plan(namespaces=m == "auto" and root, scratch=str(scratch), writable=[str(kernels)],
                hidden=[os.path.realpath(verdicts)], uid=uid, drop_privileges=m != "none" and root,
                cpu_seconds=cpu_seconds, cuda=cuda)


def _strangers_can_run(cuda: bool) -> bool:
    """Another uid can open the GPU and read the Python installation this runner imports."""
    if cuda:
        nodes = [p for p in Path("/dev").glob("nvidia*") if not p.is_dir()]
        if not all(p.stat().st_mode & (stat.S_IROTH | stat.S_IWOTH) == stat.S_IROTH | stat.S_IWOTH
                   for p in nodes):
            return False
    for entry in [p for p in sys.path if p and os.path.isdir(p)]:
        path = Path(entry).resolve()
        for d in [path, *path.parents]:
            if not d.stat().st_mode & stat.S_IXOTH:
                return False
    return True


def give(plan: Plan, top: Path) -> None:
    """Make ``top`` (a tree the judge wrote inside the runner's scratch) the runner's own."""
    if os.geteuid() == 0:
        _chown_tree(top, plan.uid if plan.uid is not None else 0)


def _chown_tree(top: Path, uid: int) -> None:
    if top.stat().st_uid == uid:
        return
    os.chown(top, uid, uid)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def runner_env(plan: Plan, extra: dict[str, str]) -> dict[str, str]:
    """The runner's whole environment: the allow-list, the scratch paths and ``extra``."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    # USER/LOGNAME: a runner's uid has no passwd entry, and getpass.getuser() (which
    # torch's inductor cache path calls on the first custom-op dispatch) reads these first.
    env.update(HOME=plan.scratch, TMPDIR=plan.scratch, XDG_CACHE_HOME=os.path.join(plan.scratch, ".cache"),
               USER="coda-runner", LOGNAME="coda-runner",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(plan.scratch, ".cache", "inductor"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONDONTWRITEBYTECODE="1",
               PYTHONUNBUFFERED="1",
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")  # CUDA IPC cannot export those
    env.update(extra)
    return env


# --------------------------------------------------------------------------- inside the runner

def enter(plan: Plan, keep_fds: tuple[int, ...]) -> Walls:
    """Build the walls around the current process.  Raises :class:`SandboxError` when a
    layer the plan asks for fails: a runner without its promised walls must not run.

    A CPU runner with namespaces returns from this in a grandchild (:func:`_own_processes`):
    the calling process stays outside as the keeper the judge knows, and ends as it ends."""
    parent = os.getppid()
    _close_except(keep_fds)
    if os.getsid(0) != os.getpid():
        os.setsid()
    walls = Walls(address_space=_limits(plan))
    if plan.namespaces:
        _namespaces(plan)
        walls.network = walls.read_only = True
        if not plan.cuda:
            parent = _own_processes(parent)
            walls.processes = True
    os.chdir(plan.scratch)  # after the bind mounts: a directory entered before stays on the read-only mount
    if plan.drop_privileges:  # layer 3 (module docstring); mode none keeps layer 1 alone
        _drop_capabilities(plan.uid)
        walls.capabilities = False
        walls.uid = plan.uid
        libc = _libc()
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # other runners may not ptrace it
    _die_with(parent)
    return walls


def _die_with(parent: int) -> None:
    """SIGKILL when the process that started this one (the judge, or the zygote, each from its
    only thread; in a PID namespace of its own, its init) ends, so a runner busy in a program
    never outlives its judge.  Set after the uid change, which clears it; a parent already gone
    means exit now."""
    _check(_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)


def _own_processes(parent: int) -> int:
    """Split the runner in three (the PID and IPC namespaces are unshared, :func:`_namespaces`):
    this process stays outside as the keeper, the pid the judge knows and kills; its child is
    init of the new PID namespace, which mounts the namespace's own /proc and reaps; the
    grandchild, pid 2 there, returns to run the program.  Returns the runner's parent (init).

    Why: a program (one that escaped every Python rule) can fork, and a child that leaves
    the runner's session (``setsid``) escapes the judge's kill of the process group, and
    outlives the check; where the runner keeps uid 0 it could also signal the judge, the zygote
    (a stopped zygote held up the next check) or any root process.  In a namespace of its own it
    can name no process outside, and when init ends (the runner's end, or the keeper's:
    init dies with it) the kernel kills everything inside.  The IPC namespace takes SysV
    segments and queues, which outlive their process, with it.  The program is pid 2, not
    init: init ignores the signals its own namespace sends it, a program's own kill included.

    Exit statuses travel up: the keeper ends as the runner ended (code or signal), so the
    judge's report of a runner's death holds."""
    alive_r, alive_w = os.pipe()  # the keeper's end: init learns of its death (it has no ppid)
    status_r, status_w = os.pipe()  # init tells the keeper how the runner ended
    init = os.fork()
    if init:  # the keeper holds nothing of the runner's: its channel must close when the runner ends
        _close_except((alive_w, status_r))
        _die_with(parent)  # the keeper dies with the judge or zygote; init with the keeper
        _keep(init, status_r)
    os.close(alive_w)
    os.close(status_r)
    libc = _libc()
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if select.select([alive_r], [], [], 0)[0]:  # EOF: the keeper is gone already
        os._exit(1)
    os.setsid()  # a group of its own: a program's kill(0, ...) reaches nothing outside
    # The namespace's own /proc: its processes only.  Best effort (a container may forbid a
    # fresh proc): without it the program still sees the machine's /proc, read-only, and can
    # signal no process it lists.
    libc.mount(b"proc", b"/proc", b"proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    runner = os.fork()
    if runner:
        _close_except((alive_r, status_w))
        _init(runner, status_w)
    os.close(alive_r)
    os.close(status_w)
    return 1


def _keep(child: int, status_r: int) -> None:
    """The keeper: wait for init, then end as the runner ended (init's report; else as init did)."""
    status = _waitpid(child)
    told = os.read(status_r, 64).decode()
    _end_as(int(told) if told.lstrip("-").isdigit() else os.waitstatus_to_exitcode(status))


def _init(runner: int, status_w: int) -> None:
    """Init of the runner's PID namespace: reap whatever the program leaves, until the runner ends;
    report how it ended to the keeper and exit, which kills the namespace."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the one signal Python handles: a program's SIGINT is no exit
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == runner:
            os.write(status_w, str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)


def _waitpid(pid: int) -> int:
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


def _end_as(code: int) -> None:
    """Exit with ``code`` (as :func:`os.waitstatus_to_exitcode` gives it: negative for a signal)."""
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        except (OSError, ValueError):
            pass
    os._exit(code if code >= 0 else 1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(uid: int | None) -> None:
    """Give up root's powers for good: the bounding set, then (as ``uid`` if given) every
    capability, with root's special treatment locked off so that no exec brings them back."""
    libc = _libc()
    for cap in range(64):  # EINVAL past the kernel's last capability
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    _check(libc.prctl(_PR_SET_SECUREBITS, _SECBITS_LOCKED_NOROOT, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    if uid is not None:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as e:
            raise SandboxError(f"cannot drop to uid {uid}: {e}") from None
    empty = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), empty), "capset(none)")


def _close_except(keep: tuple[int, ...]) -> None:
    lo = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _oom_first() -> None:
    """Make this process (and every process it starts) the first the kernel's OOM killer ends:
    a program that forks children which fill the host's memory must lose them, not the judge,
    the harness or a neighbour's work.  Raising one's own score needs no privilege, lowering it
    needs CAP_SYS_RESOURCE, which layer 3 drops; a kernel without the file keeps its default."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _limits(plan: Plan) -> bool:
    _oom_first()
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT),
              (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT), (resource.RLIMIT_CPU, plan.cpu_seconds)]
    if not plan.cuda:  # CUDA reserves terabytes of address space up front
        limits.append((resource.RLIMIT_AS, CPU_ADDRESS_SPACE))
    for which, value in limits:
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    return not plan.cuda


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise SandboxError(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def _namespaces(plan: Plan) -> None:
    libc = _libc()
    if plan.cuda:  # legacy CUDA IPC between judge and runner needs their PIDs and IPC shared
        _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET), "unshare(network, mount)")
    else:
        _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC),
               "unshare(network, mount, PID, IPC)")
    untouched = _UNTOUCHED if plan.cuda else _UNTOUCHED_CPU
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making the mount tree private")
    writable = [os.path.realpath(p) for p in [plan.scratch, *plan.writable]]
    for path in writable:  # each its own mount, so the read-only remounts below pass them by
        _check(libc.mount(path.encode(), path.encode(), None, _MS_BIND | _MS_REC, None), f"binding {path}")
    for path in plan.hidden:
        _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                          b"size=4k,mode=0"), f"covering {path}")
    for point, options in _mounts():
        if point in writable or any(point == u or point.startswith(u + "/") for u in untouched):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | sum(f for o, f in _OPTION_FLAGS.items() if o in options)
        if libc.mount(None, point.encode(), None, flags, None) != 0 and "ro" not in options:
            raise SandboxError(f"remounting {point} read-only failed: {os.strerror(ctypes.get_errno())}")
    if not plan.cuda and os.path.isdir("/dev/shm"):
        # A tmpfs of its own over the machine's /dev/shm (read-only above if this fails): what a
        # program writes there is bounded, and gone with the runner's mount namespace.
        libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                   f"size={SHM_BYTES},mode=1777".encode())


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this mount namespace."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        out.append((fields[4].encode().decode("unicode_escape"), set(fields[5].split(","))))
    return out
