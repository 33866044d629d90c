"""A batch's numbers, always rebuilt from its run directories (never from memory).

So a killed and resumed batch, or ``coda-agent report`` on someone else's
batch, gives the same summary the runs support.  Per trajectory: stop reason,
turns, tokens, cost, where it was verified, whether its best attempt was
*correct* (``accepted`` or ``correct_slow``: every check of correctness passed
on a GPU) and *accepted* (correct and meeting the task's speed targets), and
for a correct one the performance stage's numbers of that attempt
(``verifier/timing.py``: ``ms.program``, ``ms.gemm``, ``ms.compile``,
``vs_gemm`` = program / plain GEMM time, ``compile_speedup`` = torch.compile /
program time).

Speedups are "higher is better" throughout: vs the plain GEMM it is
``gemm_ms / program_ms`` (the plain GEMM of the same shapes is the speed of
light for a fused epilogue, so expect <= 1), vs torch.compile it is
``compile_ms / program_ms``.  Per task the best correct sample counts.

Suite metrics:

- pass@k: the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)``
  with n finished samples and c accepted (correct and fast), averaged over
  tasks; correct@k the same with c correct at any speed.
- fast_p: KernelBench's, the fraction of tasks with a correct sample whose
  speedup is > p (fast_0 is the fraction correct), for p in :data:`FAST_P`
  against both baselines; ``None`` when no report holds performance numbers
  (a machine without a GPU cannot measure any).
- geomean speedup over the correct tasks that have numbers.
- cpu_passed (every stage that ran passed, GPU stages skipped) is counted on its
  own and never as accepted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from coda_agent.storage import write_atomic, write_json
from coda_agent.verifier.report import CORRECT

from .batch import BatchDir

FAST_P = (0.0, 0.8, 1.0, 1.2, 1.5)
BASELINES = {"gemm": "plain GEMM", "compile": "torch.compile"}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: the chance that k of n samples (c of them correct) hold a correct one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _read_report(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def performance(report: dict[str, Any] | None) -> dict[str, float | None]:
    """Speedups and time from a report's performance stage; all None when it did not run."""
    stage = next((s for s in (report or {}).get("stages", []) if s["name"] == "performance"), None)
    d = stage["details"] if stage and stage["status"] in ("passed", "slow") else {}
    vs_gemm = d.get("vs_gemm")
    return {"speedup_vs_gemm": round(1 / vs_gemm, 4) if vs_gemm else None,
            "speedup_vs_compile": d.get("compile_speedup"),
            "program_ms": (d.get("ms") or {}).get("program"), "shape_set": d.get("shape_set")}


def trajectory_row(batch: BatchDir, task: str, sample: int) -> dict[str, Any]:
    path = batch.run_path(task, sample)
    row: dict[str, Any] = {"sample": sample, "run": str(path.relative_to(batch.path)), "stop_reason": None,
                           "detail": "", "accepted": False, "correct": False, "cpu_passed": False, "turns": 0,
                           "attempts": 0,
                           "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "wall_s": 0.0,
                           "ran_on": [], "speedup_vs_gemm": None, "speedup_vs_compile": None,
                           "program_ms": None}
    result = batch.result(task, sample)
    if result is None:
        return row
    row.update({k: result[k] for k in ("stop_reason", "detail", "accepted", "turns", "attempts", "prompt_tokens",
                                       "completion_tokens", "cost_usd", "wall_s")})
    row["cpu_passed"] = result["stop_reason"] == "cpu_passed"
    row["correct"] = result["accepted"] or result.get("best_outcome") in CORRECT
    reports = [_read_report(p / "report.json") for p in sorted((path / "attempts").glob("[0-9]*"))]
    row["ran_on"] = [r.get("versions", {}).get("ran_on", "?") for r in reports if r]
    if row["correct"] and result.get("best_attempt"):
        best = _read_report(path / "attempts" / f"{result['best_attempt']:02d}" / "report.json")
        perf = performance(best)
        row.update({k: perf[k] for k in ("speedup_vs_gemm", "speedup_vs_compile", "program_ms")})
    return row


def _best(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r["correct"] and r[key] is not None]
    return max(values) if values else None


def _sum_cost(rows: list[dict[str, Any]]) -> float | None:
    return None if any(r["cost_usd"] is None for r in rows) else round(sum(r["cost_usd"] for r in rows), 6)


