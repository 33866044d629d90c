"""The loop: ask the model, judge the program, feed the report back, until a stop.

One trajectory is a conversation: system prompt, task, then for every turn an
assistant reply and a user message (the verifier's feedback, or a format
message when the reply held no program).  It ends with exactly one stop reason:

- ``accepted``: the verifier accepted a program: correct and meeting the
  task's speed targets (only a Hopper machine can).
- ``cpu_passed``: every stage that ran passed but the GPU stages could not run;
  nothing more can be learnt here.  Honestly *not* accepted: its program goes
  to ``best/``, never ``accepted/``.
- ``max_turns``, ``token_budget``, ``cost_budget``, ``wall_time``: a budget ran out
  (checked before each model call: a reply already paid for is always judged).
- ``format_errors``: more unparsable replies than ``max_format_errors``.
- ``model_error``: the endpoint failed for good (after retries) or refused.
- ``verifier_error``: the harness could not judge (Report outcome ``error`` or a
  crash); the candidate is not blamed and the LLM is not asked to fix it.

A ``correct_slow`` report (correct on the GPU, slower than a target) does not
stop the loop: its performance report goes back to the model, which keeps
trying until the target or a budget; the best attempt (a correct program
beats any incorrect one, and among correct ones the faster) goes to ``best/``.

The stop's detail says what ran out or failed and, for a trajectory that
judged something but passed nothing, what its best attempt got to
(``; best attempt 02: rejected at reference: ...``): it is the message
``eval`` reports per trajectory.

``--samples k`` runs k independent trajectories on threads (the time goes into
the endpoint and the verifier's child processes, not Python).  Every budget
(turns, tokens, cost, wall time) is per trajectory, in ``solve`` and ``eval``
alike, so k samples may spend k budgets.  The wall budget is also the model's
deadline: retries of a failing endpoint stop there (``wall_time``).

Whoever runs the loop may watch it: ``on_event`` receives a :class:`TurnEvent`
as each turn asks the model, is judged or stops (``solve`` prints them).

Every event is in the transcript before the loop moves on, and ``result.json``
is rewritten after every turn and in a ``finally``, so a killed run can be
resumed (see rundir.py): the state below is rebuilt from the transcript.
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import BaseModel

from .config import AgentConfig, Budget
from .display import verdict
from .prompt import extract_program, feedback_message, format_message, initial_messages
from .protocols import FormatError, LimitsExceeded, Message, Model, ModelError, Usage, Verifier
from .rundir import RunDir, TrajectoryDir

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task
    from coda_agent.verifier.report import Report

DONE = ("accepted", "cpu_passed")  # a resumed trajectory that ended so is not continued
_RANK = {"accepted": 4, "correct_slow": 3, "cpu_passed": 2, "rejected": 1, "error": 0}


def rank(report: "Report") -> tuple[float, ...]:
    """How good an attempt is, to pick the best: (outcome, stages passed, speed vs the plain
    GEMMs: 1 / vs_gemm for a correct program, else 0)."""
    perf = report.stage("performance")
    vs_gemm = perf.details.get("vs_gemm") if perf is not None and report.correct else None
    speed = round(1 / vs_gemm, 4) if vs_gemm else 0.0
    return _RANK[report.outcome], sum(s.status == "passed" for s in report.stages), speed


class TrajectoryResult(BaseModel):
    sample: int = 0
    stop_reason: str | None = None  # None: still running (or killed)
    detail: str = ""
    accepted: bool = False
    turns: int = 0
    attempts: int = 0
    format_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = 0.0  # None once a call had no known price
    wall_s: float = 0.0
    best_attempt: int | None = None
    best_outcome: str | None = None
    best_rank: tuple[float, ...] | None = None  # rank(): how "best" is chosen


@dataclass(frozen=True)
class TurnEvent:
    """What a trajectory is doing, for a display: ``asking`` the model, ``judging`` a
    program, ``judged`` (with the report), ``format_error`` or ``stopped`` (with the reason)."""

    sample: int
    turn: int
    kind: Literal["asking", "judging", "judged", "format_error", "stopped"]
    tokens: int  # prompt + completion so far
    report: "Report | None" = None
    detail: str = ""


class Trajectory:
    def __init__(self, task: "Task", model: Model, verifier: Verifier, budget: Budget, tdir: TrajectoryDir,
                 catalogue: str, examples: int = 3, sample: int = 0,
                 on_event: Callable[[TurnEvent], None] | None = None):
        self.task, self.model, self.verifier, self.budget = task, model, verifier, budget
        self.tdir, self.catalogue, self.examples = tdir, catalogue, examples
        self.on_event = on_event or (lambda event: None)
        self.r = TrajectoryResult(sample=sample)
        self.messages: list[Message] = []
        self.judged_turn = 0  # the turn whose reply the last attempt judged
        self.last_stop: str | None = None
        self.prior_wall_s = 0.0
        self._rebuild()

    def _rebuild(self) -> None:
        """Resume: the conversation, counters and spend so far, from the transcript."""
        for e in self.tdir.transcript.events():
            if e["event"] == "message":
                self.messages.append({"role": e["role"], "content": e["content"]})
                self.r.format_errors += e.get("kind") == "format"
                if e["role"] == "assistant":
                    self.r.turns += 1
                    self._count(Usage(**e.get("usage", {})))
            elif e["event"] == "attempt":
                self.r.attempts, self.judged_turn = e["attempt"], e["turn"]
                self._rank(e["attempt"], e["outcome"], tuple(e["rank"]))
            elif e["event"] == "stop":
                self.last_stop, self.r.detail = e["reason"], e.get("detail", "")
        previous = self.tdir.read_result()
        self.prior_wall_s = previous["wall_s"] if previous else 0.0
        if self.last_stop in DONE:
            self.r.stop_reason = self.last_stop
            self.r.accepted = self.last_stop == "accepted"
        else:  # continuing: an earlier budget stop is history, not this result
            self.r.detail = ""

    def run(self) -> TrajectoryResult:
        self.started = time.monotonic()
        try:
            if self.r.stop_reason in DONE:
                return self.r
            self.tdir.transcript.append({"event": "start", "sample": self.r.sample, "resumed": bool(self.messages)})
            if not self.messages:
                system, user = initial_messages(self.task, self.catalogue, self.examples)
                self._say(system["role"], system["content"], "system")
                self._say(user["role"], user["content"], "task")
            while self.r.stop_reason is None:
                self.step()
                self._save()
        except LimitsExceeded as e:
            self._stop(e.reason, e.detail)
        except ModelError as e:
            self._stop("model_error", str(e))
        finally:
            self._save()
        return self.r

    def step(self) -> None:
        if self.messages[-1]["role"] != "assistant":  # on resume, a logged reply is judged, not re-asked
            self._check_budget()
            self._event("asking")
            reply = self.model.complete(self.messages, deadline=self._deadline())
            self.r.turns += 1
            self._say("assistant", reply.text, "assistant", usage=reply.usage.to_dict(),
                      finish_reason=reply.finish_reason)
            self._count(reply.usage)
        try:
            program = extract_program(self.messages[-1]["content"])
        except FormatError as e:
            self.r.format_errors += 1
            self._event("format_error", detail=str(e))
            if self.r.format_errors > self.budget.max_format_errors:
                raise LimitsExceeded("format_errors", str(e)) from None
            self._say("user", format_message(str(e), self.r.format_errors, self.budget.max_format_errors), "format")
            return
        self._event("judging")
        report = self._judge(program)
        if report is None:
            return
        self._event("judged", report=report)
        if report.outcome in DONE:
            self._stop(report.outcome, f"attempt {self.r.attempts}")
        elif report.outcome == "error":
            self._stop("verifier_error", f"attempt {self.r.attempts}: the verifier could not judge it; "
                                         f"see {self.tdir.attempt_dir(self.r.attempts) / 'report.json'}")
        else:
            self._say("user", feedback_message(report, program, self.r.attempts), "feedback")

    def _judge(self, program: str) -> "Report | None":
        logged = self.judged_turn == self.r.turns  # resumed after this reply's attempt was logged
        n = self.r.attempts if logged else self.r.attempts + 1
        report = self.tdir.judged_report(n, program)  # judged before a kill: never judge twice
        if report is None:
            try:
                report = self.verifier.check(self.task, program)
            except Exception:  # noqa: BLE001 - a harness crash is recorded, the run dir stays intact
                self._stop("verifier_error", traceback.format_exc(limit=8))
                return None
            self.tdir.write_attempt(n, program, report)
        if not logged:
            ranked = rank(report)
            self.tdir.transcript.append({"event": "attempt", "attempt": n, "turn": self.r.turns,
                                         "outcome": report.outcome, "rank": ranked})
            self.r.attempts, self.judged_turn = n, self.r.turns
            self._rank(n, report.outcome, ranked)
        return report

    def _rank(self, n: int, outcome: str, ranked: tuple[float, ...]) -> None:
        if self.r.best_rank is None or ranked >= tuple(self.r.best_rank):  # ties: the later attempt
            self.r.best_attempt, self.r.best_outcome, self.r.best_rank = n, outcome, ranked

    def _say(self, role: str, content: str, kind: str, **extra: Any) -> None:
        self.tdir.transcript.append({"event": "message", "role": role, "content": content, "kind": kind,
                                     "turn": self.r.turns, **extra})
        self.messages.append({"role": role, "content": content})

    def _count(self, usage: Usage) -> None:
        self.r.prompt_tokens += usage.prompt_tokens
        self.r.completion_tokens += usage.completion_tokens
        if usage.cost_usd is None or self.r.cost_usd is None:
            self.r.cost_usd = None
        else:
            self.r.cost_usd = round(self.r.cost_usd + usage.cost_usd, 6)

    def _check_budget(self) -> None:
        """Before each model call: a reply already paid for is always judged."""
        b, r = self.budget, self.r
        if r.turns >= b.max_turns:
            raise LimitsExceeded("max_turns", f"{r.turns} of {b.max_turns} turns used")
        wall, tokens, cost = self._wall_s(), r.prompt_tokens + r.completion_tokens, r.cost_usd or 0.0
        if b.max_wall_s is not None and wall >= b.max_wall_s:
            raise LimitsExceeded("wall_time", f"{wall:.0f}s of {b.max_wall_s:.0f}s used")
        if b.max_tokens is not None and tokens >= b.max_tokens:
            raise LimitsExceeded("token_budget", f"{tokens} of {b.max_tokens} tokens used")
        if b.max_cost is not None and cost >= b.max_cost:
            raise LimitsExceeded("cost_budget", f"${cost:.4f} of ${b.max_cost:.4f} spent")

    def _wall_s(self) -> float:
        return self.prior_wall_s + time.monotonic() - self.started

    def _deadline(self) -> float | None:
        """When the wall budget runs out, on the ``time.monotonic()`` clock."""
        if self.budget.max_wall_s is None:
            return None
        return time.monotonic() + self.budget.max_wall_s - self._wall_s()

    def _event(self, kind: Any, report: "Report | None" = None, detail: str = "") -> None:
        self.on_event(TurnEvent(self.r.sample, self.r.turns, kind, self.r.prompt_tokens + self.r.completion_tokens,
                                report, detail))

    def _stop(self, reason: str, detail: str) -> None:
        if self.r.best_attempt is not None:
            best = self.tdir.write_final(self.r.best_attempt)
            if reason not in (*DONE, "verifier_error"):  # what the trajectory got to, in its stop message
                detail = f"{detail}; best attempt {self.r.best_attempt:02d}: {verdict(best)}"
        self.r.stop_reason, self.r.detail, self.r.accepted = reason, detail, reason == "accepted"
        self._event("stopped", detail=f"{reason}: {detail}" if detail else reason)
        self.tdir.transcript.append({"event": "stop", "reason": reason, "detail": detail})

    def _save(self) -> None:
        self.r.wall_s = round(self._wall_s(), 3)
        self.tdir.write_result(self.r.model_dump())


def solve(task: "Task", cfg: AgentConfig, run: RunDir, model: Model, verifier: Verifier,
          catalogue: str, on_event: Callable[[TurnEvent], None] | None = None) -> dict[str, Any]:
    """Run (or resume) every sample of a run; returns and writes ``summary.json``."""
    started = time.monotonic()
    tdirs = [run.trajectory(i) for i in range(cfg.budget.samples)]
    trajectories = [Trajectory(task, model, verifier, cfg.budget, t, catalogue, cfg.examples, sample=i,
                               on_event=on_event)
                    for i, t in enumerate(tdirs)]
    if len(trajectories) == 1:
        results = [trajectories[0].run()]
    else:
        with ThreadPoolExecutor(max_workers=len(trajectories)) as pool:
            results = list(pool.map(Trajectory.run, trajectories))
    cost = None if any(r.cost_usd is None for r in results) else round(sum(r.cost_usd for r in results), 6)
    summary = {"task": task.name, "author": cfg.author, "model": getattr(model, "name", ""),
               "samples": len(results), "accepted": sum(r.accepted for r in results),
               "prompt_tokens": sum(r.prompt_tokens for r in results),
               "completion_tokens": sum(r.completion_tokens for r in results),
               "cost_usd": cost,
               "wall_s": round(max(t.prior_wall_s for t in trajectories) + time.monotonic() - started, 3),
               "results": [r.model_dump() for r in results]}
    run.write_summary(summary)
    return summary
