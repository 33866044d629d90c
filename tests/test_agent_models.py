"""Model clients: the real openai package over HTTP to a scripted server; the offline authors."""

from __future__ import annotations

import socket
import time

import pytest
from agent_fixtures import GOOD

from coda_agent.agent import CodaError, ExpertModel, LimitsExceeded, LLMConfig, ModelError, OpenAIModel, ReplayModel
from coda_agent.agent.prompt import extract_program
from coda_agent.agent.rundir import Transcript

pytestmark = pytest.mark.usefixtures("agent_env")
HELLO = [{"role": "user", "content": "hello"}]


def model(server, **kw) -> OpenAIModel:
    cfg = LLMConfig(base_url=server.base_url, model="test-model", retry_base_delay_s=0.001, max_retries=3, **kw)
    return OpenAIModel(cfg, cost=lambda u: 0.5)


def test_reply_usage_and_sampling_options(openai_server):
    openai_server.reply("hi", prompt_tokens=7, completion_tokens=3)
    reply = model(openai_server, api_key="sk-test", temperature=0.2, top_p=0.9, max_tokens=99,
                  seed=1).complete(HELLO)
    assert reply.text == "hi" and reply.finish_reason == "stop"
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.model, u.cost_usd, u.retries) == (7, 3, "test-model", 0.5, 0)
    req = openai_server.requests[0]
    assert req["_path"] == "/v1/chat/completions" and req["_auth"] == "Bearer sk-test"
    assert (req["temperature"], req["top_p"], req["max_tokens"], req["seed"]) == (0.2, 0.9, 99, 1)
    assert req["messages"] == HELLO


def test_unset_sampling_options_are_not_sent(openai_server):
    openai_server.reply("hi")
    model(openai_server).complete(HELLO)
    assert not {"temperature", "top_p", "max_tokens", "seed"} & set(openai_server.requests[0])


def test_429_then_success_honours_retry_after(openai_server):
    slept = []
    openai_server.status(429, headers={"Retry-After": "0.25"})
    openai_server.status(503)
    openai_server.reply("ok")
    m = model(openai_server)
    m._sleep = slept.append
    reply = m.complete(HELLO)
    assert reply.text == "ok" and reply.usage.retries == 2 and len(openai_server.requests) == 3
    assert slept[0] == 0.25  # Retry-After, not our backoff
    assert 0 < slept[1] < 0.01  # our backoff: base 0.001 s doubled, with jitter


def test_500_storm_gives_up_with_a_clear_error(openai_server):
    with pytest.raises(ModelError, match=r"answered 500: script exhausted; gave up after 4 tries"):
        model(openai_server).complete(HELLO)
    assert len(openai_server.requests) == 4


@pytest.mark.parametrize("status,match", [(401, "set OPENAI_API_KEY"), (404, "does not serve model 'test-model'"),
                                          (400, "rejected the request")])
def test_refusals_fail_at_once_naming_the_fix(openai_server, status, match):
    openai_server.status(status)
    with pytest.raises(ModelError, match=match):
        model(openai_server).complete(HELLO)
    assert len(openai_server.requests) == 1


def test_refused_connection_fails_at_once_naming_the_setting():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = LLMConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m")  # the default six retries from 1 s
    slept = []
    m = OpenAIModel(cfg)
    m._sleep = slept.append
    started = time.monotonic()
    with pytest.raises(ModelError, match=r"cannot reach http://127.0.0.1:\d+/v1: .*Connection refused; "
                                         r"is the server running and is OPENAI_BASE_URL / --base-url right"):
        m.complete(HELLO)
    assert not slept and time.monotonic() - started < 5  # no retry: nobody is there to answer one


def test_retries_stop_at_the_deadline(openai_server):
    cfg = LLMConfig(base_url=openai_server.base_url, model="m", retry_base_delay_s=0.2, max_retries=6)
    started = time.monotonic()
    with pytest.raises(LimitsExceeded, match=r"wall_time: the wall budget runs out before retry \d of a failing "
                                             r"request .*answered 500"):
        OpenAIModel(cfg).complete(HELLO, deadline=started + 0.5)
    assert time.monotonic() - started < 2 and 2 <= len(openai_server.requests) <= 3


def test_expert_model_needs_an_expert_program(tmp_path):
    from agent_fixtures import write_task

    from coda_agent.tasks import load_task

    path = write_task(tmp_path)
    path.write_text(path.read_text().replace("expert: experts/scale_add.py\n", ""))
    with pytest.raises(CodaError, match=r"--author expert: task scale_add .* has no expert program; use "
                                        r"--author llm, or add `expert: path/to/program.py`"):
        ExpertModel(load_task(path))


def test_expert_model_answers_with_the_expert_program(agent_task):
    reply = ExpertModel(agent_task).complete(HELLO)
    assert extract_program(reply.text) == GOOD and reply.usage.cost_usd == 0.0


def test_replay_model_replays_in_order_and_is_stateless(tmp_path):
    t = Transcript(tmp_path / "run" / "transcript.jsonl")
    for i, text in enumerate(["first", "second"]):
        t.append({"event": "message", "role": "assistant", "content": text, "kind": "assistant",
                  "usage": {"model": "gpt-x"}})
    m = ReplayModel(tmp_path / "run")
    assert m.name == "replay:gpt-x"
    assert m.complete(HELLO).text == "first"
    assert m.complete([*HELLO, {"role": "assistant", "content": "first"}]).text == "second"
    with pytest.raises(ModelError, match="has only 2 replies"):
        m.complete([{"role": "assistant", "content": "x"}] * 2)


def test_request_timeout_is_a_model_error(openai_server):
    gate = openai_server.hang()
    cfg = LLMConfig(base_url=openai_server.base_url, model="m", timeout_s=0.2, max_retries=0)
    try:
        with pytest.raises(ModelError, match="APITimeoutError.*gave up after 1 tries"):
            OpenAIModel(cfg).complete(HELLO)
    finally:
        gate.set()
