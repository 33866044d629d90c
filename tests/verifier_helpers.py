"""The verifier tests' tiny task (tests/tasks/outproj_residual.yaml): its reference
and the bad-program corpus reader."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
TASK_PATH = HERE / "tasks" / "outproj_residual.yaml"
EXPERT_PATH = HERE / "tasks" / "outproj_residual_expert.py"
CORPUS = HERE / "bad_programs"


def outproj_residual_ref(x, w, r):
    return {"y": x @ w + r}


@dataclass
class BadProgram:
    path: Path
    stage: str
    expect: str  # a substring of the failing stage's message; alternatives joined by " || "
    needs: str  # "cpu" (static/reference/timeout), "compile" (sm_90a compiler) or "gpu"
    static: bool  # False: the test skips the static stage, to reach the runtime defences
    task: str  # "" for the tiny task, else a suite task's name

    @property
    def family(self) -> str:
        return self.path.parent.name

    @property
    def id(self) -> str:
        return f"{self.family}/{self.path.stem}"

    @property
    def source(self) -> str:
        return self.path.read_text()

    def found_in(self, message: str) -> bool:
        """Whether the message names this case's trick: holds one of its ``# expect:`` texts
        (a trick whose first symptom depends on how many calls earlier stages made lists each)."""
        return any(e.strip() in message for e in self.expect.split(" || "))


def corpus() -> list[BadProgram]:
    """Every tests/bad_programs/<family>/*.py with its header: ``# stage: S``, ``# expect: TEXT``,
    and optionally ``# needs: gpu``, ``# static: off`` and ``# task: NAME`` (a suite task)."""
    out = []
    for path in sorted(CORPUS.glob("*/*.py")):
        head = dict(re.findall(r"^# (stage|expect|needs|static|task): (.*)$", path.read_text(), re.M))
        assert "stage" in head and "expect" in head, f"{path}: header needs '# stage:' and '# expect:'"
        stage = head["stage"].strip()
        needs = head.get("needs", "gpu" if stage in ("correctness", "launch_audit", "performance")
                         else "compile" if stage == "compile" else "cpu")
        out.append(BadProgram(path, stage, head["expect"].strip(), needs.strip(),
                              head.get("static", "on").strip() != "off", head.get("task", "").strip()))
    return out
