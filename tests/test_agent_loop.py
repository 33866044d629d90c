"""The loop end to end: real openai client, scripted local server, rule verifier, real run dir."""

from __future__ import annotations

import json
import time

import pytest
from agent_fixtures import GOOD, SYNTAX_ERROR, WRONG, RuleVerifier, fenced

from coda_agent.agent import OpenAIModel, RunDir, load_config, solve
from coda_agent.agent.rundir import read_events

pytestmark = pytest.mark.usefixtures("agent_env")


def run(task, server, tmp_path, verifier=None, on_event=None, retry_delay=0.001, **budget):
    cfg = load_config({"llm": {"base_url": server.base_url, "model": "test-model", "retry_base_delay_s": retry_delay,
                               "max_retries": 2},
                       "budget": budget}).check()
    rundir = RunDir.create(tmp_path / "runs", task, "test-model", cfg.model_dump(mode="json"))
    summary = solve(task, cfg, rundir, OpenAIModel(cfg.llm, cost=cfg.cost), verifier or RuleVerifier(), "CATALOGUE",
                    on_event=on_event)
    return summary, summary["results"][0], rundir.path


def test_wrong_then_fixed_after_feedback_is_accepted(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(WRONG))
    openai_server.reply(fenced(GOOD))
    summary, r, path = run(agent_task, openai_server, tmp_path)

    assert (r["stop_reason"], r["turns"], r["attempts"], r["best_attempt"]) == ("accepted", 2, 2, 2)
    assert summary["accepted"] == 1
    first, second = openai_server.requests
    assert first["model"] == "test-model"
    system, task_msg = first["messages"]
    assert "CATALOGUE" in system["content"] and "The mainloop contract" in system["content"]
    assert "def scale_add_ref" in task_msg["content"] and "name: scale_add" in task_msg["content"]
    assert "### other_task" in task_msg["content"]  # another task's expert program as an example
    feedback = second["messages"][-1]
    assert feedback["role"] == "user" and "no @epilogue function" in feedback["content"]
    assert second["messages"][-2]["content"] == fenced(WRONG)
    # the run directory
    assert (path / "attempts/01/program.py").read_text() == WRONG
    assert json.loads((path / "attempts/01/report.json").read_text())["outcome"] == "rejected"
    assert (path / "attempts/02/compile.log").read_text() == "ptxas: 0 spills"
    assert (path / "accepted/program.py").read_text() == GOOD
    assert "accepted" in (path / "accepted/report.md").read_text()
    assert not (path / "best").exists()
    result = json.loads((path / "result.json").read_text())
    assert result["stop_reason"] == "accepted" and result["prompt_tokens"] == 200
    assert json.loads((path / "summary.json").read_text())["accepted"] == 1
    assert set(json.loads((path / "versions.json").read_text())) >= {"coda-agent", "quack-kernels", "nvidia-cutlass-dsl", "torch", "gpu"}
    assert (path / "task.yaml").read_text() == agent_task.path.read_text()
    events = read_events(path / "transcript.jsonl")
    kinds = [e.get("kind") for e in events if e["event"] == "message"]
    assert kinds == ["system", "task", "assistant", "feedback", "assistant"]
    usage = [e["usage"] for e in events if e.get("kind") == "assistant"]
    assert usage[0]["prompt_tokens"] == 100 and usage[0]["latency_s"] >= 0


def test_own_expert_program_is_never_in_the_prompt(agent_task, openai_server, tmp_path):
    agent_task.expert_path.write_text(GOOD + "# SECRET-OWN-EXPERT\n")
    openai_server.reply(fenced(GOOD))
    run(agent_task, openai_server, tmp_path)
    assert "SECRET-OWN-EXPERT" not in json.dumps(openai_server.requests[0]["messages"])


def test_syntax_error_line_number_is_fed_back(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(SYNTAX_ERROR))
    openai_server.reply(fenced(GOOD))
    _, r, path = run(agent_task, openai_server, tmp_path)
    assert r["stop_reason"] == "accepted"
    feedback = openai_server.messages(1)[-1]["content"]
    assert "line 7" in feedback and "def forward(x, w, r, alpha)" in feedback


def test_unparsable_replies_get_a_bounded_number_of_format_messages(agent_task, openai_server, tmp_path):
    for _ in range(4):
        openai_server.reply("I would fuse the scale into the epilogue.")
    _, r, path = run(agent_task, openai_server, tmp_path, max_format_errors=2)
    assert (r["stop_reason"], r["turns"], r["attempts"], r["format_errors"]) == ("format_errors", 3, 0, 3)
    assert len(openai_server.requests) == 3
    format_msgs = [m["content"] for m in openai_server.messages(-1) if "could not find a program" in m["content"]]
    assert len(format_msgs) == 2 and "no ```python fenced block" in format_msgs[0]
    assert not (path / "attempts").exists() and not (path / "best").exists()


