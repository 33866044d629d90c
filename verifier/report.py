"""The verifier's one structured result: a :class:`Report` of stage results.

A candidate's problems (it does not parse, it mismatches, it is slow) are data
here, never exceptions: the agent renders a Report into the next LLM message
(``coda_agent.verifier.feedback``) and the CLI prints it.

Outcome rules (the part everyone depends on):

- ``accepted``: correct and fast.  Every stage ran and passed, the
  performance stage included: the program met the task's targets against
  the plain GEMMs (``Target.vs_gemm``) and torch.compile
  (``Target.vs_compile``).  Only a machine with a Hopper GPU can produce it.
- ``correct_slow``: every check of correctness passed on the GPU, but the
  performance stage measured the program slower than a target (its status is
  ``slow``).  Not an acceptance; the agent keeps going with the performance
  report.
- ``cpu_passed``: every stage that ran passed and the GPU stages were skipped
  (no CUDA).  Not an acceptance either: nothing was timed.
- ``rejected``: some stage failed (the program is wrong, cheats, broke the
  judge, or is faster than the plain GEMMs can be).
- ``error``: the harness itself could not judge (a bug or a broken install);
  the candidate is not blamed for it.

A stage's ``message`` and ``log`` may quote the program (what it raised, what it
printed), and its ``details`` hold what the runner reported (kernel names, tile
configurations, a block's diagnostics), which a program that answers for its
runner writes; so no text of a report holds a control character or a lone
surrogate (:func:`printable`, every string of ``details`` too): a carriage
return or an escape sequence in an exception would rewrite the verdict on a
terminal, and a surrogate (``"\ud800"`` in a ``raise``) has no UTF-8, so the
report's JSON could not be written and ``verify`` crashed after its verdict.  Renderers print a message's first line where a line is all there
is room for (:func:`headline`) and indent the rest, so quoted text never
stands where a verdict line would.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

STAGES = ("static", "reference", "compile", "correctness", "launch_audit", "performance")
GPU_STAGES = ("correctness", "launch_audit", "performance")
REPORT_FORMAT = 2

StageName = Literal["static", "reference", "compile", "correctness", "launch_audit", "performance"]
# "slow": the performance stage ran on a correct program that missed a speed target.
StageStatus = Literal["passed", "slow", "failed", "skipped", "error"]
Outcome = Literal["accepted", "correct_slow", "cpu_passed", "rejected", "error"]
CORRECT = ("accepted", "correct_slow")  # outcomes whose program passed every correctness check on a GPU


# C0 and C1 controls but tab and newline, the bidirectional overrides that reorder a line, and lone
# surrogates (no UTF-8 encodes them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline written as its escape (``\\r``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def printable_tree(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with :func:`printable` applied to every
    string in it, dict keys included."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(printable_tree(v) for v in value)
    return value


def indented(message: str, by: int = 4) -> str:
    """A message's later lines indented under its first: quoted text never starts a line."""
    return message.strip().replace("\n", "\n" + " " * by)


def headline(message: str) -> str:
    """A message's first line, marked when more follows."""
    first, _, rest = message.strip().partition("\n")
    return first + (" [...]" if rest.strip() else "")


class _Verdict(BaseModel):
    """A part of a report.  Its JSON keeps inf and NaN as ``Infinity`` and ``NaN`` (which
    Python's json and pydantic read back), not pydantic's default null: a program whose output is
    NaN errs by inf, and a report.json with null there would not load again."""

    model_config = ConfigDict(ser_json_inf_nan="constants")


class Mismatch(_Verdict):
    """Where one output (or gradient) differs from the reference."""

    tensor: str
    shape_set: str
    max_abs_err: float
    allowed: float
    rel_norm_err: float | None = None
    nan_count: int = 0
    unwritten_count: int = 0
    worst_index: list[int] = Field(default_factory=list)
    pattern: str = ""  # e.g. "odd columns only", "ragged last rows", "all"
    inputs: str = ""  # which draw: "seed", "edge rows (tiny and large norms)", ...

    @field_validator("tensor", "pattern")
    @classmethod
    def _printable(cls, text: str) -> str:  # a result's name is the runner's word where it is unexpected
        return printable(text)


class StageResult(_Verdict):
    name: StageName
    status: StageStatus
    seconds: float = 0.0
    message: str = ""  # short human summary; for failures, the fix-oriented error
    log: str = ""  # trimmed raw log (compiler output, traceback)
    line: int | None = None  # line in the candidate program the error points at
    mismatches: list[Mismatch] = Field(default_factory=list)
    details: dict[str, Any] = Field(default_factory=dict)

    @field_validator("message", "log")
    @classmethod
    def _printable(cls, text: str) -> str:
        return printable(text)

    @field_validator("details")
    @classmethod
    def _printable_details(cls, details: dict[str, Any]) -> dict[str, Any]:
        return printable_tree(details)


class Report(_Verdict):
    format: int = REPORT_FORMAT
    task: str
    program_sha256: str
    outcome: Outcome
    stages: list[StageResult] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)
    cache_key: str | None = None
    cached: bool = False
    created_utc: str = ""

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"

    @property
    def correct(self) -> bool:
        """Correct on the GPU, fast or not."""
        return self.outcome in CORRECT

    def stage(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def failed_stage(self) -> StageResult | None:
        return next((s for s in self.stages if s.status in ("failed", "error")), None)

    @staticmethod
    def outcome_of(stages: list[StageResult]) -> Outcome:
        if any(s.status == "error" for s in stages):
            return "error"
        if any(s.status == "failed" for s in stages):
            return "rejected"
        if any(s.status == "slow" for s in stages):
            return "correct_slow"
        ran = {s.name for s in stages if s.status == "passed"}
        if ran >= set(STAGES):
            return "accepted"
        return "cpu_passed"
