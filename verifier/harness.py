"""``Verifier.check(task, program) -> Report``: the static stage in-process, the rest
in a child process with a time limit.

The candidate never runs in the harness's own process.  The worker
(:mod:`.worker`) streams a line per stage; whatever happens to it (a hang
killed at the limit, a segfault, an aborting illegal memory access) becomes
the verdict of the stage it was in, and the harness carries on.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coda_agent.tasks.spec import Task, load_task
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier.report import GPU_STAGES, STAGES, Report, StageResult
from coda_agent.verifier.static import check_source

class Verifier:
    def __init__(self, stages: list[str] | tuple[str, ...] | None = None, timeout_s: float = 900.0,
                 cache: bool = True, shape_sets: tuple[str, ...] | list[str] | None = None,
                 reps: int = 20, fail_on_target: bool = False, compile_cache: bool = True):
        """``shape_sets``: the sets the GPU stages check; None: each task's own.
        ``cache``: reuse and store whole verdicts (:mod:`.cache`).  ``compile_cache``:
        reuse and store passed compile-stage results (:mod:`.compile_cache`), on its own
        switch because a pass with ``cache=False`` (a fresh verdict) still gains from
        not recompiling identical kernels; its key is just as fail-closed."""
        unknown = set(stages or ()) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
        self.stages = [s for s in STAGES if stages is None or s in stages]
        self.timeout_s = timeout_s
        self.cache = cache
        self.shape_sets = None if shape_sets is None else list(shape_sets)
        self.reps = max(int(reps), 20)
        self.fail_on_target = fail_on_target
        self.compile_cache = compile_cache

    def config(self) -> dict:
        return {"stages": self.stages, "shape_sets": self.shape_sets, "reps": self.reps,
                "fail_on_target": self.fail_on_target}

    def check(self, task: Task | str | Path, program_source: str) -> Report:
        task = task if isinstance(task, Task) else load_task(task)
        versions, key = {}, None
        try:
            versions = verdict_cache.library_versions()
            device = verdict_cache.device_name()
            versions["device"] = device
            key = verdict_cache.cache_key(program_source, task.spec.model_dump_json(), self.config(),
                                          versions, device)
        except Exception:  # noqa: BLE001 - fail closed: no key, no cache
            key = None
        if self.cache and key and (hit := verdict_cache.get(key)) is not None:
            return hit
        stages = self._run(task, program_source, gpu=versions.get("device", "cpu") != "cpu")
        report = Report(task=task.name, program_sha256=hashlib.sha256(program_source.encode()).hexdigest(),
                        outcome=Report.outcome_of(stages), stages=stages, versions=versions,
                        cache_key=key, created_utc=dt.datetime.now(dt.timezone.utc).isoformat())
        if self.cache and key:
            verdict_cache.put(key, report)
        return report

    # ------------------------------------------------------------------ stages

    def _run(self, task: Task, source: str, gpu: bool) -> list[StageResult]:
        results: list[StageResult] = []
        if "static" in self.stages:
            t0 = time.perf_counter()
            violations = check_source(source, task.spec)
            results.append(StageResult(
                name="static", status="failed" if violations else "passed",
                message="; ".join(str(v) for v in violations[:5])
                + (f" (+{len(violations) - 5} more)" if len(violations) > 5 else "")
                if violations else "imports, contract and constructs are allowed",
                line=violations[0].line if violations else None,
                details={"violations": [{"line": v.line, "message": v.message} for v in violations]},
                seconds=round(time.perf_counter() - t0, 3)))
            if violations:
                return results
        child = [s for s in self.stages if s != "static" and (gpu or s not in GPU_STAGES)]
        if child:
            results += self._run_child(task, source, child)
        if not any(r.status in ("failed", "error") for r in results):
            results += [StageResult(name=s, status="skipped", message="no CUDA device: GPU stages skipped")
                        for s in self.stages if s in GPU_STAGES and not gpu]
        return results

    def _run_child(self, task: Task, source: str, stages: list[str]) -> list[StageResult]:
        with tempfile.TemporaryDirectory(prefix="coda-verify-") as tmp:
            req, out, err = Path(tmp, "request.json"), Path(tmp, "results.jsonl"), Path(tmp, "stderr.txt")
            req.write_text(json.dumps({
                "task_path": str(task.path), "source": source, "stages": stages,
                "seeds": [secrets.randbits(31) for _ in range(4)], "shape_sets": self._shape_sets(task),
                "reps": self.reps, "fail_on_target": self.fail_on_target,
                "compile_cache": self.compile_cache}))
            env = dict(os.environ)
            # The child sees the modules the harness sees (a task reference may live in tests/).
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            t0 = time.perf_counter()
            with open(err, "w") as ferr:
                proc = subprocess.Popen([sys.executable, "-m", "coda_agent.verifier.worker", str(req), str(out)],
                                        stdout=ferr, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                try:
                    rc = proc.wait(timeout=self.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    rc, timed_out = proc.returncode, True
            elapsed = time.perf_counter() - t0
            return _read_results(out, err.read_text(errors="replace"), rc, timed_out, self.timeout_s, elapsed)


    def _shape_sets(self, task: Task) -> list[str]:
        if self.shape_sets is not None:
            return self.shape_sets
        # The task's own, smallest first: the performance stage times the last that fits.
        return sorted(task.spec.shapes, key=task.spec.flops)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_results(path: Path, stderr: str, rc: int | None, timed_out: bool, limit: float,
                  elapsed: float) -> list[StageResult]:
    results: list[StageResult] = []
    running = None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "start" in obj:
                running = obj["start"]
            else:
                results.append(StageResult.model_validate(obj["result"]))
                running = None
    tail = stderr[-3000:]
    if timed_out:
        results.append(StageResult(
            name=running or "reference", status="failed", seconds=round(elapsed, 1), log=tail,
            message=f"timed out after {limit:.0f} s (killed): an infinite loop, a hang or a deadlock "
                    "in the program; forward/backward must be straight-line catalogue calls",
            details={"timeout_s": limit}))
    elif running is not None:
        why = _signal_name(rc)
        illegal = "illegal memory access" in stderr or "illegal address" in stderr
        results.append(StageResult(
            name=running, status="failed", log=tail, details={"returncode": rc},
            message=("the kernel made an illegal memory access (the process died)" if illegal else
                     f"the program crashed the worker process ({why}) during stage {running}")))
    elif not results:
        results.append(StageResult(name="reference", status="error", log=tail, details={"returncode": rc},
                                   message=f"the verifier worker failed to start (exit {rc}); see the log"))
    return results


def _signal_name(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            pass
    return f"exit code {rc}"