def test_format_error_then_program_continues(agent_task, openai_server, tmp_path):
    openai_server.reply("```python\n" + GOOD, finish_reason="length")  # cut off mid-block
    openai_server.reply(fenced(GOOD))
    _, r, _ = run(agent_task, openai_server, tmp_path)
    assert (r["stop_reason"], r["attempts"], r["format_errors"]) == ("accepted", 1, 1)
    assert "cut off" in openai_server.messages(1)[-1]["content"]


def test_server_error_storm_is_a_clean_model_error(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(WRONG))
    # then the fallback: 500 forever
    _, r, path = run(agent_task, openai_server, tmp_path)
    assert r["stop_reason"] == "model_error" and "500" in r["detail"] and "gave up after 3 tries" in r["detail"]
    assert len(openai_server.requests) == 1 + 3
    assert json.loads((path / "result.json").read_text())["stop_reason"] == "model_error"
    events = read_events(path / "transcript.jsonl")
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "model_error"
    assert (path / "best/program.py").read_text() == WRONG  # the attempt made before the storm is kept


def test_rate_limit_then_success(agent_task, openai_server, tmp_path):
    openai_server.status(429, headers={"Retry-After": "0"})
    openai_server.reply(fenced(GOOD))
    _, r, path = run(agent_task, openai_server, tmp_path)
    assert r["stop_reason"] == "accepted" and len(openai_server.requests) == 2
    usage = next(e["usage"] for e in read_events(path / "transcript.jsonl") if e.get("kind") == "assistant")
    assert usage["retries"] == 1


def test_max_turns(agent_task, openai_server, tmp_path):
    for _ in range(3):
        openai_server.reply(fenced(WRONG))
    _, r, path = run(agent_task, openai_server, tmp_path, max_turns=2)
    assert (r["stop_reason"], r["turns"], r["attempts"]) == ("max_turns", 2, 2)
    assert len(openai_server.requests) == 2
    assert (path / "best/program.py").read_text() == WRONG and not (path / "accepted").exists()


def test_token_budget(agent_task, openai_server, tmp_path):
    for _ in range(3):
        openai_server.reply(fenced(WRONG), prompt_tokens=100, completion_tokens=50)
    _, r, _ = run(agent_task, openai_server, tmp_path, max_tokens=300)
    assert (r["stop_reason"], r["turns"]) == ("token_budget", 2)


def test_budgets_are_per_trajectory(agent_task, openai_server, tmp_path):
    openai_server.fallback = ("reply", fenced(WRONG), 100, 50, "stop")
    summary, _, _ = run(agent_task, openai_server, tmp_path, samples=2, max_tokens=300)
    assert [(r["stop_reason"], r["turns"]) for r in summary["results"]] == [("token_budget", 2)] * 2
    assert len(openai_server.requests) == 4 and summary["prompt_tokens"] + summary["completion_tokens"] == 600


def test_wall_budget_bounds_the_retries_of_a_failing_endpoint(agent_task, openai_server, tmp_path):
    """Retries from 0.5 s (0.5, then 1) against a 0.8 s budget: the loop stops before the retry that
    would pass it and names the failing request's cause: the server's 500, or, on a machine so
    loaded that the request's share of the budget ran out first, its timeout."""
    openai_server.reply(fenced(WRONG))  # then 500 forever
    started = time.monotonic()
    _, r, _ = run(agent_task, openai_server, tmp_path, retry_delay=0.5, max_wall_s=0.8)
    assert r["stop_reason"] == "wall_time" and "before retry" in r["detail"], r["detail"]
    assert "answered 500" in r["detail"] or "timed out" in r["detail"], r["detail"]
    assert time.monotonic() - started < 3


def test_cost_budget(agent_task, openai_server, tmp_path):
    (tmp_path / "xdg/coda-agent").mkdir(parents=True)
    # 100 prompt tokens at $10/M + 50 completion tokens at $20/M = $0.002 a call
    (tmp_path / "xdg/coda-agent/config.yaml").write_text("prices: {test-model: {input: 10, output: 20}}\n")
    for _ in range(3):
        openai_server.reply(fenced(WRONG))
    summary, r, _ = run(agent_task, openai_server, tmp_path, max_cost=0.003)
    assert (r["stop_reason"], r["turns"]) == ("cost_budget", 2)
    assert summary["cost_usd"] == pytest.approx(0.004)


def test_each_turn_is_reported_as_it_happens(agent_task, openai_server, tmp_path):
    openai_server.reply("no program here")
    openai_server.reply(fenced(WRONG))
    openai_server.reply(fenced(GOOD))
    events = []
    run(agent_task, openai_server, tmp_path, on_event=events.append)
    assert [(e.kind, e.turn) for e in events] == [
        ("asking", 0), ("format_error", 1), ("asking", 1), ("judging", 2), ("judged", 2), ("asking", 2),
        ("judging", 3), ("judged", 3), ("stopped", 3)]
    judged = [e for e in events if e.kind == "judged"]
    assert [e.report.outcome for e in judged] == ["rejected", "accepted"] and judged[0].tokens == 300
    assert events[-1].detail == "accepted: attempt 2"


