"""`coda-agent eval` end to end: offline authors, an LLM endpoint, simulated GPUs, kill and resume.

Every check of the summary is against the run directories themselves
(:func:`runs_say`), read here independently of eval/summary.py.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from agent_fixtures import GOOD, WRONG, cli_killed_when, fenced
from eval_fixtures import buggy, perf_program, three_tasks, write_tasks
from typer.testing import CliRunner

from coda_agent.agent.rundir import read_events
from coda_agent.cli import app

pytestmark = pytest.mark.usefixtures("agent_env")
SIM = ["--verifier", "eval_fixtures:SimVerifier"]


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


def only_batch(runs: Path) -> Path:
    (batch,) = [p for p in runs.iterdir() if p.name.startswith("batch-")]
    return batch


def runs_say(batch: Path) -> dict[str, dict]:
    """Per task, straight from each trajectory's result.json: accepted, cpu_passed, turns, tokens."""
    out = {}
    for task_dir in sorted(p for p in batch.iterdir() if p.is_dir() and not p.name.startswith(".")):
        results = [json.loads((s / "result.json").read_text())
                   for s in sorted(task_dir.glob("sample-*"), key=lambda p: p.name)]
        out[task_dir.name] = {"accepted": sum(r["accepted"] for r in results),
                              "cpu_passed": sum(r["stop_reason"] == "cpu_passed" for r in results),
                              "turns": [r["turns"] for r in results],
                              "tokens": sum(r["prompt_tokens"] + r["completion_tokens"] for r in results),
                              "stops": [r["stop_reason"] for r in results]}
    return out


def check_summary_against_runs(batch: Path) -> dict:
    summary = json.loads((batch / "summary.json").read_text())
    truth = runs_say(batch)
    assert [t["task"] for t in summary["tasks"]] == sorted(truth)
    for t in summary["tasks"]:
        want = truth[t["task"]]
        assert (t["accepted"], t["cpu_passed"], t["turns"], t["tokens"]) == \
               (want["accepted"], want["cpu_passed"], want["turns"], want["tokens"]), t["task"]
    s = summary["suite"]
    assert s["accepted_trajectories"] == sum(w["accepted"] for w in truth.values())
    assert s["cpu_passed_trajectories"] == sum(w["cpu_passed"] for w in truth.values())
    assert s["tokens"] == sum(w["tokens"] for w in truth.values())
    assert s["finished"] == s["trajectories"]
    return summary


