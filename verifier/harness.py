"""``Verifier.check(task, program) -> Report``: the harness, which never runs the program.

Three processes (the package docstring says what each guarantees):

1. **the harness** (this module, in the caller: the CLI, the agent, eval):
   the static stage in-process (the AST only), the verdict cache, the time
   limits, the Report;
2. **the judge** (:mod:`.judge`), a child started on the first check and kept
   for the next ones (``with Verifier() as v:`` keeps its judges for a batch;
   without ``with`` each check starts and ends its own): it runs every later
   stage.  A judge serves one check at a time; checks from several threads
   (``solve --samples``) each take an idle judge or start one;
3. **the runner** (:mod:`.runner`), started by the judge per check, behind
   walls (:mod:`.sandbox`): the only process the program runs in.

A Verifier's ``device`` is the ``CUDA_VISIBLE_DEVICES`` its judges start
with, so that one process can hold a Verifier per GPU (eval's thread per
GPU, :mod:`coda_agent.eval.pool`) without touching its own environment.

The harness reads the judge's event stream.  The judge enforces the check's
time limits itself (the runner's answering time and each load's own limit,
:mod:`.judge`) and reports when it waits for the GPU lock; the harness keeps
a backstop for a judge that stops answering, :data:`BACKSTOP_S` past those
limits and extended by every lock wait, so that waiting for the GPU never
counts.  A judge that dies or is killed once a stage has started fails the
stage it was in or the next one (a runner lives from its stage's start to
the check's end, and only the candidate has reason to break the judge); once
a stage has failed, or every stage has its result, the verdict stands as it
is.  Only a judge that ends before its first stage is the verifier's error.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from coda_agent.devices import visible_gpus
from coda_agent.tasks.spec import Task, load_task
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier.report import GPU_STAGES, STAGES, Report, StageResult
from coda_agent.verifier.static import check_source

JUDGE = "coda_agent.verifier.judge"  # the module the judge process runs
MAX_SOURCE_BYTES = 256 << 10
BACKSTOP_S = 900.0  # past the check's own limits: for the judge's references, baselines and compiles
LOADS_PER_CHECK = 4  # stages that load the program, each under load_timeout_s
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
_PR_SET_DUMPABLE = 4


class _Judge:
    """The judge process and its event stream; ``device``: its ``CUDA_VISIBLE_DEVICES`` (None: the caller's);
    ``compiles``: its checks may run the compile stage (:mod:`.judge`'s ``--compiles``)."""

    def __init__(self, device: str | None, compiles: bool) -> None:
        self.log = tempfile.TemporaryFile(prefix="coda-judge-")
        r, w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not any(s in k.upper() for s in _SECRET_WORDS)}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        # The judge imports what the harness can (a task's reference may live in tests/).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        argv = [sys.executable, "-m", JUDGE, str(w), *(["--compiles"] if compiles else [])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     pass_fds=[w], env=env, start_new_session=True, text=True)
        os.close(w)
        self.events = r
        self.pending = b""
        self.checks = 0
        self.references: dict[str, str] = {}  # reference file -> digest the judge imported
        self.closed = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, req: dict[str, Any]) -> int:
        self.checks += 1
        self.proc.stdin.write(json.dumps({**req, "check": self.checks}) + "\n")
        self.proc.stdin.flush()
        return self.checks

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next event, None at the timeout; EOFError when the judge is gone."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.events], [], [], left)[0]:
                return None
            chunk = os.read(self.events, 1 << 16)
            if not chunk:
                raise EOFError
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def tail(self) -> str:
        self.log.seek(0, os.SEEK_END)
        size = self.log.tell()
        self.log.seek(max(0, size - 3000))
        return self.log.read().decode(errors="replace")

    def kill(self) -> None:
        self._signal_group()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        """End the judge (a live one ends its runners and exits when its input closes) and free
        its pipe and log; safe to call again."""
        if self.closed:
            return
        self.closed = True
        try:
            self.proc.stdin.close()
        except OSError:  # a dead judge's pipe
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._signal_group()
            self.proc.wait()
        os.close(self.events)
        self.log.close()

    def _signal_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def returncode(self) -> str:
        rc = self.proc.wait()
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit code {rc}"


