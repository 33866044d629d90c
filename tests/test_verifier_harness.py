"""The harness around the judge: processes, time limits, crashes, the CLI (the verdict cache:
test_verifier_cache.py)."""

from __future__ import annotations

import time

import pytest
import torch
from typer.testing import CliRunner
from verifier_helpers import CORPUS, EXPERT_PATH, TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import harness
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.report import Report, StageResult

CPU_STAGES = ["static", "reference"]


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


@pytest.fixture(scope="module")
def session():
    """One judge for the tests of whole checks (the GPU stages skip without CUDA)."""
    with Verifier(stages=[s for s in harness.STAGES if s != "compile"], cache=False, timeout_s=4,
                  load_timeout_s=3) as v:
        yield v


def test_expert_cpu_passed(task, session):
    report = session.check(task, EXPERT_PATH.read_text())
    assert report.outcome == "cpu_passed", report.model_dump_json(indent=1)
    assert [s.status for s in report.stages][:2] == ["passed", "passed"]
    assert report.stage("reference").details["shape_sets"] == "small ragged ragged+256 small+odd small+short".split()
    if not torch.cuda.is_available():
        gpu = report.stages[2:]
        assert [s.status for s in gpu] == ["skipped"] * 3
        assert all("no CUDA device: GPU stages skipped" in s.message for s in gpu)


def test_hang_is_a_timeout_and_the_judge_carries_on(task, session):
    source = (CORPUS / "hang" / "infinite_loop.py").read_text()
    t0 = time.perf_counter()
    report = session.check(task, source)
    assert time.perf_counter() - t0 < 4 + 30
    bad = report.failed_stage
    assert report.outcome == "rejected" and bad.name == "reference" and bad.status == "failed"
    assert "timed out after 4 s" in bad.message
    assert session.check(task, EXPERT_PATH.read_text()).outcome == "cpu_passed"


KILL_SELF = """
import os, signal
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    os.kill(os.getpid(), signal.SIGSEGV)


def backward(saved, dy):
    return {}
"""

# Its own judge only: the runner's parent is the zygote, whose parent is the judge.  Behind the full
# walls a CPU runner can name neither (its own PID namespace, sandbox.py): these run with none.
KILL_JUDGE = KILL_SELF.replace("os.kill(os.getpid(), signal.SIGSEGV)", """zygote = os.getppid()
    judge = int(open(f"/proc/{zygote}/stat").read().rsplit(")", 1)[1].split()[1])
    os.kill(judge, signal.SIGKILL)
    while True:
        pass""")

# Wrong, so rejected; it kills the judge once the judge closes its channel (the check is over, the
# judge waits for the runner's exit), before the judge says the check is done.
KILL_JUDGE_AFTER = """
import os, signal, sys
from coda_agent.primitives import zeros_like

wire = sys.modules["coda_agent.verifier.wire"]
recv = wire.Channel.recv


def killing_recv(self, *args, **kwargs):
    try:
        return recv(self, *args, **kwargs)
    except wire.PeerGone:
        zygote = os.getppid()
        os.kill(int(open(f"/proc/{zygote}/stat").read().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        raise


wire.Channel.recv = killing_recv


def forward(x, w, r):
    return {"y": zeros_like(r)}


def backward(saved, dy):
    return {"dx": zeros_like(saved["x"]), "dw": zeros_like(saved["w"]), "dr": zeros_like(dy)}
"""


def test_a_crash_is_the_verdict_of_its_stage(task, runtime_judge):
    report = runtime_judge.check(task, KILL_SELF)
    bad = report.failed_stage
    assert report.outcome == "rejected" and bad.name == "reference"
    assert "the program ended the runner process (killed by SIGSEGV)" in bad.message


def test_a_program_that_kills_the_judge_is_rejected_not_an_error(task, monkeypatch):
    monkeypatch.setenv("CODA_SANDBOX", "none")
    report = Verifier(stages=["reference"], cache=False, timeout_s=20).check(task, KILL_JUDGE)
    bad = report.failed_stage
    assert report.outcome == "rejected" and bad.name == "reference", report.model_dump_json(indent=1)
    assert "the judge process was ended (killed by SIGKILL) while stage reference ran the program" in bad.message