def test_cpu_passed_ends_honestly_not_accepted(agent_task, openai_server, tmp_path):
    openai_server.reply(fenced(GOOD))
    summary, r, path = run(agent_task, openai_server, tmp_path, verifier=RuleVerifier("cpu_passed"))
    assert (r["stop_reason"], r["accepted"], summary["accepted"]) == ("cpu_passed", False, 0)
    assert (path / "best/program.py").read_text() == GOOD and not (path / "accepted").exists()


def test_verifier_crash_stops_with_verifier_error(agent_task, openai_server, tmp_path):
    class Broken:
        def check(self, task, program_source):
            raise RuntimeError("harness bug")

    openai_server.reply(fenced(GOOD))
    _, r, path = run(agent_task, openai_server, tmp_path, verifier=Broken())
    assert r["stop_reason"] == "verifier_error" and "harness bug" in r["detail"]
    assert json.loads((path / "result.json").read_text())["stop_reason"] == "verifier_error"


def test_parallel_samples_each_get_a_trajectory(agent_task, openai_server, tmp_path):
    for _ in range(3):
        openai_server.reply(fenced(GOOD))
    verifier = RuleVerifier()
    summary, _, path = run(agent_task, openai_server, tmp_path, verifier=verifier, samples=3)
    assert summary["accepted"] == 3 and len(verifier.checked) == 3
    for i in range(3):
        assert json.loads((path / f"sample-{i}/result.json").read_text())["stop_reason"] == "accepted"
        assert (path / f"sample-{i}/accepted/program.py").is_file()


def test_wall_time_budget(agent_task, openai_server, tmp_path):
    _, r, _ = run(agent_task, openai_server, tmp_path, max_wall_s=1e-6)
    assert (r["stop_reason"], r["turns"]) == ("wall_time", 0) and not openai_server.requests


def test_a_terminal_gets_a_live_status_and_the_same_turn_lines(agent_task, openai_server, tmp_path):
    import io

    from rich.console import Console

    from coda_agent.agent.display import TurnDisplay

    openai_server.reply(fenced(WRONG))
    openai_server.reply(fenced(GOOD))
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, highlight=False, soft_wrap=True)
    with TurnDisplay(1, console) as display:
        assert display._live is not None  # a terminal: the rich status line is up
        run(agent_task, openai_server, tmp_path, on_event=display)
    text = screen.getvalue()
    assert "turn 1: rejected at reference: no @epilogue function" in text and "(150 tokens)" in text
    assert "turn 2: accepted: passed static" in text and "asking the model" in text


class _SpeedVerifier:
    """A judge that finds every program correct and reads its speed from a ``# vs_gemm=`` line."""

    def check(self, task, program_source):
        import re

        from coda_agent.verifier.report import Report, StageResult

        vs_gemm = float(re.search(r"# vs_gemm=([\d.]+)", program_source)[1])
        perf = StageResult(name="performance", status="slow" if vs_gemm > 1.05 else "passed",
                           message=f"correct but slow: {vs_gemm}x the plain GEMMs" if vs_gemm > 1.05 else "fast",
                           details={"shape_set": "llama3-8b", "vs_gemm": vs_gemm, "target_vs_gemm": 1.05,
                                    "ms": {"program": vs_gemm, "gemm": 1.0}, "tflops": 1.0})
        stages = [StageResult(name=s, status="passed") for s in
                  ("static", "reference", "compile", "correctness", "launch_audit")] + [perf]
        return Report(task=task.name, program_sha256="x", outcome=Report.outcome_of(stages), stages=stages)


def test_correct_but_slow_gets_its_performance_report_and_the_best_is_kept(agent_task, openai_server, tmp_path):
    for vs_gemm in (1.6, 1.3, 1.9):
        openai_server.reply(fenced(GOOD + f"# vs_gemm={vs_gemm}\n"))
    summary, r, path = run(agent_task, openai_server, tmp_path, verifier=_SpeedVerifier(), max_turns=3)
    assert (r["stop_reason"], r["accepted"], r["turns"]) == ("max_turns", False, 3)  # slow never stops the loop
    assert (r["best_attempt"], r["best_outcome"]) == (2, "correct_slow")  # correct, and the fastest of them
    assert "best attempt 02: correct_slow at performance: correct but slow: 1.3x" in r["detail"]
    assert "# vs_gemm=1.3" in (path / "best/program.py").read_text() and not (path / "accepted").exists()
    feedback = openai_server.requests[1]["messages"][-1]["content"]
    assert "CORRECT BUT SLOW" in feedback and "1.60x (target <= 1.05)" in feedback


def test_a_fast_program_after_slow_ones_is_accepted(agent_task, openai_server, tmp_path):
    for vs_gemm in (1.6, 1.0):
        openai_server.reply(fenced(GOOD + f"# vs_gemm={vs_gemm}\n"))
    _, r, path = run(agent_task, openai_server, tmp_path, verifier=_SpeedVerifier(), max_turns=5)
    assert (r["stop_reason"], r["turns"], r["best_attempt"]) == ("accepted", 2, 2)
    assert (path / "accepted/program.py").is_file()