class Verifier:
    reps = 20  # calls of each contender the performance stage times, in interleaved rounds

    def __init__(self, stages: list[str] | tuple[str, ...] | None = None, timeout_s: float = 600.0,
                 cache: bool = True, shape_sets: tuple[str, ...] | list[str] | None = None,
                 compile_cache: bool = True, load_timeout_s: float = 60.0, device: str | None = None):
        """``shape_sets``: the named sets the GPU stages check (None: each task's own, all
        that fit).  ``timeout_s``: what the program may spend running (the runner's answers);
        ``load_timeout_s``: what each load of the program may spend.  ``cache``: reuse and
        store whole verdicts (:mod:`.cache`).  ``compile_cache``: reuse and store passed
        compile-stage results (:mod:`.compile_cache`).  ``device``: the GPU the judges use, as a
        ``CUDA_VISIBLE_DEVICES`` value of this process (``""``: none, the GPU stages are skipped;
        None: every GPU this process sees), so that threads of one process can each own a GPU."""
        unknown = set(stages or ()) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
        self.stages = [s for s in STAGES if stages is None or s in stages]
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self.cache = cache
        self.shape_sets = None if shape_sets is None else list(shape_sets)
        self.compile_cache = compile_cache
        self.device = device
        self._idle: list[_Judge] = []  # the session's judges between checks
        self._lock = threading.Lock()
        self._session = False
        if os.geteuid() == 0:  # a runner that keeps uid 0 may not ptrace its way in (sandbox.py)
            ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)

    def config(self) -> dict:
        return {"stages": self.stages, "shape_sets": self.shape_sets, "reps": self.reps,
                "timeout_s": self.timeout_s, "load_timeout_s": self.load_timeout_s}

    def __enter__(self) -> "Verifier":
        self._session = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._session = False
        self.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for judge in idle:
            judge.close()

    def check(self, task: Task | str | Path, program_source: str) -> Report:
        task = task if isinstance(task, Task) else load_task(task)
        gpu = self.device != "" and verdict_cache.cuda_available()
        versions, key = {}, None
        try:
            versions = {**verdict_cache.library_versions(),
                        "device": verdict_cache.device_name(gpu, _torch_index(self.device))}
            if gpu:
                versions["tuning"] = verdict_cache.tuned_digest(verdict_cache.tuned_configs())
            key = verdict_cache.cache_key(program_source, task, self.config(), versions)
        except Exception:  # noqa: BLE001 - fail closed: no key, no cache
            key = None
        if self.cache and key and (hit := verdict_cache.get(key)) is not None:
            return hit
        stages = self._run(task, program_source, gpu, versions)
        report = Report(task=task.name, program_sha256=hashlib.sha256(program_source.encode()).hexdigest(),
                        outcome=Report.outcome_of(stages), stages=stages, versions=versions,
                        cache_key=key, created_utc=dt.datetime.now(dt.timezone.utc).isoformat())
        if self.cache and key:
            verdict_cache.put(key, report)
        return report

    # ------------------------------------------------------------------ stages

    def _run(self, task: Task, source: str, gpu: bool, versions: dict[str, str]) -> list[StageResult]:
        results: list[StageResult] = []
        if "static" in self.stages:
            results.append(_static(source, task))
            if results[-1].status == "failed":
                return results
        child = [s for s in self.stages if s != "static" and (gpu or s not in GPU_STAGES)]
        if child:
            results += self._judged(task, source, child, versions)
        if not any(r.status in ("failed", "error") for r in results):
            results += [StageResult(name=s, status="skipped", message="no CUDA device: GPU stages skipped")
                        for s in self.stages if s in GPU_STAGES and not gpu]
        return results

    def _take_judge(self, task: Task) -> _Judge:
        """An idle judge of the session, or a new one; an idle judge that died or imported an
        older version of this task's reference (a judge never reloads a module) is ended."""
        refs = verdict_cache.reference_files(task)
        judge = None
        with self._lock:
            while self._idle and judge is None:
                judge = self._idle.pop()
                if not judge.alive() or any(judge.references.get(f, d) != d for f, d in refs.items()):
                    judge.kill()
                    judge = None
        judge = judge or _Judge(self.device, "compile" in self.stages)
        judge.references.update(refs)
        return judge

    def _give_back(self, judge: _Judge) -> None:
        with self._lock:
            if self._session and judge.alive():
                self._idle.append(judge)
                return
        judge.close()

    def _judged(self, task: Task, source: str, stages: list[str], versions: dict[str, str]) -> list[StageResult]:
        judge = self._take_judge(task)
        try:
            # Without the static stage the program also runs without the builtins guard: the
            # Python rules are one (primitives/program.py); the corpus's escaped programs use it.
            n = judge.send({"task_path": str(task.path), "source": source, "stages": stages,
                            "python_rules": "static" in self.stages,
                            "shape_sets": self.shape_sets, "reps": self.reps, "compile_cache": self.compile_cache,
                            "timeout_s": self.timeout_s, "load_timeout_s": self.load_timeout_s})
            return self._events(judge, n, stages, versions)
        finally:
            self._give_back(judge)

    def _events(self, judge: _Judge, n: int, stages: list[str], versions: dict[str, str]) -> list[StageResult]:
        """The results of check ``n`` from the judge's event stream (the backstop on time)."""
        results: list[StageResult] = []
        running: str | None = None
        deadline = time.monotonic() + self.timeout_s + LOADS_PER_CHECK * self.load_timeout_s + BACKSTOP_S
        waiting_since: float | None = None
        try:
            while True:
                left = float("inf") if waiting_since is not None else deadline - time.monotonic()
                event = judge.next_event(min(left, 60.0))
                if event is None:
                    if waiting_since is None and time.monotonic() >= deadline:
                        return results + [self._backstop(judge, running or stages[0])]
                    continue
                if event.get("check") != n:
                    continue
                if "start" in event:
                    running = event["start"]
                elif "waiting" in event:
                    waiting_since = time.monotonic()
                elif "waited" in event:
                    deadline += time.monotonic() - (waiting_since or time.monotonic())
                    waiting_since = None
                elif "result" in event:
                    results.append(StageResult.model_validate(event["result"]))
                    running = None
                elif "done" in event:
                    versions.update(event["done"].get("versions", {}))
                    return results
        except EOFError:
            why = judge.returncode()
            log = judge.tail()
            if running is not None:
                return results + [StageResult(name=running, status="failed", log=log,
                                              message=f"the judge process was ended ({why}) while stage {running} "
                                                      "ran the program: nothing but the program has a reason to")]
            if len(results) == len(stages) or any(r.status in ("failed", "error") for r in results):
                return results  # the verdict was complete: an end after it changes none of it
            if results:  # between stages, the program's runner alive (it lives until the check ends)
                return results + [StageResult(name=stages[len(results)], status="failed", log=log,
                                              message=f"the judge process was ended ({why}) after stage "
                                                      f"{results[-1].name}, while the program's runner was alive: "
                                                      "nothing but the program has a reason to")]
            return results + [StageResult(name=stages[0], status="error", log=log,
                                          message=f"the verifier's judge process ended ({why}); see the log")]

    def _backstop(self, judge: _Judge, stage: str) -> StageResult:
        log = judge.tail()
        judge.kill()
        return StageResult(name=stage, status="failed", log=log, details={"timeout_s": self.timeout_s},
                           message=f"timed out: the check did not finish within {self.timeout_s:.0f} s of program "
                                   f"time plus {BACKSTOP_S:.0f} s for the judge (killed): the program hung the "
                                   "GPU or its runner")


def _torch_index(device: str | None) -> int:
    """This process's torch index of the GPU named by ``device`` (a ``CUDA_VISIBLE_DEVICES`` id)."""
    visible = visible_gpus() if device else []
    return visible.index(device) if device in visible else 0


def _static(source: str, task: Task) -> StageResult:
    t0 = time.perf_counter()
    if len(source.encode()) > MAX_SOURCE_BYTES:
        violations = [f"line 1: the program is {len(source.encode())} bytes; at most {MAX_SOURCE_BYTES} "
                      "are read (an epilogue program is a page or two)"]
        return StageResult(name="static", status="failed", message=violations[0], line=1,
                           details={"violations": [{"line": 1, "message": violations[0]}]})
    violations = check_source(source, task.spec)
    return StageResult(
        name="static", status="failed" if violations else "passed",
        message="; ".join(str(v) for v in violations[:5]) + (f" (+{len(violations) - 5} more)"
                                                             if len(violations) > 5 else "")
        if violations else "imports, contract and constructs are allowed",
        line=violations[0].line if violations else None,
        details={"violations": [{"line": v.line, "message": v.message} for v in violations]},
        seconds=round(time.perf_counter() - t0, 3))