def test_a_judge_killed_after_the_verdict_leaves_the_verdict(task, monkeypatch):
    """A judge that dies between its last result and its "done" (here killed by the program, whose
    runner lives until the check ends) changes nothing: the rejection stands, it is no verifier error."""
    monkeypatch.setenv("CODA_SANDBOX", "none")
    report = Verifier(stages=["reference"], cache=False, timeout_s=20).check(task, KILL_JUDGE_AFTER)
    assert report.outcome == "rejected" and [s.status for s in report.stages] == ["failed"], \
        report.model_dump_json(indent=1)
    assert "all zeros" in report.failed_stage.message


def test_a_judge_killed_between_stages_fails_the_next_one(task):
    """The harness's reading of a judge's end, stage by stage: before any stage it is the verifier's
    error; after a passed stage, with the program's runner alive, the next stage fails."""

    class Ended:
        def __init__(self, events):
            self.events = list(events)

        def next_event(self, timeout):
            if not self.events:
                raise EOFError
            return self.events.pop(0)

        def returncode(self):
            return "killed by SIGKILL"

        def tail(self):
            return ""

    passed = StageResult(name="reference", status="passed", message="ok").model_dump()
    v = Verifier(stages=["reference", "compile"], cache=False)
    got = v._events(Ended([{"check": 1, "start": "reference"}, {"check": 1, "result": passed}]), 1,
                    ["reference", "compile"], {})
    assert [(s.name, s.status) for s in got] == [("reference", "passed"), ("compile", "failed")]
    assert "after stage reference, while the program's runner was alive" in got[1].message
    got = v._events(Ended([]), 1, ["reference", "compile"], {})
    assert [(s.name, s.status) for s in got] == [("reference", "error")]


def test_the_runner_sees_a_clean_environment(task, runtime_judge):
    source = (CORPUS / "env" / "dump_environment.py").read_text()
    message = runtime_judge.check(task, source).failed_stage.message
    seen = set(message.split("ENVIRONMENT ")[1].split(" CWD")[0].strip("[]").replace("'", "").split(", "))
    # The allow-list (sandbox.runner_env), plus what the catalogue's imports set for themselves.
    leaked = [k for k in seen if k.startswith(("CODA_", "PYTEST", "OPENAI")) or "KEY" in k or "TOKEN" in k]
    assert not leaked and len(seen) < 30, seen
    cwd = message.split(" CWD ")[1].split(" HOME ")[0]
    assert "/coda-runners/run-" in cwd and message.split(" HOME ")[1].startswith(cwd)


KERNEL_LIBRARIES = """
import sys
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    raise RuntimeError(f"LOADED {sorted(m for m in ('cutlass', 'quack') if m in sys.modules)}")


def backward(saved, dy):
    return {}
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine starts each runner afresh, without a zygote")
def test_only_a_judge_that_compiles_loads_the_kernel_libraries(task, runtime_judge, compile_judge):
    """quack and CuTeDSL cost seconds of CPU in every zygote: a runner of the compile stage finds them
    loaded, a runner of the CPU reference stage alone does not (nor did its zygote pay for them)."""
    assert "LOADED []" in runtime_judge.check(task, KERNEL_LIBRARIES).failed_stage.message
    assert "LOADED ['cutlass', 'quack']" in compile_judge.check(task, KERNEL_LIBRARIES).failed_stage.message


FIRST_LAUNCH = """
import sys
from coda_agent.primitives import Tile, epilogue, gemm

BEFORE = set(sys.modules)


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    gemm(x, w, add_residual, residual=r)
    raise RuntimeError(f"IMPORTED {sorted(set(sys.modules) - BEFORE)}")


def backward(saved, dy):
    return {}
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine starts each runner afresh, without a zygote")
def test_a_runner_finds_what_its_first_launch_imports_loaded(task, runtime_judge):
    """A runner's first launch imports next to nothing: the zygote loaded the catalogue, and an
    eager launch skips torch's dispatcher, whose first custom-op call would import torch._dynamo
    (some 900 modules, most of two seconds of CPU) in every runner."""
    message = runtime_judge.check(task, FIRST_LAUNCH).failed_stage.message
    imported = message.split("IMPORTED ")[1].split("]")[0]
    assert imported.count("'") < 2 * 20, imported