def task_row(batch: BatchDir, task: str) -> dict[str, Any]:
    rows = [trajectory_row(batch, task, i) for i in range(batch.samples)]
    accepted = [r for r in rows if r["accepted"]]
    return {"task": task, "samples": len(rows), "finished": sum(r["stop_reason"] is not None for r in rows),
            "accepted": len(accepted), "correct": sum(r["correct"] for r in rows),
            "cpu_passed": sum(r["cpu_passed"] for r in rows),
            "solved": bool(accepted), "turns": [r["turns"] for r in rows],
            "turns_to_accept": min((r["turns"] for r in accepted), default=None),
            "best_speedup_vs_gemm": _best(rows, "speedup_vs_gemm"),
            "best_speedup_vs_compile": _best(rows, "speedup_vs_compile"),
            "best_program_ms": min((r["program_ms"] for r in rows if r["correct"] and r["program_ms"]),
                                   default=None),
            "tokens": sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows),
            "cost_usd": _sum_cost(rows), "trajectories": rows}


def _geomean(values: list[float]) -> float | None:
    return round(math.exp(sum(map(math.log, values)) / len(values)), 4) if values else None


def suite_metrics(tasks: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    rows = [r for t in tasks for r in t["trajectories"]]
    ks = sorted({1, samples} | {k for k in (2, 5, 10, 20, 50, 100) if k < samples})
    pass_k, correct_k = {}, {}
    for k in ks:
        eligible = [t for t in tasks if t["finished"] >= k]
        for out, field in ((pass_k, "accepted"), (correct_k, "correct")):
            out[str(k)] = round(sum(pass_at_k(t["finished"], t[field], k) for t in eligible)
                                / len(eligible), 4) if eligible else None
    measured = any(t[f"best_speedup_vs_{b}"] is not None for t in tasks for b in BASELINES)
    fast_p, geomean = {}, {}
    for b in BASELINES:
        speedups = [t[f"best_speedup_vs_{b}"] for t in tasks if t["correct"]]
        fast_p[b] = {str(p): round(sum(s is not None and s > p for s in speedups) / len(tasks), 4)
                     for p in FAST_P} if measured and tasks else None
        geomean[b] = _geomean([s for s in speedups if s])
    prompt = sum(r["prompt_tokens"] for r in rows)
    completion = sum(r["completion_tokens"] for r in rows)
    cost = _sum_cost(rows)
    return {"tasks": len(tasks), "samples": samples, "trajectories": len(rows),
            "finished": sum(r["stop_reason"] is not None for r in rows),
            "accepted_trajectories": sum(r["accepted"] for r in rows),
            "solved_tasks": sum(t["solved"] for t in tasks),
            "cpu_passed_trajectories": sum(r["cpu_passed"] for r in rows),
            "correct_trajectories": sum(r["correct"] for r in rows),
            "correct_tasks": sum(t["correct"] > 0 for t in tasks),
            "cpu_passed_tasks": sum(t["cpu_passed"] > 0 for t in tasks),
            "stop_reasons": {r: sum(row["stop_reason"] == r for row in rows)
                             for r in sorted({row["stop_reason"] for row in rows if row["stop_reason"]})},
            "pass_at_k": pass_k, "correct_at_k": correct_k, "fast_p": fast_p, "geomean_speedup": geomean,
            "measured": measured,
            "prompt_tokens": prompt, "completion_tokens": completion, "tokens": prompt + completion,
            "tokens_per_task": round((prompt + completion) / len(tasks), 1) if tasks else 0,
            "cost_usd": cost, "cost_per_task": round(cost / len(tasks), 6) if cost is not None and tasks else None}


def build(batch: BatchDir) -> dict[str, Any]:
    tasks = [task_row(batch, name) for name in batch.task_names()]
    cfg = batch.meta["config"]
    return {"batch": batch.path.name, "created_utc": batch.meta["created_utc"], "author": cfg["author"],
            "model": cfg["llm"].get("model") if cfg["author"] == "llm" else cfg["author"],
            "samples": batch.samples, "workers": batch.meta.get("workers", {}),
            "suite": suite_metrics(tasks, batch.samples), "tasks": tasks}


def write(batch: BatchDir) -> dict[str, Any]:
    summary = build(batch)
    write_json(batch.path / "summary.json", summary)
    write_atomic(batch.path / "summary.md", markdown(summary))
    return summary


# --------------------------------------------------------------------------- Markdown

def fmt_x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_cost(v: float | None) -> str:
    return "unknown" if v is None else f"${v:.4f}"


def fmt_frac(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def task_table_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The per-task table, shared by the Markdown and the HTML report."""
    out = []
    for t in summary["tasks"]:
        verdict = (f"yes ({t['accepted']}/{t['samples']})" if t["solved"] else
                   f"no (correct but slow {t['correct']}/{t['samples']})" if t["correct"] else
                   f"no (cpu_passed {t['cpu_passed']}/{t['samples']})" if t["cpu_passed"] else "no")
        if t["finished"] < t["samples"]:
            verdict += f", {t['samples'] - t['finished']} unfinished"
        out.append([t["task"], verdict, ", ".join(map(str, t["turns"])),
                    "-" if t["turns_to_accept"] is None else str(t["turns_to_accept"]),
                    fmt_x(t["best_speedup_vs_gemm"]), fmt_x(t["best_speedup_vs_compile"]),
                    str(t["tokens"]), fmt_cost(t["cost_usd"])])
    return out


TASK_COLUMNS = ["task", "accepted", "turns per sample", "turns to accept", "speedup vs GEMM",
                "speedup vs torch.compile", "tokens", "cost"]


def suite_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric, value) pairs, shared by the Markdown and the HTML report."""
    s = summary["suite"]
    lines = [("accepted (correct and fast)", f"{s['solved_tasks']}/{s['tasks']} tasks, "
                                          f"{s['accepted_trajectories']}/{s['trajectories']} trajectories"),
             ("correct (any speed)", f"{s['correct_tasks']}/{s['tasks']} tasks, {s['correct_trajectories']}/"
                                     f"{s['trajectories']} trajectories")]
    lines.append(("cpu_passed (not accepted)", f"{s['cpu_passed_tasks']} tasks, {s['cpu_passed_trajectories']} "
                                               "trajectories"))
    lines.append(("stop reasons", ", ".join(f"{r} {n}" for r, n in s["stop_reasons"].items()) or "none yet"))
    lines += [(f"pass@{k}", fmt_frac(v)) for k, v in s["pass_at_k"].items()]
    lines += [(f"correct@{k}", fmt_frac(v)) for k, v in s["correct_at_k"].items()]
    for b, name in BASELINES.items():
        fp = s["fast_p"][b]
        lines.append((f"fast_p vs {name}", "n/a (no performance numbers)" if fp is None else
                      ", ".join(f"p={p}: {v:.2f}" for p, v in fp.items())))
        lines.append((f"geomean speedup vs {name}", fmt_x(s["geomean_speedup"][b])))
    lines.append(("tokens", f"{s['tokens']} ({s['prompt_tokens']} prompt + {s['completion_tokens']} "
                            f"completion), {s['tokens_per_task']} per task"))
    lines.append(("cost", f"{fmt_cost(s['cost_usd'])} total, {fmt_cost(s['cost_per_task'])} per task"))
    return lines


def notes(summary: dict[str, Any]) -> list[str]:
    s, out = summary["suite"], []
    if s["finished"] < s["trajectories"]:
        out.append(f"Incomplete: {s['finished']} of {s['trajectories']} trajectories finished; "
                   f"continue with `coda-agent eval --resume {summary['batch']}`.")
    if not s["measured"] and s["accepted_trajectories"]:
        out.append("No performance numbers in the accepted reports (the performance stage recorded none): "
                   "speedups are n/a.")
    elif not s["measured"]:
        out.append("No performance numbers: the GPU stages did not run (no CUDA), so nothing could be "
                   "accepted and speedups are n/a. cpu_passed means every CPU stage passed; it is not an "
                   "acceptance.")
    return out


def stop_lines(summary: dict[str, Any]) -> list[str]:
    """Every trajectory that stopped without passing, with its stop reason and message."""
    out = []
    for t in summary["tasks"]:
        for r in t["trajectories"]:
            if r["stop_reason"] and r["stop_reason"] not in ("accepted", "cpu_passed"):
                detail = r["detail"].strip().splitlines()[-1] if r["detail"].strip() else ""
                out.append(f"{t['task']} sample {r['sample']}: {r['stop_reason']}" + (f": {detail}" if detail else ""))
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['batch']}: {summary['suite']['tasks']} tasks x {summary['samples']} samples "
             f"({summary['model']})", ""]
    lines += [f"> {n}" for n in notes(summary)] + ([""] if notes(summary) else [])
    lines += ["| " + " | ".join(TASK_COLUMNS) + " |", "|" + "---|" * len(TASK_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in task_table_rows(summary)]
    stops = stop_lines(summary)
    if stops:
        lines += ["", "## Stopped without passing", ""] + [f"- {line}" for line in stops]
    lines += ["", "## Suite", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in suite_lines(summary)]
    lines += ["", "Speedup = baseline time / program time (higher is better; the plain GEMM of the same "
                  "shapes is the speed of light, so expect <= 1.00x against it). fast_p: the fraction of "
                  "tasks with a correct sample whose speedup is > p (best of the samples; fast_0 = correct). "
                  "pass@k counts accepted samples (correct and meeting the task's targets), correct@k "
                  "correct ones at any speed."]
    return "\n".join(lines) + "\n"
