"""The bad-program corpus: every trick class is a family of programs in
tests/bad_programs/<family>/, each rejected where its header says (``# stage:``)
with a message holding its ``# expect:`` text.

A program with ``# static: off`` skips the static stage, as a program that
found a way past the AST rules would: it shows the runtime defences hold on
their own.  The static cases run in-process (the stage is an AST check); every
other CPU case goes through one real judge and its sandboxed runners, the
session's runtime judge (with a secret and a marker in its environment), and
compile cases (marked slow) through the session's compile judge; the harness
tests share both (tests/conftest.py), so the corpus starts no judge of its own.
GPU cases are marked gpu.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from verifier_helpers import EXPERT_PATH, TASK_PATH, corpus

from coda_agent.tasks import SUITE_DIR, SUITES
from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.report import STAGES
from coda_agent.verifier.static import check_source

CASES = corpus()
FAMILIES = {"interpreter", "files", "patching", "env", "state", "shapes", "extreme", "dtype", "mutation",
            "aliasing", "bias", "ragged", "load", "timing", "streams", "memory", "speed", "torch_compute",
            "processes", "wire", "needs", "lowering"}
FORGED_SYSV_KEY = 0xC0DAF0  # files/leave_shared_memory's SysV segment
RUNTIME = [c for c in CASES if c.stage != "static" and c.needs == "cpu" and c.family != "hang"]


def _id(case) -> str:
    return case.id


def _task(case):
    if not case.task:
        return load_task(TASK_PATH)
    suite, _, name = case.task.rpartition("/")  # NAME (LLaMA-3) or SUITE/NAME (a folder of tasks/)
    return load_task((SUITES.get(suite, SUITE_DIR.parent / suite) if suite else SUITE_DIR) / f"{name}.yaml")


def test_every_trick_class_is_a_family_of_several():
    families = {}
    for c in CASES:
        families.setdefault(c.family, []).append(c)
    assert FAMILIES <= set(families), f"missing families: {sorted(FAMILIES - set(families))}"
    thin = {f: len(cs) for f, cs in families.items() if f in FAMILIES and len(cs) < 2}
    assert not thin, f"families with one program: {thin}"


@pytest.mark.parametrize("case", [c for c in CASES if c.stage == "static"], ids=_id)
def test_static_rejects(case):
    violations = check_source(case.source, _task(case).spec)
    assert violations, f"{case.id} passed the static stage"
    assert case.found_in("; ".join(str(v) for v in violations))
    assert 1 <= violations[0].line <= len(case.source.splitlines())


@pytest.mark.parametrize("case", RUNTIME, ids=_id)
def test_runtime_rejects(case, runtime_judge, private_caches):
    task = _task(case)
    source = case.source.replace("{CACHE_DIR}", str(private_caches))  # the worst case: it knows the path
    if case.static:
        assert check_source(source, task.spec) == [], f"{case.id} must pass the static stage to reach it"
    report = runtime_judge.check(task, source)
    bad = report.failed_stage
    assert report.outcome == "rejected" and bad is not None and bad.name == case.stage, \
        report.model_dump_json(indent=1)[:3000]
    assert case.found_in(bad.message), bad.message
    assert case.found_in(render_feedback(report, source))
    assert "written" not in bad.message, f"{case.id} wrote a file: {bad.message}"
    assert not list(private_caches.rglob("forged*")) and not Path("/tmp/coda-forged.txt").exists()
    # Nothing of the program outlives its check: no file in the machine's /dev/shm, no SysV segment,
    # no process (processes/child_outlives_the_check names its child coda-forged).
    assert not list(Path("/dev/shm").glob("coda-forged*")), f"{case.id} left a file in /dev/shm"
    assert not _sysv_segment(FORGED_SYSV_KEY), f"{case.id} left a SysV shared-memory segment"
    deadline = time.monotonic() + 5
    while _forged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _forged_processes(), f"{case.id} left a process running: {_forged_processes()}"


def _sysv_segment(key: int) -> bool:
    table = Path("/proc/sysvipc/shm")
    lines = table.read_text().splitlines()[1:] if table.exists() else []
    return any(int(line.split()[0]) & 0xFFFFFFFF == key for line in lines if line.split())


def _forged_processes() -> list[int]:
    """Live processes named coda-forged (zombies are dead: their parent has yet to reap them)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "coda-forged" \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_the_expert_passes_the_same_judge(runtime_judge):
    report = runtime_judge.check(load_task(TASK_PATH), EXPERT_PATH.read_text())
    assert report.outcome == "cpu_passed", report.model_dump_json(indent=1)
    assert "no network" in report.versions["sandbox"] and "read-only fs" in report.versions["sandbox"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.needs == "compile"], ids=_id)
def test_compile_rejects(case, compile_judge):
    report = compile_judge.check(_task(case), case.source)
    bad = report.failed_stage
    assert bad is not None and bad.name == "compile" and case.found_in(bad.message), bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in CASES if c.needs == "gpu"], ids=_id)
def test_gpu_rejects(case):
    """On the GPU a case is rejected, or correct_slow when it is correct and its tricks would
    only have made it look fast; caught at its stage (``# stage:``) at the latest."""
    stages = None if case.static else ("reference", "compile", "correctness", "launch_audit", "performance")
    report = Verifier(stages=stages, cache=False).check(_task(case), case.source)
    first = next((s for s in report.stages if s.status in ("failed", "slow", "error")), None)
    assert report.outcome in ("rejected", "correct_slow") and first is not None and first.status != "error" \
        and STAGES.index(first.name) <= STAGES.index(case.stage), report.model_dump_json(indent=1)[:4000]
    assert case.found_in(first.message), first.message
