"""Human review of finished trajectories: read, then approve or reject, on the record.

A *reviewable* trajectory directory (one with ``result.json``; see
agent/rundir.py) holds either ``accepted/`` (every stage passed on a Hopper
GPU) or ``best/`` with a ``cpu_passed`` best attempt (every CPU stage passed,
GPU stages skipped).  The second is shown under a banner and may only be
approved with ``allow_cpu_only``: an approval is what ``export`` trusts.

The decision is ``review.json`` in the trajectory directory, written
atomically: decision, who, when (UTC), why, the program's sha256 (so an
approval cannot silently carry over to a different program), and whether it
was a CPU-only approval.
"""

from __future__ import annotations

import difflib
import getpass
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coda_agent.agent.protocols import CodaError
from coda_agent.agent.rundir import read_events, utc_now
from coda_agent.kernels.source import CPU_ONLY as CPU_ONLY_BANNER
from coda_agent.kernels.source import final_program, task_file
from coda_agent.storage import write_json
from coda_agent.verifier.report import indented


@dataclass
class Candidate:
    """A trajectory's final program: accepted/ or a cpu_passed best/."""

    path: Path  # the trajectory directory
    kind: str  # "accepted" | "best"
    result: dict[str, Any]

    @property
    def cpu_only(self) -> bool:
        return self.kind != "accepted"

    @property
    def program(self) -> str:
        return (self.path / self.kind / "program.py").read_text()

    @property
    def program_sha256(self) -> str:
        return hashlib.sha256(self.program.encode()).hexdigest()

    def report(self) -> dict[str, Any]:
        return json.loads((self.path / "attempts" / f"{self.result['best_attempt']:02d}" / "report.json").read_text())

    def review(self) -> dict[str, Any] | None:
        p = self.path / "review.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def task_path(self) -> Path:
        """The task YAML: the run's copy next to the trajectory (or one level up for sample-i/)."""
        path = task_file(self.path)
        if path is None:
            raise CodaError(f"{self.path}: no task.yaml in the run directory")
        return path

    def config(self) -> dict[str, Any]:
        for d in (self.path, self.path.parent):
            if (d / "config.json").is_file():
                return json.loads((d / "config.json").read_text())
        return {}


def candidate(path: Path) -> Candidate | None:
    """The reviewable program of a trajectory directory, or None."""
    found = final_program(path)
    return Candidate(path, *found) if found else None


def find_candidates(root: Path) -> list[Candidate]:
    found = [candidate(p.parent) for p in sorted(root.rglob("result.json"))]
    return [c for c in found if c is not None]


def status(c: Candidate) -> str:
    r = c.review()
    return "awaiting review" if r is None else f"{r['decision']} by {r['who']} ({r['when'][:19]})"


# --------------------------------------------------------------------------- showing one

def show(c: Candidate) -> str:
    """Everything a reviewer reads: banner, numbers, program, diff to the expert, transcript summary."""
    report = c.report()
    lines = [f"# {report['task']}: {c.path}", ""]
    if c.cpu_only:
        lines += [f"!!! {CPU_ONLY_BANNER} !!!", ""]
    lines += [f"outcome: {report['outcome']}   review: {status(c)}   ran on: "
              f"{report.get('versions', {}).get('ran_on', report.get('versions', {}).get('device', '?'))}", ""]
    lines += ["## Report", *report_lines(report, c), ""]
    lines += ["## Program", "```python", c.program.rstrip(), "```", ""]
    lines += ["## Diff against the expert program", "```diff", expert_diff(c).rstrip() or "(identical)", "```", ""]
    lines += ["## Transcript", *transcript_lines(c)]
    return "\n".join(lines) + "\n"


def report_lines(report: dict[str, Any], c: Candidate) -> list[str]:
    import yaml

    out = [f"- {s['name']}: {s['status']}" + (f" ({s['seconds']:.1f}s)" if s.get("seconds") else "")
           + (f": {indented(s['message'], 2)}" if s.get("message") else "") for s in report["stages"]]
    perf = next((s for s in report["stages"] if s["name"] == "performance" and s["status"] == "passed"), None)
    if perf:
        d = perf["details"]
        ms = d.get("ms", {})
        out.append(f"- times on {d.get('shape_set')}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
        out.append(f"- vs plain GEMM: {d.get('vs_gemm')}x the time (target <= {d.get('target_vs_gemm')}); "
                   f"torch.compile speedup {d.get('compile_speedup', 'n/a')}; {d.get('tflops')} TFLOP/s")
    else:
        out.append("- performance: n/a (no GPU run)")
    spec = yaml.safe_load(c.task_path().read_text())
    out.append(f"- baselines: {', '.join(spec.get('baselines', ['gemm', 'eager', 'compile']))}")
    out.append("- shape sets: " + "; ".join(f"{k} {v}" for k, v in spec.get("shapes", {}).items()))
    return out


def expert_diff(c: Candidate) -> str:
    import yaml

    task_yaml = c.task_path()
    spec = yaml.safe_load(task_yaml.read_text())
    if not spec.get("expert"):
        return "(the task has no expert program to compare with)"
    # The expert path is relative to the original task file (the run's task.yaml is a copy).
    original = Path(c.config().get("task_path", task_yaml))
    expert = (original.parent / spec["expert"]).resolve()
    if not expert.is_file():
        return f"(the expert program {expert} is not there)"
    return "".join(difflib.unified_diff(expert.read_text().splitlines(True), c.program.splitlines(True),
                                        fromfile=f"expert/{expert.name}", tofile=f"{c.kind}/program.py"))


def transcript_lines(c: Candidate) -> list[str]:
    r = c.result
    events = read_events(c.path / "transcript.jsonl")
    cost = "unknown" if r["cost_usd"] is None else f"${r['cost_usd']:.4f}"
    out = [f"- stop: {r['stop_reason']} after {r['turns']} turns, {r['attempts']} attempts; tokens "
           f"{r['prompt_tokens']}+{r['completion_tokens']}, cost {cost}, {r['wall_s']:.1f}s"]
    for e in events:
        if e["event"] == "attempt":
            out.append(f"- turn {e['turn']}: attempt {e['attempt']:02d} {e['outcome']}")
        elif e["event"] == "message" and e.get("kind") == "format":
            out.append(f"- turn {e['turn']}: the reply held no program (format message sent)")
    return out


# --------------------------------------------------------------------------- deciding

def default_who() -> str:
    who = os.environ.get("USER")
    if who:
        return who
    try:
        name = subprocess.run(["git", "config", "user.name"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        name = ""
    return name.strip() or getpass.getuser()


def decide(c: Candidate, decision: str, who: str, why: str = "", allow_cpu_only: bool = False) -> dict[str, Any]:
    if decision == "approved" and c.cpu_only and not allow_cpu_only:
        raise CodaError(f"{c.path}: {CPU_ONLY_BANNER}; approving it needs --allow-cpu-only "
                        "(better: verify it on a Hopper GPU first)")
    if decision == "rejected" and not why.strip():
        raise CodaError("--reject needs --why TEXT: the reason is what the next reviewer reads")
    record = {"decision": decision, "who": who, "when": utc_now(), "why": why, "kind": c.kind,
              "cpu_only": c.cpu_only, "program_sha256": c.program_sha256,
              "attempt": c.result["best_attempt"]}
    write_json(c.path / "review.json", record)
    return record
