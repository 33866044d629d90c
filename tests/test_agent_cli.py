"""`coda-agent solve` through the CLI: offline authors, an LLM endpoint, errors, kill and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_fixtures import GOOD, WRONG, cli_killed_when, fenced
from typer.testing import CliRunner

from coda_agent.agent.rundir import read_events
from coda_agent.cli import app

pytestmark = pytest.mark.usefixtures("agent_env")
RULE = ["--verifier", "agent_fixtures:RuleVerifier"]


def solve(*args: str):
    return CliRunner().invoke(app, ["solve", *map(str, args)], catch_exceptions=False)


def only_run(runs: Path) -> Path:
    (run,) = runs.iterdir()
    return run


def test_nothing_configured_is_a_clean_error(agent_task, tmp_path):
    r = solve(agent_task.path, "--runs-dir", tmp_path / "runs")
    assert r.exit_code == 2, r.output
    assert "error: no model configured" in r.output and "--author expert" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "runs").exists()


def test_bad_task_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    r = solve(bad, "--author", "expert")
    assert r.exit_code == 2 and "summary: required field is missing" in r.output, r.output


def test_expert_then_replay_with_no_model(agent_task, tmp_path):
    runs = tmp_path / "runs"
    r = solve(agent_task.path, "--author", "expert", "--runs-dir", runs, *RULE)
    assert r.exit_code == 0, r.output
    assert "sample 0: accepted after 1 turns" in r.output and "accepted 1/1" in r.output
    run = only_run(runs)
    assert run.name.endswith("-scale_add-expert")
    assert (run / "accepted/program.py").read_text() == GOOD
    assert json.loads((run / "config.json").read_text())["config"]["author"] == "expert"

    r = solve(agent_task.path, "--author", "replay", "--transcript", run, "--runs-dir", tmp_path / "replays", *RULE)
    assert r.exit_code == 0, r.output
    assert (only_run(tmp_path / "replays") / "accepted/program.py").read_text() == GOOD


def test_llm_run_against_an_endpoint(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(WRONG))
    openai_server.reply(fenced(GOOD))
    r = solve(agent_task.path, "--base-url", openai_server.base_url, "--model", "test-model", "--temperature", "0.3",
              "--runs-dir", tmp_path / "runs", *RULE)
    assert r.exit_code == 0, r.output
    assert "sample 0: accepted after 2 turns, best attempt 02 (accepted)" in r.output
    assert openai_server.requests[0]["temperature"] == 0.3
    run = only_run(tmp_path / "runs")
    assert run.name.endswith("-scale_add-test-model")
    assert json.loads((run / "config.json").read_text())["config"]["llm"]["base_url"] == openai_server.base_url

    # the recording replays turn by turn with no endpoint, and ends where it ended
    r = solve(agent_task.path, "--author", "replay", "--transcript", run / "transcript.jsonl",
              "--runs-dir", tmp_path / "replays", *RULE)
    assert r.exit_code == 0 and "sample 0: accepted after 2 turns" in r.output, r.output
    assert len(openai_server.requests) == 2


def test_cpu_passed_is_not_an_acceptance_nor_a_failure(agent_task, tmp_path):
    r = solve(agent_task.path, "--author", "expert", "--runs-dir", tmp_path / "runs",
              "--verifier", "agent_fixtures:cpu_verifier")
    assert r.exit_code == 3, r.output
    assert "sample 0: cpu_passed" in r.output and "accepted 0/1" in r.output


def test_endpoint_failure_is_reported_not_a_traceback(agent_task, openai_server, tmp_path):
    openai_server.status(401)
    r = solve(agent_task.path, "--base-url", openai_server.base_url, "--model", "m", "--runs-dir",
              tmp_path / "runs", *RULE)
    assert r.exit_code == 1, r.output
    assert "sample 0: model_error" in r.output and "set OPENAI_API_KEY" in r.output


def test_kill_and_resume_loses_and_repeats_nothing(agent_task, openai_server, tmp_path):
    runs = tmp_path / "runs"
    openai_server.reply(fenced(WRONG))
    gate = openai_server.hang()  # the second request hangs: the process is killed while waiting
    with cli_killed_when(openai_server, 2, "solve", agent_task.path, "--base-url", openai_server.base_url,
                         "--model", "test-model", "--runs-dir", runs, *RULE, gates=(gate,)):
        run = only_run(runs)
        assert (run / "attempts/01/report.json").is_file()
    assert not (run / "attempts/02").exists()

    openai_server.reply(fenced(GOOD))
    r = solve("--resume", run, *RULE)
    assert r.exit_code == 0, r.output
    assert "sample 0: accepted after 2 turns" in r.output
    # the resumed request is exactly the one the killed process was waiting for
    assert openai_server.requests[2]["messages"] == openai_server.requests[1]["messages"]
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["01", "02"]
    assert (run / "attempts/01/program.py").read_text() == WRONG
    assert (run / "attempts/02/program.py").read_text() == GOOD
    events = read_events(run / "transcript.jsonl")
    kinds = [e["kind"] for e in events if e["event"] == "message"]
    assert kinds == ["system", "task", "assistant", "feedback", "assistant"]
    assert [e["attempt"] for e in events if e["event"] == "attempt"] == [1, 2]
    assert json.loads((run / "result.json").read_text())["stop_reason"] == "accepted"

    r = solve("--resume", run, *RULE)  # a finished run stays finished
    assert r.exit_code == 0 and len(openai_server.requests) == 3, r.output


def test_resume_judges_a_logged_reply_without_asking_again(agent_task, openai_server, tmp_path):
    class KilledWhileJudging:
        def check(self, task, program_source):
            raise KeyboardInterrupt  # stands in for a kill between logging the reply and judging it

    from coda_agent.agent import OpenAIModel, RunDir, load_config, solve as run_loop

    cfg = load_config({"llm": {"base_url": openai_server.base_url, "model": "test-model"}}).check()
    run = RunDir.create(tmp_path / "runs", agent_task, "test-model", cfg.model_dump(mode="json"))
    openai_server.reply(fenced(GOOD))
    with pytest.raises(KeyboardInterrupt):
        run_loop(agent_task, cfg, run, OpenAIModel(cfg.llm), KilledWhileJudging(), "C")
    assert json.loads((run.path / "result.json").read_text())["stop_reason"] is None
    r = solve("--resume", run.path, *RULE)
    assert r.exit_code == 0, r.output
    assert len(openai_server.requests) == 1  # judged on resume, never asked again
    assert sorted(p.name for p in (run.path / "attempts").iterdir()) == ["01"]


def test_resume_refuses_a_changed_task(agent_task, tmp_path):
    r = solve(agent_task.path, "--author", "expert", "--runs-dir", tmp_path / "runs", *RULE)
    run = only_run(tmp_path / "runs")
    agent_task.path.write_text(agent_task.path.read_text().replace("alpha: 0.5", "alpha: 2.0"))
    r = solve("--resume", run, *RULE)
    assert r.exit_code == 2 and "changed since the run started" in r.output, r.output


@pytest.mark.slow
def test_expert_author_passes_the_real_verifier(tmp_path):
    """solve with the real verifier and every CPU stage, on a packaged task with a backward.
    Every other expert's CPU stages are judged by that verifier in test_verifier_suite.py
    (static, reference) and by its compile stage's gate in the suite tests."""
    from coda_agent.tasks import SUITES

    r = solve(SUITES["llama3"] / "out_proj_residual.yaml", "--author", "expert", "--runs-dir", tmp_path / "runs")
    run = only_run(tmp_path / "runs")
    assert json.loads((run / "result.json").read_text())["stop_reason"] in ("accepted", "cpu_passed"), r.output
    report = json.loads((run / "attempts/01/report.json").read_text())
    assert [s["name"] for s in report["stages"]][:3] == ["static", "reference", "compile"], report


