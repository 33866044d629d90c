"""The loop: ask the model, judge the program, feed the report back, until a stop.

One trajectory is a conversation: system prompt, task, then for every turn an
assistant reply and a user message (the verifier's feedback, or a format
message when the reply held no program).  It ends with exactly one stop reason:

- ``accepted``: the verifier accepted a program (only a Hopper machine can).
- ``cpu_passed``: every stage that ran passed but the GPU stages could not run;
  nothing more can be learnt here.  Honestly *not* accepted: its program goes
  to ``best/``, never ``accepted/``.
- ``max_turns``, ``token_budget``, ``cost_budget``, ``wall_time``: a budget ran out
  (checked before each model call: a reply already paid for is always judged).
- ``format_errors``: more unparsable replies than ``max_format_errors``.
- ``model_error``: the endpoint failed for good (after retries) or refused.
- ``verifier_error``: the harness could not judge (Report outcome ``error`` or a
  crash); the candidate is not blamed and the LLM is not asked to fix it.

``--samples k`` runs k independent trajectories on threads (the time goes into
the endpoint and the verifier's child processes, not Python).  Turns are per
trajectory; tokens, cost and wall time are one shared :class:`Spend`.

Every event is in the transcript before the loop moves on, and ``result.json``
is rewritten after every turn and in a ``finally``, so a killed run can be
resumed (see rundir.py): the state below is rebuilt from the transcript.
"""

from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from .config import AgentConfig, Budget
from .prompt import extract_program, feedback_message, format_message, initial_messages
from .protocols import FormatError, LimitsExceeded, Message, Model, ModelError, Usage, Verifier
from .rundir import RunDir, TrajectoryDir

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task
    from coda_agent.verifier.report import Report

DONE = ("accepted", "cpu_passed")  # a resumed trajectory that ended so is not continued
_RANK = {"accepted": 3, "cpu_passed": 2, "rejected": 1, "error": 0}


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
    best_rank: tuple[int, int] | None = None  # (outcome, stages passed): how "best" is chosen


class Spend:
    """Tokens, money and wall time of a whole run, shared by its samples."""

    def __init__(self, budget: Budget, prior_wall_s: float = 0.0):
        self.budget, self.prior_wall_s, self.started = budget, prior_wall_s, time.monotonic()
        self.tokens, self.cost = 0, 0.0
        self._lock = threading.Lock()

    def add(self, usage: Usage) -> None:
        with self._lock:
            self.tokens += usage.tokens
            self.cost += usage.cost_usd or 0.0

    def wall_s(self) -> float:
        return self.prior_wall_s + time.monotonic() - self.started

    def check(self) -> None:
        b = self.budget
        if b.max_wall_s is not None and self.wall_s() >= b.max_wall_s:
            raise LimitsExceeded("wall_time", f"{self.wall_s():.0f}s of {b.max_wall_s:.0f}s used")
        if b.max_tokens is not None and self.tokens >= b.max_tokens:
            raise LimitsExceeded("token_budget", f"{self.tokens} of {b.max_tokens} tokens used")
        if b.max_cost is not None and self.cost >= b.max_cost:
            raise LimitsExceeded("cost_budget", f"${self.cost:.4f} of ${b.max_cost:.4f} spent")


class Trajectory:
    def __init__(self, task: "Task", model: Model, verifier: Verifier, budget: Budget, tdir: TrajectoryDir,
                 spend: Spend, catalogue: str, examples: int = 3, sample: int = 0):
        self.task, self.model, self.verifier, self.budget = task, model, verifier, budget
        self.tdir, self.spend, self.catalogue, self.examples = tdir, spend, catalogue, examples
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
        started = time.monotonic()
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
                self._save(started)
        except LimitsExceeded as e:
            self._stop(e.reason, str(e))
        except ModelError as e:
            self._stop("model_error", str(e))
        finally:
            self._save(started)
        return self.r

    def step(self) -> None:
        if self.messages[-1]["role"] != "assistant":  # on resume, a logged reply is judged, not re-asked
            if self.r.turns >= self.budget.max_turns:
                raise LimitsExceeded("max_turns", f"{self.r.turns} turns")
            self.spend.check()
            reply = self.model.complete(self.messages)
            self.r.turns += 1
            self._say("assistant", reply.text, "assistant", usage=reply.usage.to_dict(),
                      finish_reason=reply.finish_reason)
            self._count(reply.usage)
            self.spend.add(reply.usage)
        try:
            program = extract_program(self.messages[-1]["content"])
        except FormatError as e:
            self.r.format_errors += 1
            if self.r.format_errors > self.budget.max_format_errors:
                raise LimitsExceeded("format_errors", str(e)) from None
            self._say("user", format_message(str(e), self.r.format_errors, self.budget.max_format_errors), "format")
            return
        report = self._judge(program)
        if report is None:
            return
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
            rank = (_RANK[report.outcome], sum(s.status == "passed" for s in report.stages))
            self.tdir.transcript.append({"event": "attempt", "attempt": n, "turn": self.r.turns,
                                         "outcome": report.outcome, "rank": rank})
            self.r.attempts, self.judged_turn = n, self.r.turns
            self._rank(n, report.outcome, rank)
        return report

    def _rank(self, n: int, outcome: str, rank: tuple[int, int]) -> None:
        if self.r.best_rank is None or rank >= tuple(self.r.best_rank):  # ties: the later attempt
            self.r.best_attempt, self.r.best_outcome, self.r.best_rank = n, outcome, rank

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

    def _stop(self, reason: str, detail: str) -> None:
        self.r.stop_reason, self.r.detail, self.r.accepted = reason, detail, reason == "accepted"
        self.tdir.transcript.append({"event": "stop", "reason": reason, "detail": detail})
        if self.r.best_attempt is not None:
            from coda_agent.verifier.feedback import report_markdown
            from coda_agent.verifier.report import Report

            d = self.tdir.attempt_dir(self.r.best_attempt)
            program = (d / "program.py").read_text()
            report = Report.model_validate_json((d / "report.json").read_text())
            self.tdir.write_final("accepted" if report.accepted else "best", program,
                                  report_markdown(report, program))

    def _save(self, started: float) -> None:
        self.r.wall_s = round(self.prior_wall_s + time.monotonic() - started, 3)
        self.tdir.write_result(self.r.model_dump())


def solve(task: "Task", cfg: AgentConfig, run: RunDir, model: Model, verifier: Verifier,
          catalogue: str) -> dict[str, Any]:
    """Run (or resume) every sample of a run; returns and writes ``summary.json``."""
    tdirs = [run.trajectory(i) for i in range(cfg.budget.samples)]
    prior = max([(t.read_result() or {}).get("wall_s", 0.0) for t in tdirs])
    spend = Spend(cfg.budget, prior_wall_s=prior)
    trajectories = [Trajectory(task, model, verifier, cfg.budget, t, spend, catalogue, cfg.examples, sample=i)
                    for i, t in enumerate(tdirs)]
    for t in trajectories:  # resumed samples: what they already spent counts against the budget
        spend.add(Usage(prompt_tokens=t.r.prompt_tokens, completion_tokens=t.r.completion_tokens,
                        cost_usd=t.r.cost_usd))
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
               "cost_usd": cost, "wall_s": round(spend.wall_s(), 3),
               "results": [r.model_dump() for r in results]}
    run.write_summary(summary)
    return summary
