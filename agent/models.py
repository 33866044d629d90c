"""Authors: an OpenAI-compatible endpoint, the expert program, a replayed transcript.

All three implement ``Model.complete(messages) -> Reply`` (see protocols.py), so
the loop, the run directory and the CLI are the same with or without an LLM.

- :class:`OpenAIModel` talks Chat Completions through the ``openai`` package
  to OpenAI, vLLM, SGLang, Ollama, ...  The client's own retries are off
  (``max_retries=0``): we retry here, on 408/409/429/5xx, timeouts and dropped
  connections, with exponential backoff from a configurable base delay (tests
  use milliseconds) and honouring ``Retry-After``, never past the trajectory's
  deadline (its wall budget).  Everything else fails at once: 401, 404, 400,
  and an endpoint that is not there at all (connection refused, an unknown
  host name), which no wait fixes.  Failures become :class:`ModelError` whose
  message names the setting to fix; the loop records them as stop reason
  ``model_error``.
- :class:`ExpertModel` answers every turn with the task's human-written program
  (a clear error up front when the task has none).
- :class:`ReplayModel` answers turn *n* with the *n*-th assistant message of a
  recorded transcript.  It is stateless (it counts the assistant messages it is
  given), which is what makes ``solve --resume`` of a replay exact.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .config import AgentConfig, LLMConfig
from .protocols import CodaError, LimitsExceeded, Message, Model, ModelError, Reply, Usage

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task

RETRY_STATUS = {408, 409, 429}  # plus every 5xx


class OpenAIModel:
    def __init__(self, cfg: LLMConfig, cost: Callable[[Usage], float | None] = lambda u: None,
                 sleep: Callable[[float], None] = time.sleep):
        import openai  # lazily: the offline authors do not need it

        self.cfg, self.name, self._cost, self._sleep = cfg, cfg.model or "", cost, sleep
        # Local servers (vLLM, Ollama) take any key, but the client insists on one.
        self.client = openai.OpenAI(base_url=cfg.base_url, api_key=cfg.api_key or "not-needed",
                                    timeout=cfg.timeout_s, max_retries=0)
        self._where = cfg.base_url or "api.openai.com"

    def complete(self, messages: list[Message], deadline: float | None = None) -> Reply:
        import openai

        sampling = {k: getattr(self.cfg, k) for k in ("temperature", "top_p", "max_tokens", "seed")
                    if getattr(self.cfg, k) is not None}
        retries = 0
        while True:
            start = time.monotonic()
            timeout = self.cfg.timeout_s if deadline is None else min(self.cfg.timeout_s, deadline - start)
            if timeout <= 0:
                raise LimitsExceeded("wall_time", f"the wall budget ran out before the request to {self._where}")
            try:
                resp = self.client.chat.completions.create(model=self.name, messages=messages, timeout=timeout,
                                                           **sampling)
                break
            except openai.APIConnectionError as e:  # includes timeouts
                cause = _root_cause(e)
                if _nobody_there(cause):
                    raise ModelError(f"cannot reach {self._where}: {cause}; is the server running and is "
                                     "OPENAI_BASE_URL / --base-url right?") from None
                failure, delay = f"cannot reach {self._where} ({type(e).__name__}: {cause})", None
                fix = "is the server up and reachable? check OPENAI_BASE_URL / --base-url"
            except openai.APIStatusError as e:
                status = e.status_code
                if status == 401 or status == 403:
                    raise ModelError(f"{self._where} refused the API key ({status}: {_brief(e)}); "
                                     "set OPENAI_API_KEY or --api-key") from None
                if status == 404:
                    raise ModelError(f"{self._where} does not serve model {self.name!r} (404: {_brief(e)}); "
                                     "check CODA_MODEL / --model and OPENAI_BASE_URL / --base-url") from None
                if status not in RETRY_STATUS and status < 500:
                    raise ModelError(f"{self._where} rejected the request ({status}: {_brief(e)})") from None
                failure, delay = f"{self._where} answered {status}: {_brief(e)}", _retry_after(e.response)
                fix = "the endpoint is overloaded or failing; retry later or raise --max-retries in the config"
            if retries >= self.cfg.max_retries:
                raise ModelError(f"{failure}; gave up after {retries + 1} tries; {fix}")
            backoff = min(self.cfg.retry_max_delay_s, self.cfg.retry_base_delay_s * 2 ** retries)
            # Jitter so that parallel samples do not retry in lockstep.
            wait = (min(self.cfg.retry_max_delay_s, delay) if delay is not None
                    else backoff * random.uniform(0.8, 1.2))
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise LimitsExceeded("wall_time", f"the wall budget runs out before retry {retries + 1} of "
                                                  f"a failing request ({failure})")
            self._sleep(wait)
            retries += 1
        text = (resp.choices[0].message.content or "") if resp.choices else ""
        usage = Usage(prompt_tokens=getattr(resp.usage, "prompt_tokens", 0) or 0,
                      completion_tokens=getattr(resp.usage, "completion_tokens", 0) or 0,
                      latency_s=round(time.monotonic() - start, 3), model=resp.model or self.name,
                      retries=retries)
        usage.cost_usd = self._cost(usage)
        finish = (resp.choices[0].finish_reason or "stop") if resp.choices else "stop"
        return Reply(text=text, usage=usage, finish_reason=finish)


def _root_cause(e: BaseException) -> BaseException:
    while (inner := e.__cause__ or e.__context__) is not None:
        e = inner
    return e


def _nobody_there(cause: BaseException) -> bool:
    """A refused connection or a host name that does not resolve: retrying cannot help."""
    if isinstance(cause, ConnectionRefusedError):
        return True
    return isinstance(cause, socket.gaierror) and cause.errno == socket.EAI_NONAME


def _brief(e: Exception) -> str:
    body = getattr(e, "body", None)  # the parsed JSON error, with or without the "error" wrapper
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:300]
    return str(e)[:300]


def _retry_after(response) -> float | None:
    headers = getattr(response, "headers", None) or {}
    try:
        if "retry-after-ms" in headers:
            return float(headers["retry-after-ms"]) / 1000
        if "retry-after" in headers:
            return float(headers["retry-after"])
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None
    return None


class ExpertModel:
    """The task's human-written program, every turn: the pipeline with no LLM."""

    name = "expert"

    def __init__(self, task: "Task"):
        if task.expert_path is None:
            raise CodaError(f"--author expert: task {task.name} ({task.path}) has no expert program; use "
                            "--author llm, or add `expert: path/to/program.py` to the task file")
        self.path = task.expert_path

    def complete(self, messages: list[Message], deadline: float | None = None) -> Reply:
        source = self.path.read_text()
        return Reply(text=f"The expert program for this task:\n\n```python\n{source}\n```\n",
                     usage=Usage(model="expert", cost_usd=0.0))


class ReplayModel:
    """The assistant messages of a recorded run, in order."""

    def __init__(self, path: str | Path):
        from .rundir import find_transcript, read_events

        self.path = find_transcript(Path(path))
        self.replies = [e for e in read_events(self.path)
                        if e.get("event") == "message" and e.get("role") == "assistant"]
        if not self.replies:
            raise CodaError(f"{self.path}: no assistant messages to replay")
        self.name = f"replay:{self.replies[0].get('usage', {}).get('model', 'unknown')}"

    def complete(self, messages: list[Message], deadline: float | None = None) -> Reply:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn >= len(self.replies):
            raise ModelError(f"replay transcript {self.path} has only {len(self.replies)} replies")
        return Reply(text=self.replies[turn]["content"], usage=Usage(model=self.name, cost_usd=0.0))


def make_model(cfg: AgentConfig, task: "Task") -> Model:
    if cfg.author == "expert":
        return ExpertModel(task)
    if cfg.author == "replay":
        return ReplayModel(cfg.transcript or "")
    return OpenAIModel(cfg.llm, cost=cfg.cost)
