"""``coda-agent verify``'s verdict as a run directory, so a hand-written program goes
through ``review`` and ``export`` exactly as an LLM's does.

The layout is agent/rundir.py's with author ``verify``: the task and its
reference files, ``config.json`` with the verifier's settings and the program's
path, one attempt (``attempts/01``), ``accepted/`` or ``best/``, and a
``result.json`` whose stop reason is the verdict.  There is no transcript: no
model was asked.  The verifier cannot write it itself (run directories belong to
this layer, above the verifier), so the top-level CLI hands this function to
the ``verify`` command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .loop import TrajectoryResult, rank
from .rundir import RunDir

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task
    from coda_agent.verifier.report import Report

AUTHOR = "verify"


def record_verdict(runs_dir: Path, task: "Task", program: Path, source: str, report: "Report",
                   verifier: dict[str, Any]) -> Path:
    """Write the run directory of one verdict; returns its path."""
    config = {"author": AUTHOR, "program": str(program.resolve()), "budget": {"samples": 1},
              "verifier": verifier}
    run = RunDir.create(runs_dir, task, AUTHOR, config)
    trajectory = run.trajectory(0)
    trajectory.write_attempt(1, source, report)
    trajectory.write_final(1)
    trajectory.write_result(TrajectoryResult(
        stop_reason=report.outcome, accepted=report.accepted, attempts=1, best_attempt=1,
        best_outcome=report.outcome, best_rank=rank(report),
        wall_s=round(sum(s.seconds for s in report.stages), 3)).model_dump())
    return run.path
