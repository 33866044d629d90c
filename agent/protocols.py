"""The agent's seams: one Protocol each, plus the few types that cross them.

``Model.complete(messages) -> Reply`` is everything the loop knows about an
author (an LLM endpoint, the expert program, a replayed transcript), and
``Verifier.check(task, program_source) -> Report`` is everything it knows about
judging.  Both are duck-typed: no base classes, so a test's verifier or a new
model client is one small class.

Two error channels (mini-swe-agent's rule): what is wrong with a *candidate*
is data (a Report, rendered into the next message); exceptions are control
flow (:class:`FormatError`, :class:`LimitsExceeded`) or a problem the *user*
must fix (:class:`~coda_agent.errors.CodaError`, whose message names the fix
and which every CLI command prints as one ``error:`` line; :class:`ModelError`
is the agent's member of that family).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

from coda_agent.errors import CodaError

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task
    from coda_agent.verifier.report import Report

# A chat message as Chat Completions wants it: {"role": ..., "content": ...}.
Message = dict[str, str]


@dataclass
class Usage:
    """What one model call cost; logged with every reply."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    cost_usd: float | None = None  # None: no price known for this model
    model: str = ""
    retries: int = 0  # rate-limit / server-error retries before this reply

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Reply:
    text: str
    usage: Usage = field(default_factory=Usage)
    finish_reason: str = "stop"  # "length" means the reply was cut off by max_tokens


class Model(Protocol):
    """An author of programs.  ``messages`` is the whole conversation so far; ``deadline``
    (on the ``time.monotonic()`` clock, None for none) is when the trajectory's wall budget
    ends: an author that waits (a slow request, retries) raises ``LimitsExceeded("wall_time")``
    rather than wait past it."""

    name: str

    def complete(self, messages: list[Message], deadline: float | None = None) -> Reply: ...


class Verifier(Protocol):
    """A judge.  Never raises for a bad candidate: that is a rejected Report."""

    def check(self, task: "Task", program_source: str) -> "Report": ...


class ModelError(CodaError):
    """The model endpoint failed for good (after retries) or refused the request."""


class FormatError(Exception):
    """The reply holds no program; the loop answers with a format message."""


class LimitsExceeded(Exception):
    """A budget ran out; ``reason`` is the trajectory's stop reason, ``detail`` what ran out."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail
