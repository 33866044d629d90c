"""What a runner leaves behind ends when it ends (verifier/strays.py): a child that leaves the
runner's session outlives the judge's kill of its process group, and where the runner has no PID
namespace (every GPU runner; a CPU runner under CODA_SANDBOX=uid or none) nothing else ends it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_verifier_corpus import _forged_processes
from verifier_helpers import TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier, strays

CORPUS = Path(__file__).parent / "bad_programs"


def test_a_child_that_leaves_the_runners_session_ends_with_the_runner(monkeypatch):
    """Without namespaces (the walls a GPU runner has) the corpus program's child, which calls setsid
    and names itself coda-forged, is the judge's to end: it outlived the check before."""
    monkeypatch.setenv("CODA_SANDBOX", "none")
    source = (CORPUS / "processes" / "child_outlives_the_check.py").read_text()
    report = Verifier(stages=["reference"], cache=False, timeout_s=60).check(load_task(TASK_PATH), source)
    assert report.outcome == "rejected" and "all zeros" in report.failed_stage.message
    deadline = time.monotonic() + 5
    while _forged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _forged_processes(), "the runner's escaped child outlived its check"


# A judge in miniature: a worker of its own session (as torch.compile's are), and a runner (a session
# of its own) whose child leaves it and starts one more; the runner is killed by its group, as the
# judge kills it, and then released.
SWEEP = r'''
import os, signal, subprocess, sys, time
from coda_agent.verifier import strays

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

RUNNER = """
import os, time
if os.fork() == 0:
    os.setsid()
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), grandchild, flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""
assert strays.adopt()
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
runner = subprocess.Popen([sys.executable, "-c", RUNNER], start_new_session=True, stdout=subprocess.PIPE, text=True)
strays.register(runner.pid)
escaped = [int(p) for p in runner.stdout.readline().split()]
assert strays.strays() == [], "a live runner's tree is its own"
os.killpg(runner.pid, signal.SIGKILL)
runner.wait()
time.sleep(0.2)
assert all(alive(p) for p in escaped), "the group kill ends them"
ended = strays.release(runner.pid)
time.sleep(0.2)
assert not any(alive(p) for p in escaped), escaped
assert worker.poll() is None, "the judge's own session is kept"
assert not strays.strays(), "every stray is reaped"
worker.kill()
print("ended", ended)
'''


def test_the_sweep_ends_a_released_runners_strays_and_spares_the_judges_own():
    out = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ended", "2"]


def test_a_process_that_did_not_adopt_sweeps_nothing(monkeypatch):
    """A test that builds a runner in its own process keeps its other children (a pytest worker's
    judges are sessions of their own)."""
    monkeypatch.setattr(strays, "_adopted", False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert strays.release(child.pid + 10**7) == 0
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("stat", "want"), [("123 (a) S 1 (b) R 1 99 77 0", ("R", 1, 77)),
                                           ("123 (plain) S 1 123 55 0", ("S", 1, 55))])
def test_a_command_name_cannot_forge_its_parent_or_session(stat, want):
    assert strays.parse_stat(stat) == want