def test_expert_then_replay_on_a_cpu_machine(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")  # alpha and gamma pass, beta's expert computes outside the epilogue
    runs = tmp_path / "runs"
    r = cli("eval", tasks, "--author", "expert", "--samples", 2, "--workers", 2, "--runs-dir", runs, *SIM)
    assert r.exit_code == 3, r.output
    batch = only_batch(runs)
    summary = check_summary_against_runs(batch)
    by_task = {t["task"]: t for t in summary["tasks"]}
    # cpu_passed is reported honestly, never as accepted
    assert by_task["alpha"]["cpu_passed"] == 2 and by_task["alpha"]["accepted"] == 0
    assert by_task["beta"]["cpu_passed"] == 0 and by_task["beta"]["turns"] == [1, 1]
    s = summary["suite"]
    assert s["pass_at_k"] == {"1": 0.0, "2": 0.0} and s["fast_p"] == {"gemm": None, "compile": None}
    assert s["cpu_passed_tasks"] == 2 and s["solved_tasks"] == 0
    md = (batch / "summary.md").read_text()
    assert "| alpha | no (cpu_passed 2/2) | 1, 1 | - | n/a | n/a | 0 | $0.0000 |" in md
    assert "nothing could be accepted" in md and md in r.output
    # every attempt says which verification thread judged it
    report = json.loads((batch / "alpha/sample-0/attempts/01/report.json").read_text())
    assert report["versions"]["ran_on"] in ("cpu-0", "cpu-1")
    assert json.loads((batch / "batch.json").read_text())["workers"] == {"cpu": 2, "gpus": []}

    # replay the batch: task T sample i replays T/sample-i, with no endpoint
    r = cli("eval", tasks, "--author", "replay", "--transcript", batch, "--samples", 2,
            "--runs-dir", tmp_path / "replays", *SIM)
    assert r.exit_code == 3, r.output
    replay = only_batch(tmp_path / "replays")
    assert runs_say(replay) == runs_say(batch)
    cfg = json.loads((replay / "gamma/sample-1/config.json").read_text())["config"]
    assert cfg["transcript"] == str(batch / "gamma/sample-1")


def test_a_crashing_verification_stops_its_trajectories_and_the_batch_goes_on(tmp_path):
    tasks = write_tasks(tmp_path / "tasks", {"alpha": GOOD, "crashy": buggy(GOOD, "cpu"), "gamma": GOOD})
    r = cli("eval", tasks, "--author", "expert", "--samples", 2, "--workers", 2, "--runs-dir", tmp_path / "runs",
            *SIM)
    assert r.exit_code == 3, r.output
    batch = only_batch(tmp_path / "runs")
    check_summary_against_runs(batch)
    assert {t: w["stops"] for t, w in runs_say(batch).items()} == {
        "alpha": ["cpu_passed"] * 2, "crashy": ["verifier_error"] * 2, "gamma": ["cpu_passed"] * 2}
    report = json.loads((batch / "crashy/sample-1/attempts/01/report.json").read_text())
    assert report["outcome"] == "error" and report["versions"]["ran_on"] in ("cpu-0", "cpu-1")
    assert report["stages"][0]["message"] == "the verifier raised RuntimeError: a simulated verifier bug on the cpu"
    assert "crashy sample 0: verifier_error after 1 turns" in r.output
    r = cli("eval", "--resume", batch, *SIM)  # as every stop but model_error, a verifier error is final
    assert r.exit_code == 3 and "resuming: 6 finished trajectories kept, 0 to run" in r.output, r.output


def test_simulated_gpus_split_the_stages_and_give_speedups(tmp_path, monkeypatch):
    # Two "GPUs": the GPU threads' judges get CUDA_VISIBLE_DEVICES=3 and =5; SimVerifier's GPU stages report
    # the performance numbers written in each expert program.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    tasks = write_tasks(tmp_path / "tasks", {"fast": perf_program(0.95, 1.6), "slow": perf_program(1.25, 0.9),
                                             "wrong": WRONG})
    r = cli("eval", tasks, "--author", "expert", "--samples", 2, "--workers", 1, "--runs-dir", tmp_path / "runs",
            *SIM)
    assert r.exit_code == 0, r.output
    batch = only_batch(tmp_path / "runs")
    summary = check_summary_against_runs(batch)
    by_task = {t["task"]: t for t in summary["tasks"]}
    assert by_task["fast"]["accepted"] == 2 and by_task["fast"]["turns_to_accept"] == 1
    assert by_task["fast"]["best_speedup_vs_gemm"] == pytest.approx(1 / 0.95, abs=1e-4)
    # correct but slower than its targets: not accepted, but correct, with its numbers
    assert by_task["slow"]["accepted"] == 0 and by_task["slow"]["correct"] == 2
    assert by_task["slow"]["best_speedup_vs_compile"] == 0.9
    assert by_task["wrong"]["best_speedup_vs_gemm"] is None and by_task["wrong"]["correct"] == 0
    s = summary["suite"]
    assert s["pass_at_k"]["1"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["correct_at_k"]["1"] == pytest.approx(2 / 3, abs=1e-4)
    # fast_p over all 3 tasks: speedups vs GEMM 1.053 and 0.8; vs compile 1.6 and 0.9
    assert s["fast_p"]["gemm"] == pytest.approx({"0.0": 2 / 3, "0.8": 1 / 3, "1.0": 1 / 3, "1.2": 0, "1.5": 0},
                                                abs=1e-4)
    assert s["fast_p"]["compile"] == pytest.approx({"0.0": 2 / 3, "0.8": 2 / 3, "1.0": 1 / 3, "1.2": 1 / 3,
                                                    "1.5": 1 / 3}, abs=1e-4)
    assert s["geomean_speedup"]["compile"] == pytest.approx((1.6 * 0.9) ** 0.5, abs=1e-3)
    ran_on = {json.loads(p.read_text())["versions"]["ran_on"] for p in batch.glob("fast/*/attempts/01/report.json")}
    assert ran_on <= {"cpu-0 + gpu-3", "cpu-0 + gpu-5"}, ran_on
    wrong = json.loads((batch / "wrong/sample-0/attempts/01/report.json").read_text())
    assert wrong["versions"]["ran_on"] == "cpu-0" and wrong["outcome"] == "rejected"  # never reached a GPU
    assert "| fast | yes (2/2) | 1, 1 | 1 | 1.05x | 1.60x |" in (batch / "summary.md").read_text()


def test_llm_batch_against_an_endpoint(tmp_path, openai_server):
    tasks = three_tasks(tmp_path / "tasks")
    # one trajectory at a time: alpha s0 needs two turns, then everything is right the first time
    openai_server.reply(fenced(WRONG), prompt_tokens=1000, completion_tokens=200)
    openai_server.fallback = ("reply", fenced(GOOD), 100, 50, "stop")
    r = cli("eval", tasks, "--model", "test-model", "--base-url", openai_server.base_url, "--samples", 2,
            "--concurrency", 1, "--runs-dir", tmp_path / "runs", *SIM)
    assert r.exit_code == 3, r.output
    batch = only_batch(tmp_path / "runs")
    summary = check_summary_against_runs(batch)
    assert len(openai_server.requests) == 7
    assert summary["tasks"][0]["turns"] == [2, 1] and summary["tasks"][0]["tokens"] == 1200 + 150 + 150
    assert summary["suite"]["tokens"] == 1200 + 6 * 150 and summary["model"] == "test-model"
    assert summary["suite"]["cost_usd"] is None  # no price for test-model: unknown, not $0
    assert "cost unknown" in r.output or "unknown" in (batch / "summary.md").read_text()


def test_kill_halfway_and_resume(tmp_path, openai_server):
    tasks = three_tasks(tmp_path / "tasks")
    runs = tmp_path / "runs"
    # Two trajectories at a time: the first two finish, the next two hang and the CLI is killed.
    openai_server.reply(fenced(GOOD))
    openai_server.reply(fenced(GOOD))
    gates = [openai_server.hang(), openai_server.hang()]
    openai_server.fallback = ("reply", fenced(GOOD), 100, 50, "stop")
    with cli_killed_when(openai_server, 4, "eval", tasks, "--model", "test-model", "--base-url",
                         openai_server.base_url, "--samples", 2, "--concurrency", 2, "--runs-dir", runs, *SIM,
                         gates=tuple(gates)):
        batch = only_batch(runs)
        done_before = {p.parent for p in batch.glob("*/sample-*/result.json")
                       if json.loads(p.read_text())["stop_reason"]}
        assert len(done_before) == 2
    transcripts = {p: (p / "transcript.jsonl").read_bytes() for p in done_before}
    assert not (batch / "summary.json").exists()

    r = cli("report", batch)  # a report of a killed batch says so
    assert r.exit_code == 0 and "Incomplete: 2 of 6 trajectories finished" in r.output, r.output

    r = cli("eval", "--resume", batch, *SIM)
    assert r.exit_code == 3, r.output
    assert "resuming: 2 finished trajectories kept, 4 to run" in r.output
    # the two hung requests are asked again, the two never-started trajectories ask once each
    assert len(openai_server.requests) == 4 + 4
    for p, data in transcripts.items():  # finished trajectories were not touched
        assert (p / "transcript.jsonl").read_bytes() == data
    for tdir in batch.glob("*/sample-*"):  # every trajectory judged exactly once
        events = read_events(tdir / "transcript.jsonl")
        assert [e["attempt"] for e in events if e["event"] == "attempt"] == [1], tdir
        assert sorted(p.name for p in (tdir / "attempts").iterdir()) == ["01"]
    assert sorted(p.name for p in batch.iterdir() if p.is_dir()) == ["alpha", "beta", "gamma"]
    summary = check_summary_against_runs(batch)
    assert summary["suite"]["cpu_passed_trajectories"] == 6 and summary["suite"]["accepted_trajectories"] == 0

    r = cli("eval", "--resume", batch, *SIM)  # a finished batch stays finished
    assert r.exit_code == 3 and len(openai_server.requests) == 8, r.output


def test_clean_errors(tmp_path):
    r = cli("eval", tmp_path / "nope", "--author", "expert")
    assert r.exit_code == 2 and "no such task file" in r.output, r.output
    tasks = three_tasks(tmp_path / "tasks")
    r = cli("eval", tasks, "--runs-dir", tmp_path / "runs")
    assert r.exit_code == 2 and "no model configured" in r.output and not (tmp_path / "runs").exists(), r.output
    r = cli("eval", "--resume", tmp_path)
    assert r.exit_code == 2 and "not a batch directory" in r.output, r.output


def test_resume_asks_again_where_the_endpoint_failed(tmp_path, openai_server):
    tasks = three_tasks(tmp_path / "tasks")
    openai_server.status(401)  # alpha's only request: model_error, a stop that resume retries
    openai_server.fallback = ("reply", fenced(GOOD), 100, 50, "stop")
    args = ["--model", "test-model", "--base-url", openai_server.base_url, *SIM]
    r = cli("eval", tasks, "--concurrency", 1, "--runs-dir", tmp_path / "runs", *args)
    assert r.exit_code == 3 and "alpha sample 0: model_error" in r.output, r.output
    batch = only_batch(tmp_path / "runs")
    assert runs_say(batch)["alpha"]["stops"] == ["model_error"]
    r = cli("eval", "--resume", batch, "--base-url", openai_server.base_url, *SIM)
    assert r.exit_code == 3 and "resuming: 2 finished trajectories kept, 1 to run" in r.output, r.output
    assert len(openai_server.requests) == 4
    assert {t: w["stops"] for t, w in runs_say(batch).items()} == \
           {"alpha": ["cpu_passed"], "beta": ["cpu_passed"], "gamma": ["cpu_passed"]}
    check_summary_against_runs(batch)


def test_nothing_accepted_exits_non_zero_naming_every_stop_and_its_message(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    started = time.monotonic()
    r = cli("eval", tasks, "--model", "m", "--base-url", url, "--runs-dir", tmp_path / "runs", *SIM)
    assert time.monotonic() - started < 30  # the default six retries from 1 s would take over a minute
    assert r.exit_code == 1, r.output
    why = "cannot reach " + url + ": [Errno 111] Connection refused; is the server running"
    for task in ("alpha", "beta", "gamma"):
        assert f"{task} sample 0: model_error after 0 turns: {why}" in r.output
    batch = only_batch(tmp_path / "runs")
    summary = json.loads((batch / "summary.json").read_text())
    assert summary["suite"]["stop_reasons"] == {"model_error": 3}
    assert all(why in t["trajectories"][0]["detail"] for t in summary["tasks"])
    md = (batch / "summary.md").read_text()
    assert "## Stopped without passing" in md and f"- beta sample 0: model_error: {why}" in md
    assert "| stop reasons | model_error 3 |" in md


def test_a_bad_task_file_is_reported_and_skipped(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")
    (tasks / "broken.yaml").write_text("name: broken\nsummary: [unclosed\n")
    r = cli("eval", tasks, "--author", "expert", "--runs-dir", tmp_path / "runs", *SIM)
    assert r.exit_code == 3, r.output
    assert f"skipped: {tasks / 'broken.yaml'}: not valid YAML" in r.output
    assert [t["task"] for t in check_summary_against_runs(only_batch(tmp_path / "runs"))["tasks"]] == \
           ["alpha", "beta", "gamma"]
    r = cli("tasks", "list", tasks)
    assert r.exit_code == 0 and "alpha" in r.output and f"skipped: {tasks / 'broken.yaml'}" in r.output, r.output


def test_sets_reach_every_verifier_and_must_exist(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")
    r = cli("eval", tasks, "--author", "expert", "--sets", "small", "--runs-dir", tmp_path / "runs", *SIM)
    assert r.exit_code == 3, r.output
    reports = list(only_batch(tmp_path / "runs").glob("*/sample-0/attempts/01/report.json"))
    assert len(reports) == 3 and {json.loads(p.read_text())["versions"]["shape_sets"] for p in reports} == {"small"}
    r = cli("eval", tasks, "--author", "expert", "--sets", "llama3-8b", "--runs-dir", tmp_path / "runs2", *SIM)
    assert r.exit_code == 2 and "--sets: task alpha has no shape set 'llama3-8b'" in r.output, r.output


def test_only_runs_the_named_tasks_of_a_folder(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")
    r = cli("eval", tasks, "--only", "gamma, alpha", "--author", "expert", "--runs-dir", tmp_path / "runs", *SIM)
    assert r.exit_code == 3, r.output
    assert [t["task"] for t in check_summary_against_runs(only_batch(tmp_path / "runs"))["tasks"]] == \
           ["alpha", "gamma"]
    r = cli("eval", tasks, "--only", "alpha,delta", "--author", "expert", "--runs-dir", tmp_path / "runs2", *SIM)
    assert r.exit_code == 2 and "--only: delta: not a task of" in r.output and "alpha, beta, gamma" in r.output, \
        r.output
    assert not (tmp_path / "runs2").exists()
    r = cli("eval", "--resume", only_batch(tmp_path / "runs"), "--only", "alpha", *SIM)
    assert r.exit_code == 2 and "a resumed batch keeps its tasks" in r.output, r.output


def test_author_expert_names_the_tasks_without_one(tmp_path):
    tasks = three_tasks(tmp_path / "tasks")
    beta = tasks / "beta.yaml"
    beta.write_text(beta.read_text().replace("expert: experts/beta.py\n", ""))
    r = cli("eval", tasks, "--author", "expert", "--runs-dir", tmp_path / "runs", *SIM)
    assert r.exit_code == 2 and f"--author expert: beta ({beta}) has no expert program" in r.output, r.output
    assert not (tmp_path / "runs").exists()


def test_report_without_a_batch_takes_the_newest(tmp_path):
    runs = tmp_path / "runs"
    r = cli("report", "--runs-dir", runs)
    assert r.exit_code == 2 and f"no batch directory under {runs}/" in r.output, r.output
    first = write_tasks(tmp_path / "one", {"alpha": GOOD})
    second = write_tasks(tmp_path / "two", {"omega": GOOD})
    for tasks in (first, second):
        assert cli("eval", tasks, "--author", "expert", "--runs-dir", runs, *SIM).exit_code == 3
    r = cli("report", "--runs-dir", runs)
    assert r.exit_code == 0 and "| omega |" in r.output and "| alpha |" not in r.output, r.output
