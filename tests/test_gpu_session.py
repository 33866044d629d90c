"""scripts/gpu-session.sh, the driver of a device call, run for real on the CPU: its parts
run under their limits, and whatever happened comes back as one tarball."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _session(tmp_path: Path, parts: list[str], **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    out.mkdir()
    run_env = {**os.environ, "OUT": str(out), "CODA_CACHE_DIR": str(tmp_path / "cache"),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-session.sh"), *parts], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=600)
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    return proc, tmp_path / "back" / "r"


def test_check_part_verifies_experts_side_by_side_and_everything_comes_back(tmp_path):
    family = "tests/tasks/families/opt/opt_mlp.yaml=tests/tasks/families/opt/opt_mlp_program.py"
    proc, back = _session(tmp_path, ["nothing:5", "check:300"],
                          CHECK_TASKS=f"llama3/swiglu_fwd llama3/no_such_task {family}",
                          CHECK_ARGS="--stages static,reference --sets small")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = (back / "parts.txt").read_text()
    assert "unknown part: nothing" in parts and "check rc=1" in parts  # one check failed, the part says so
    report = json.loads((back / "check" / "llama3-swiglu_fwd.json").read_text())
    assert report["task"] == "swiglu_fwd" and report["outcome"] == "cpu_passed", report["outcome"]
    assert [s["name"] for s in report["stages"]][:2] == ["static", "reference"]
    assert "no_such_task" in (back / "check" / "llama3-no_such_task.log").read_text()
    own = json.loads((back / "check" / "opt-opt_mlp.json").read_text())  # a task outside the suites, by path
    assert own["task"] == "opt_mlp" and own["outcome"] == "cpu_passed", own["outcome"]
    assert (back / "machine.txt").exists()
    assert not (tmp_path / "out" / "r").exists()  # only the tarball is left to come back


@pytest.mark.parametrize("jobs", [1, 2])
def test_check_part_runs_at_most_check_jobs_verifies_at_a_time(tmp_path, jobs):
    """CHECK_JOBS=N: at most N verifies run at once, in the order given (a python3 on the PATH logs
    when each of the part's interpreters starts and ends, then runs the real one)."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/usr/bin/env bash\necho \"start $$ $(date +%s%N) $*\" >> {log}\n"
                                     f"{sys.executable} \"$@\"\nrc=$?\necho \"end $$ $(date +%s%N)\" >> {log}\n"
                                     "exit $rc\n")
    (bin_dir / "python3").chmod(0o755)
    names = ["swiglu_fwd", "rope_fwd", "rope_bwd"]
    proc, back = _session(tmp_path, ["check:300"], CHECK_TASKS=" ".join(f"llama3/{n}" for n in names),
                          CHECK_ARGS="--stages static,reference --sets small", CHECK_JOBS=str(jobs),
                          PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(json.loads((back / "check" / f"llama3-{n}.json").read_text())["outcome"] == "cpu_passed"
               for n in names)
    events, order = [], []
    for line in log.read_text().splitlines():
        kind, pid, ns, *args = line.split()
        if kind == "start" and "verify" in args:
            order.append(next(n for n in names if f"tasks/llama3/{n}.yaml" in args))
        if "verify" in args or kind == "end":
            events.append((int(ns), kind, pid))
    verifies = {pid for _, kind, pid in events if kind == "start"}
    running, most = 0, 0
    for _, kind, pid in sorted(events):
        if pid in verifies:
            running += 1 if kind == "start" else -1
            most = max(most, running)
    # the first `jobs` start together (their log lines may interleave), the rest in the order given
    assert most == jobs and sorted(order[:jobs]) == sorted(names[:jobs]) and order[jobs:] == names[jobs:], \
        (order, most)


def test_a_part_past_its_limit_is_stopped_and_the_next_one_runs(tmp_path):
    proc, back = _session(tmp_path, ["check:2", "nothing:5"], CHECK_TASKS="llama3/swiglu_fwd")
    assert proc.returncode == 0, proc.stderr
    parts = (back / "parts.txt").read_text().splitlines()
    assert parts[0].startswith("check rc=124") and parts[1] == "unknown part: nothing"


def test_verify_part_takes_the_tasks_it_names(tmp_path):
    """verify-SUITE=A,B hands the names to `eval --only`: a name the suite lacks fails the part
    at once, naming the suite's tasks, and the next part still runs."""
    proc, back = _session(tmp_path, ["verify-llama3=no_such_task:120", "nothing:5"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = (back / "parts.txt").read_text()
    assert "verify-llama3 rc=2" in parts and "unknown part: nothing" in parts, parts
    log = (back / "verify-llama3.log").read_text()
    assert "--only: no_such_task: not a task of tasks/llama3" in log and "swiglu_fwd" in log, log


def _pytest_recorder(tmp_path: Path) -> tuple[str, Path]:
    """A PATH whose python3 records a pytest call's arguments and runs anything else."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "pytest-calls.txt"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m pytest" ]; then shift 2; echo "$@" >> {calls}; exit 0; fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    return os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]), calls


def test_tests_and_passes_parts_run_what_they_are_given(tmp_path):
    """``tests`` hands GPU_TESTS to pytest's GPU tier; ``passes`` runs bench/passes.py with
    PASSES_ARGS, and its results file comes back."""
    path, calls = _pytest_recorder(tmp_path)
    proc, back = _session(tmp_path, ["tests:60", "passes:300"], PATH=path,
                          GPU_TESTS="tests/test_passes_gpu.py -k pass_kernel", PASSES_ARGS="--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = calls.read_text().split()
    assert args[:2] == ["-m", "gpu"] and args[-3:] == ["tests/test_passes_gpu.py", "-k", "pass_kernel"], args
    parts = (back / "parts.txt").read_text()
    assert "tests rc=0" in parts and "passes rc=0" in parts, parts
    rows = json.loads((back / "passes.json").read_text())["bandwidth"]
    assert {"pass", "copy"} <= set(rows["dgelu T=256 N=128"]), rows


def test_tier_shares_split_the_gpu_test_files_between_calls(tmp_path):
    """tier=1/2 and tier=2/2 hand disjoint halves of the GPU-marked test files to pytest, which
    together are the whole tier.  The python3 the driver finds first records a pytest call's
    arguments (collecting the GPU files twice costs 20 s of CI) and runs anything else."""
    path, calls = _pytest_recorder(tmp_path)
    proc, back = _session(tmp_path, ["tier=1/2:60", "tier=2/2:60"], PATH=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line.split() for line in calls.read_text().splitlines()]
    shares = [{a for a in args if a.startswith("tests/")} for args in runs]
    assert len(shares) == 2 and shares[0] and shares[1] and not shares[0] & shares[1]
    gpu_files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                 if "pytest.mark." + "gpu" in p.read_text() and p.name != "test_suite_gpu.py"}
    assert shares[0] | shares[1] == gpu_files
    assert all(args[:2] == ["-m", "gpu"] and "not every_config and not test_expert_on_gpu" in " ".join(args)
               for args in runs)
    parts = (back / "parts.txt").read_text()
    assert "tier-1of2 rc=0" in parts and "tier-2of2 rc=0" in parts


def test_gpu_parts_resplits_the_staged_wheels_into_smaller_parts_that_concatenate_back(tmp_path):
    """scripts/gpu-parts.sh: prepare.sh's parts, cut again at SIZE, hold the same bytes in the
    order stage.sh concatenates them (its glob's), each folder with the stage script and the count."""
    import random
    import shutil

    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu-parts.sh", root / "scripts")
    data = random.Random(0).randbytes(250_000)
    for i, chunk in enumerate((data[:150_000], data[150_000:])):
        part = root / ".gpu" / f"p{i}"
        part.mkdir(parents=True)
        (part / f"part.{i}").write_bytes(chunk)
        (part / "stage.sh").write_text("echo stage\n")
        (part / "count").write_text("2\n")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu-parts.sh"), "60K"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    folders = sorted((root / ".gpu").glob("p*"), key=lambda p: int(p.name[1:]))
    assert [p.name for p in folders] == ["p0", "p1", "p2", "p3", "p4"], proc.stdout
    parts = sorted(q for p in folders for q in p.glob("part.*"))  # stage.sh's `part.*` order
    assert all(q.stat().st_size <= 60 * 1024 for q in parts)
    assert b"".join(q.read_bytes() for q in parts) == data
    assert all((p / "count").read_text().strip() == "5" and (p / "stage.sh").exists() for p in folders)