def test_a_load_bomb_fails_fast_under_its_own_limit(task, runtime_judge):
    source = (CORPUS / "load" / "huge_power.py").read_text()
    t0 = time.perf_counter()
    report = runtime_judge.check(task, source)
    assert time.perf_counter() - t0 < 8  # the load's 3 s, not the run's 60
    assert "loading the program took longer than 3 s" in report.failed_stage.message


FAKE_JUDGE = """
import json, os, sys, time
out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for line in sys.stdin:
    n = json.loads(line)["check"]
    out.write(json.dumps({"check": n, "start": "correctness"}) + "\\n")
    out.write(json.dumps({"check": n, "waiting": "correctness"}) + "\\n")
    time.sleep(3)
    out.write(json.dumps({"check": n, "waited": 3.0}) + "\\n")
    time.sleep(1)
    out.write(json.dumps({"check": n, "result": {"name": "correctness", "status": "passed"}}) + "\\n")
    out.write(json.dumps({"check": n, "done": {"versions": {}}}) + "\\n")
"""


def test_waiting_for_the_gpu_never_counts(task, monkeypatch, tmp_path):
    """A judge that waits 3 s for the GPU lock and then works 1 s finishes under a 1.5 s budget
    (and no slack): the harness extends its backstop by every wait it is told of."""
    (tmp_path / "fake_judge.py").write_text(FAKE_JUDGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(harness, "JUDGE", "fake_judge")
    monkeypatch.setattr(harness, "BACKSTOP_S", 0.0)
    monkeypatch.setattr(verdict_cache, "cuda_available", lambda: True)
    monkeypatch.setattr(verdict_cache, "device_name", lambda gpu, index: "a simulated GPU")
    v = Verifier(stages=["correctness"], cache=False, timeout_s=1.5, load_timeout_s=0.0)
    report = v.check(task, EXPERT_PATH.read_text())
    assert [s.status for s in report.stages] == ["passed"], report.model_dump_json(indent=1)


PID_JUDGE = """
import json, os, sys, time
out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for line in sys.stdin:
    n = json.loads(line)["check"]
    time.sleep(1)
    out.write(json.dumps({"check": n, "result": {"name": "reference", "status": "passed",
                                                 "message": str(os.getpid())}}) + "\\n")
    out.write(json.dumps({"check": n, "done": {"versions": {}}}) + "\\n")
"""


def test_checks_from_several_threads_each_get_a_judge(task, monkeypatch, tmp_path):
    """``solve --samples 3`` checks from three threads at once: each check has a judge of its own
    (they run side by side), and the session keeps them for the next checks."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "pid_judge.py").write_text(PID_JUDGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(harness, "JUDGE", "pid_judge")
    source = EXPERT_PATH.read_text()
    with Verifier(stages=["reference"], cache=False) as v:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(3) as pool:
            reports = list(pool.map(lambda _: v.check(task, source), range(3)))
        wall = time.perf_counter() - t0
        pids = {r.stages[0].message for r in reports}
        assert all(r.outcome == "cpu_passed" for r in reports) and len(pids) == 3 and wall < 2.9
        assert v.check(task, source).stages[0].message in pids  # an idle judge of the session
        assert len(v._idle) == 3
    assert not v._idle


def test_gpu_detection_does_not_depend_on_the_cache_key(task, monkeypatch):
    def broken():
        raise verdict_cache.CacheKeyError("no version")

    asked = []
    monkeypatch.setattr(verdict_cache, "library_versions", broken)
    monkeypatch.setattr(verdict_cache, "cuda_available", lambda: True)
    monkeypatch.setattr(Verifier, "_judged", lambda self, task, source, stages, versions: asked.extend(stages) or [])
    report = Verifier(cache=True).check(task, EXPERT_PATH.read_text())
    assert report.cache_key is None
    assert {"correctness", "launch_audit", "performance"} <= set(asked)


# --------------------------------------------------------------------------- static stage, CLI, feedback

def test_static_failure_feedback_quotes_line(task):
    source = (CORPUS / "contract" / "try_except.py").read_text()
    report = Verifier(stages=CPU_STAGES, cache=False).check(task, source)
    assert report.outcome == "rejected" and len(report.stages) == 1
    text = render_feedback(report, source)
    assert "REJECTED at stage `static`" in text and ">" in text and "try:" in text


def test_an_oversized_program_is_refused_statically(task):
    report = Verifier(stages=CPU_STAGES, cache=False).check(task, "x = 1\n" * 100_000)
    assert report.outcome == "rejected" and "bytes; at most" in report.stages[0].message


def test_cli_verify_exit_codes(tmp_path, monkeypatch):
    from coda_agent.cli import app

    runner = CliRunner()
    runs = ["--runs-dir", str(tmp_path / "runs")]
    r = runner.invoke(app, ["verify", str(TASK_PATH), str(EXPERT_PATH), "--stages", "static,reference",
                            "--no-cache", *runs], catch_exceptions=False)
    assert r.exit_code == 3, r.output  # cpu_passed is not an acceptance
    bad = CORPUS / "torch_compute" / "import_torch.py"
    r = runner.invoke(app, ["verify", str(TASK_PATH), str(bad), "--json", *runs], catch_exceptions=False)
    assert r.exit_code == 1, r.output
    assert Report.model_validate_json(r.stdout).outcome == "rejected"
    r = runner.invoke(app, ["verify", str(tmp_path / "nope.yaml"), str(bad)], catch_exceptions=False)
    assert r.exit_code == 2
    slow = Report(task="t", program_sha256="x", outcome="correct_slow",
                  stages=[StageResult(name="performance", status="slow", message="correct but slow")])
    monkeypatch.setattr(Verifier, "check", lambda self, task, source: slow)
    r = runner.invoke(app, ["verify", str(TASK_PATH), str(EXPERT_PATH), *runs], catch_exceptions=False)
    assert r.exit_code == 4, r.output  # correct but slow is not an acceptance either
    assert "CORRECT BUT SLOW" in r.output


# --------------------------------------------------------------------------- compile (sm_90a on the CPU)

@pytest.mark.slow
def test_compile_stage_names_slow_path_division(task, compile_judge):
    """`a / b` in an epilogue compiles (it is correct) but to an IEEE division with a
    slow-path CALL per element; the compile stage says so and names the fix."""
    source = EXPERT_PATH.read_text().replace("acc + residual", "acc + residual / (acc * acc + 1.0)")
    res = compile_judge.check(task, source).stage("compile")
    assert res.status == "passed", res.message + res.log
    assert res.details["slow_calls"]["add_residual"] > 0
    assert "slow-path CALLs in add_residual" in res.message and "reciprocal(b)" in res.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_correct_on_gpu(task):
    """The tiny task's shapes are host-bound, so its speed verdict may go either way; it is correct."""
    report = Verifier(cache=False).check(task, EXPERT_PATH.read_text())
    assert report.correct, report.model_dump_json(indent=1)
    perf = report.stage("performance").details
    assert perf["ms"]["program"] > 0 and "vs_gemm" in perf and perf["wall_ms"]["program"] > 0


def test_a_stopped_zygote_is_replaced_not_waited_for(monkeypatch, tmp_path):
    """A runner behind lower walls (uid 0, no PID namespace) can stop the zygote that forks every
    runner of its judge: the judge waits for each of its answers only so long, then ends it and
    forks the next runner from a fresh one."""
    import os
    import signal
    import socket

    from coda_agent.verifier import sandbox, zygote
    from coda_agent.verifier.wire import Channel

    monkeypatch.setattr(zygote, "ANSWER_S", 1.0)
    z = zygote.Zygote(compiles=False)
    try:
        z.start()
        assert zygote.recv_reply(z.sock, zygote.START_S).get("ready")
        z.ready = True
        os.kill(z.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert z.status(12345, 0.1) is None and time.monotonic() - t0 < 10
        assert z.proc.poll() is not None  # ended, stopped as it was
        mine, theirs = socket.socketpair()
        log_r, log_w = os.pipe()
        plan = sandbox.plan_for("print(1)", tmp_path / "scratch", cuda=False, cpu_seconds=60)
        env = sandbox.runner_env(plan, sandbox.RUNNER_ENV)
        pid = z.fork(plan, env, theirs.fileno(), log_w)  # from a fresh zygote
        theirs.close()
        os.close(log_w)
        hello, _ = Channel(mine).recv(60)
        assert pid > 0 and hello.get("ready"), hello
        mine.close()
        assert z.status(pid, 10) is not None
        os.close(log_r)
    finally:
        z.close()
