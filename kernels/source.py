"""Where an accepted program comes from: a run directory (``agent/rundir.py``'s layout).

A trajectory directory holds ``result.json``; its final program is
``accepted/program.py`` when every stage passed on a Hopper GPU, or
``best/program.py`` when the best attempt only passed the CPU stages
(``cpu_passed``, not an acceptance).  The task spec as used is ``task.yaml``
beside it (one level up for ``sample-i/``), and the catalogue version the
program was verified against is in its attempt's ``report.json``
(``versions.catalogue``).  ``eval/review.py`` reads the same files through
:func:`final_program` and :func:`task_file`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .kernel import Kernel, KernelError

CPU_ONLY = "NOT ACCEPTED: CPU stages only (no GPU ran correctness, launch audit or performance)"


def final_program(trajectory: Path) -> tuple[str, dict] | None:
    """("accepted" | "best", result.json) of a trajectory directory, or None when it has neither."""
    rf = trajectory / "result.json"
    if not rf.is_file():
        return None
    result = json.loads(rf.read_text())
    if result.get("accepted") and (trajectory / "accepted" / "program.py").is_file():
        return "accepted", result
    if result.get("best_outcome") == "cpu_passed" and (trajectory / "best" / "program.py").is_file():
        return "best", result
    return None


def task_file(trajectory: Path) -> Path | None:
    """The run's copy of the task YAML: beside the trajectory, or one level up for sample-i/."""
    return next((d / "task.yaml" for d in (trajectory, trajectory.parent) if (d / "task.yaml").is_file()), None)


def _trajectory(path: Path) -> Path:
    """The trajectory a path names: itself, or the one sample of a run that has a final program."""
    if (path / "result.json").is_file():
        return path
    samples = sorted(p for p in path.glob("sample-*") if final_program(p) is not None)
    if len(samples) == 1:
        return samples[0]
    if not samples:
        raise KernelError(f"{path}: no accepted program here (give a run directory runs/<utc>-<task>-<author>/ "
                          "or one of its sample-<i>/ directories)")
    raise KernelError(f"{path}: {len(samples)} samples have a final program ({', '.join(p.name for p in samples)}); "
                      "give the one to load")


def load_kernel(path: str | Path, *, allow_cpu_only: bool = False) -> Kernel:
    """The accepted program of a run directory as a :class:`Kernel`.

    A ``cpu_passed`` best attempt (GPU stages never ran) loads only with
    ``allow_cpu_only=True``.  The catalogue version comes from the attempt's report."""
    traj = _trajectory(Path(path))
    found = final_program(traj)
    if found is None:
        raise KernelError(f"{traj}: no accepted program (nor a cpu_passed best/) in this trajectory")
    kind, result = found
    if kind == "best" and not allow_cpu_only:
        raise KernelError(f"{traj}: {CPU_ONLY}; loading it needs allow_cpu_only=True (better: verify it on a "
                          "Hopper GPU first)")
    task = task_file(traj)
    if task is None:
        raise KernelError(f"{traj}: no task.yaml in the run directory")
    report = traj / "attempts" / f"{result['best_attempt']:02d}" / "report.json"
    catalogue = json.loads(report.read_text()).get("versions", {}).get("catalogue") if report.is_file() else None
    if catalogue is None:
        raise KernelError(f"{traj}: the report of attempt {result['best_attempt']} records no catalogue version, "
                          "so nothing says what the program meant; verify it again (coda-agent verify)")
    return Kernel.from_source((traj / kind / "program.py").read_text(), task.read_text(), catalogue=catalogue,
                              origin=str(traj))
