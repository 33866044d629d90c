"""Config layering, clear errors when nothing is configured, prices."""

from __future__ import annotations

import pytest

from coda_agent.agent import CodaError, Usage, load_config

pytestmark = pytest.mark.usefixtures("agent_env")


def write_config(tmp_path, text: str):
    path = tmp_path / "xdg" / "coda-agent" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_layers_file_then_env_then_flags(tmp_path, monkeypatch):
    write_config(tmp_path, "llm: {model: from-file, base_url: http://file/v1, temperature: 0.1}\n"
                           "budget: {max_turns: 4}\n")
    monkeypatch.setenv("CODA_MODEL", "from-env")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    cfg = load_config({"llm": {"temperature": 0.7, "seed": None}, "budget": {"samples": 2}}).check()
    assert (cfg.llm.model, cfg.llm.base_url, cfg.llm.api_key) == ("from-env", "http://file/v1", "sk-env")
    assert (cfg.llm.temperature, cfg.llm.seed, cfg.budget.max_turns, cfg.budget.samples) == (0.7, None, 4, 2)
    assert "sk-env" not in cfg.model_dump_json()  # the key never reaches config.json


def test_saved_config_of_a_resumed_run_beats_env_but_not_flags(monkeypatch):
    monkeypatch.setenv("CODA_MODEL", "env-model")
    saved = {"llm": {"model": "run-model", "base_url": "http://x/v1"}, "budget": {"max_turns": 3}}
    cfg = load_config({"budget": {"max_turns": 6}}, saved=saved)
    assert (cfg.llm.model, cfg.budget.max_turns) == ("run-model", 6)


def test_explicit_config_file_must_exist(tmp_path):
    with pytest.raises(CodaError, match="--config .*no such file"):
        load_config(config_path=tmp_path / "nope.yaml")


def test_invalid_config_names_the_field(tmp_path):
    write_config(tmp_path, "budget: {max_turnz: 3}\n")
    with pytest.raises(CodaError, match=r"budget.max_turnz: Extra inputs"):
        load_config()


def test_nothing_configured_names_what_to_set():
    with pytest.raises(CodaError, match=r"no model configured: pass --model NAME or set CODA_MODEL.*--author expert"):
        load_config().check()


def test_model_without_endpoint_names_what_to_set(monkeypatch):
    monkeypatch.setenv("CODA_MODEL", "gpt-4o")
    with pytest.raises(CodaError, match="set OPENAI_API_KEY .* or OPENAI_BASE_URL"):
        load_config().check()


def test_money_budget_needs_a_price():
    flags = {"llm": {"model": "local-model", "base_url": "http://x/v1"}, "budget": {"max_cost": 1.0}}
    with pytest.raises(CodaError, match=r"--max-cost needs a price for model 'local-model'"):
        load_config(flags).check()


def test_prices_packaged_extended_and_prefix_matched(tmp_path):
    write_config(tmp_path, "prices: {local-model: {input: 0, output: 0}, gpt-4o: {input: 5, output: 15}}\n")
    cfg = load_config()
    assert cfg.price("local-model").output == 0
    assert cfg.price("gpt-4o-2024-08-06").input == 5  # the config overrides the packaged price
    assert cfg.price("gpt-4o-mini").input == 0.15  # longest prefix wins
    assert cfg.price("unknown") is None
    assert cfg.cost(Usage(prompt_tokens=1_000_000, completion_tokens=2_000_000, model="gpt-4o")) == 35.0
    assert cfg.cost(Usage(prompt_tokens=10, model="unknown")) is None