def test_each_turn_shows_its_stage_verdict_and_tokens(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(WRONG), prompt_tokens=100, completion_tokens=50)
    openai_server.reply(fenced(GOOD), prompt_tokens=200, completion_tokens=50)
    r = solve(agent_task.path, "--base-url", openai_server.base_url, "--model", "test-model",
              "--runs-dir", tmp_path / "runs", *RULE)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("turn 1: "))
    assert lines[first] == ("turn 1: rejected at reference: no @epilogue function: the math runs outside the "
                            "GEMM (150 tokens)")
    assert lines[first + 1] == "turn 2: accepted: passed static, reference, compile, correctness, launch_audit, " \
                               "performance (400 tokens)"


def test_author_expert_needs_an_expert_program(agent_task, tmp_path):
    agent_task.path.write_text(agent_task.path.read_text().replace("expert: experts/scale_add.py\n", ""))
    r = solve(agent_task.path, "--author", "expert", "--runs-dir", tmp_path / "runs", *RULE)
    assert r.exit_code == 2 and "error: --author expert: task scale_add" in r.output, r.output
    assert "has no expert program" in r.output and not (tmp_path / "runs").exists()


def test_sets_reach_the_verifier_and_are_checked_against_the_task(agent_task, tmp_path):
    runs = tmp_path / "runs"
    r = solve(agent_task.path, "--author", "expert", "--sets", "small", "--runs-dir", runs,
              "--verifier", "agent_fixtures:cpu_verifier")
    assert r.exit_code == 3, r.output
    report = json.loads((only_run(runs) / "attempts/01/report.json").read_text())
    assert report["versions"]["shape_sets"] == "small"
    r = solve(agent_task.path, "--author", "expert", "--sets", "small,huge", "--runs-dir", runs, *RULE)
    assert r.exit_code == 2 and "--sets: task scale_add has no shape set 'huge' (its sets: small)" in r.output
