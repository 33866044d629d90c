"""One pydantic config for the agent, merged from layers, and the price table.

Layers, later wins: defaults < config file < environment < the saved config of
a resumed run < command-line flags.

- config file: ``--config PATH``, else ``$CODA_CONFIG``, else
  ``$XDG_CONFIG_HOME/coda-agent/config.yaml`` (``~/.config/...``).  YAML with
  the same shape as :class:`AgentConfig`, e.g.::

      llm: {base_url: http://localhost:8000/v1, model: qwen3-coder, temperature: 0.6}
      budget: {max_turns: 8, max_cost: 2.0}
      prices: {qwen3-coder: {input: 0.0, output: 0.0}}   # USD per million tokens

- environment: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the openai package's
  own names) and ``CODA_MODEL``.

The API key is never written anywhere: it is excluded from every dump, so a
run's ``config.json`` can be shared.  A resumed run takes it from the
environment or config file again.

Prices (``prices.yaml``, packaged, extended by the config file's ``prices``)
are USD per million prompt (``input``) and completion (``output``) tokens; a
model name matches its exact key or else the longest key it starts with
(``gpt-4o-2024-08-06`` -> ``gpt-4o``).  An unknown model costs ``None``; a
money budget on such a model is refused up front rather than silently ignored.
"""

from __future__ import annotations

import importlib
import os
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .protocols import CodaError, Usage

PRICES_FILE = Path(__file__).parent / "prices.yaml"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=True)


class LLMConfig(_Config):
    base_url: str | None = None
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None  # per reply; a trajectory's token budget is Budget.max_tokens
    seed: int | None = None
    timeout_s: float = 600.0
    max_retries: int = 6
    retry_base_delay_s: float = 1.0  # doubled per retry, capped, unless Retry-After says otherwise
    retry_max_delay_s: float = 60.0


class Budget(_Config):
    """What one trajectory may spend: model calls (turns), tokens (prompt + completion),
    money and wall time.  Per trajectory in ``solve`` and ``eval`` alike: ``--samples k``
    (and an eval over n tasks) may spend k (n * k) budgets."""

    max_turns: int = Field(default=10, ge=1)
    samples: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_cost: float | None = Field(default=None, gt=0)
    max_wall_s: float | None = Field(default=None, gt=0)
    max_format_errors: int = Field(default=3, ge=0)


class Price(_Config):
    input: float  # USD per million prompt tokens
    output: float  # USD per million completion tokens


class Author(str, Enum):
    """Who writes the programs: an LLM, the task's expert program, or a recorded transcript."""

    llm = "llm"
    expert = "expert"
    replay = "replay"


class AgentConfig(_Config):
    author: Author = Author.llm
    transcript: str | None = None  # replay: a transcript.jsonl or a run directory
    llm: LLMConfig = LLMConfig()
    budget: Budget = Budget()
    examples: int = Field(default=3, ge=0)  # expert programs of other tasks in the prompt
    verifier: str = "coda_agent.verifier:Verifier"  # module:factory (see load_verifier)
    shape_sets: list[str] | None = None  # the verifier's (--sets); None: each task's own
    prices: dict[str, Price] = Field(default_factory=dict)

    def load_verifier(self, **options: Any) -> Any:
        """The Verifier ``module:factory`` builds, with ``shape_sets`` when --sets gave them."""
        module, _, attr = self.verifier.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise CodaError(f"cannot load the verifier {self.verifier!r} ({type(e).__name__}: {e}); "
                            "check the coda-agent install") from None
        return factory(**self.verifier_options(), **options)

    def verifier_options(self) -> dict[str, Any]:
        """Keyword arguments of the verifier factory that follow from this config."""
        return {} if self.shape_sets is None else {"shape_sets": self.shape_sets}

    def price(self, model: str) -> Price | None:
        if model in self.prices:
            return self.prices[model]
        keys = [k for k in self.prices if model.startswith(k)]
        return self.prices[max(keys, key=len)] if keys else None

    def cost(self, usage: Usage) -> float | None:
        p = self.price(usage.model or self.llm.model or "")
        if p is None:
            return None
        return (usage.prompt_tokens * p.input + usage.completion_tokens * p.output) / 1e6

    def check(self) -> "AgentConfig":
        """Refuse a configuration that cannot run, naming what to set."""
        if self.author == "llm":
            if not self.llm.model:
                raise CodaError(
                    "no model configured: pass --model NAME or set CODA_MODEL, with the endpoint in "
                    "--base-url/OPENAI_BASE_URL (vLLM, SGLang, Ollama, ...) or --api-key/OPENAI_API_KEY "
                    f"(api.openai.com), or write them under `llm:` in {default_config_path()}; "
                    "to run without an LLM use --author expert or --author replay --transcript RUN")
            if not self.llm.base_url and not self.llm.api_key:
                raise CodaError(
                    f"model {self.llm.model!r} has no endpoint: set OPENAI_API_KEY (or --api-key) for "
                    "api.openai.com, or OPENAI_BASE_URL (or --base-url) for an OpenAI-compatible server")
            if self.budget.max_cost is not None and self.price(self.llm.model) is None:
                raise CodaError(
                    f"--max-cost needs a price for model {self.llm.model!r}: add "
                    f"`prices: {{{self.llm.model}: {{input: USD_PER_MTOK, output: USD_PER_MTOK}}}}` "
                    f"to {default_config_path()} (or --config), or drop --max-cost")
        if self.author == "replay" and not self.transcript:
            raise CodaError("--author replay needs --transcript PATH (a run directory or its transcript.jsonl)")
        return self


def default_config_path() -> Path:
    if os.environ.get("CODA_CONFIG"):
        return Path(os.environ["CODA_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "coda-agent" / "config.yaml"


def load_config(flags: dict[str, Any] | None = None, config_path: Path | None = None,
                saved: dict[str, Any] | None = None) -> AgentConfig:
    """Merge the layers (module docstring) into one validated config.

    ``flags`` and ``saved`` are nested dicts shaped like AgentConfig; ``None``
    values mean "not given" and do not override.
    """
    layers: list[dict[str, Any]] = [{"prices": _read_yaml(PRICES_FILE)}]
    path = config_path or default_config_path()
    if config_path is not None and not path.is_file():
        raise CodaError(f"--config {path}: no such file")
    if path.is_file():
        layers.append(_read_yaml(path))
    env = {"base_url": os.environ.get("OPENAI_BASE_URL"), "api_key": os.environ.get("OPENAI_API_KEY"),
           "model": os.environ.get("CODA_MODEL")}
    layers += [{"llm": env}, saved or {}, flags or {}]
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge(merged, layer)
    try:
        return AgentConfig.model_validate(merged)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise CodaError(f"invalid configuration ({where}); check the flags and {path}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CodaError(f"{path}: cannot read config ({e})") from None
    if not isinstance(data, dict):
        raise CodaError(f"{path}: a config file is a YAML mapping (llm:, budget:, prices:)")
    return data


def _merge(into: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, dict):
            into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = value
