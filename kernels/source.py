"""Where an accepted program comes from: a run directory (``agent/rundir.py``'s layout).

A trajectory directory holds ``result.json``; its final program is
``accepted/program.py`` when every stage passed on a Hopper GPU, or
``best/program.py`` when the best attempt only passed the CPU stages
(``cpu_passed``, not an acceptance).  The task spec as used is ``task.yaml``
beside it (one level up for ``sample-i/``), and the catalogue version the
program was verified against is in its attempt's ``report.json``
(``versions.catalogue``).  ``eval/review.py`` reads the same files through
:func:`final_program` and :func:`task_file`.

``result.json`` only points at the final attempt; what backs a final program is
that attempt's ``report.json`` (:func:`unbacked`): the program's sha256, the
outcome its folder claims, the task, and for ``best/`` the CPU stages that ran.
A verdict of a ``--stages`` subset (``verify --stages static`` is
``cpu_passed``: every stage that ran passed) and a program edited after its
verdict are then nothing to review, export or load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .kernel import Kernel, KernelError

CPU_ONLY = "NOT ACCEPTED: CPU stages only (no GPU ran correctness, launch audit or performance)"
# The stages a final program's report must show passed: the reference stage is the only check of
# correctness a cpu_passed verdict has, and the static stage's rules are all that holds the program
# in the process that loads the kernel (a training run has no runner around it).
CPU_CHECKS = ("static", "reference")


def _claimed(trajectory: Path) -> tuple[str, dict] | None:
    """("accepted" | "best", result.json) that a trajectory's result.json claims a program for, or
    None when it claims neither (whether the claim is backed: :func:`unbacked`)."""
    rf = trajectory / "result.json"
    if not rf.is_file():
        return None
    result = json.loads(rf.read_text())
    if result.get("accepted") and (trajectory / "accepted" / "program.py").is_file():
        return "accepted", result
    if result.get("best_outcome") == "cpu_passed" and (trajectory / "best" / "program.py").is_file():
        return "best", result
    return None


def final_program(trajectory: Path) -> tuple[str, dict] | None:
    """("accepted" | "best", result.json) of a trajectory directory, or None when it has neither
    or its report does not back it."""
    found = _claimed(trajectory)
    return None if found is None or unbacked(trajectory, *found) else found


def unbacked(trajectory: Path, kind: str, result: dict) -> str | None:
    """Why the final attempt's report does not back ``<kind>/program.py``, or None when it does.

    Files a run directory holds are trusted only as far as they agree: the report is what the
    verifier said about one program (its sha256) of one task, so a program edited after its
    verdict, a result.json pointing at another attempt, or a verdict that skipped the checks of
    correctness (a ``--stages`` subset) backs nothing."""
    attempt = result.get("best_attempt")
    try:
        report = json.loads((trajectory / "attempts" / f"{int(attempt):02d}" / "report.json").read_text())
        program = (trajectory / kind / "program.py").read_text()
        stages = {s["name"]: s["status"] for s in report["stages"]}
        outcome, sha, task_name = report["outcome"], report["program_sha256"], report["task"]
    except (OSError, ValueError, TypeError, KeyError):
        return f"the report of attempt {attempt} is missing or unreadable"
    want = "accepted" if kind == "accepted" else "cpu_passed"
    if outcome != want:
        return f"{kind}/ holds a program, but the report of attempt {attempt} says {outcome}, not {want}"
    if sha != hashlib.sha256(program.encode()).hexdigest():
        return f"{kind}/program.py is not the program attempt {attempt} judged (it changed since its verdict)"
    skipped = [s for s in CPU_CHECKS if stages.get(s) != "passed"]
    if skipped:
        return (f"the verdict of attempt {attempt} never passed the {', '.join(skipped)} stage "
                f"({', '.join(f'{k} {v}' for k, v in stages.items())}): a check of a stage subset backs no kernel")
    task = task_file(trajectory)
    named = _task_name(task) if task is not None else None
    if named != task_name:
        return f"the report judged task {task_name!r}, but the run's task.yaml is {named!r}"
    return None


def _task_name(path: Path) -> str | None:
    import yaml

    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return spec.get("name") if isinstance(spec, dict) else None


def task_file(trajectory: Path) -> Path | None:
    """The run's copy of the task YAML: beside the trajectory, or one level up for sample-i/."""
    return next((d / "task.yaml" for d in (trajectory, trajectory.parent) if (d / "task.yaml").is_file()), None)


def why_not_final(trajectory: Path) -> str | None:
    """Why a trajectory that has a final program by its result.json is not backed by its report."""
    found = _claimed(trajectory)
    return None if found is None else unbacked(trajectory, *found)


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
        why = why_not_final(traj)
        raise KernelError(f"{traj}: " + (f"{why}; verify the program again (coda-agent verify)" if why else
                                         "no accepted program (nor a cpu_passed best/) in this trajectory"))
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
