"""Every expert program of the suite through the verifier on the H200, in one go.

Pass 1 runs the candidates concurrently (the child processes compile on the
CPU cores side by side) through the stages whose verdict does not depend on a
quiet GPU: static, reference, compile, correctness, launch audit.  Pass 2 runs
them one at a time through every stage, performance included, with quack's
compile cache now warm: its wall time is the cost of verifying a new
candidate of a known shape, and its reports are the ones recorded.
Each report is written to ``OUT/reports/<task>.json`` as soon as it exists, so
a run cut short by its time limit still leaves every finished verdict.

Usage on the device: ``python3 bench/gpu_suite.py OUT [--sets small,ragged,llama3-1b]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coda_agent.tasks import SUITE_DIR, load_suite
from coda_agent.verifier import Verifier
from coda_agent.verifier.report import STAGES


def _write(out: Path, name: str, payload: dict) -> None:
    with open(out / name, "a") as fh:
        fh.write(json.dumps(payload) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sets", default="small,ragged,llama3-1b")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tasks", default="")
    ap.add_argument("--pass2-budget-s", type=float, default=1e9,
                    help="stop starting pass-2 checks after this many seconds")
    ap.add_argument("--pass2-first", default="",
                    help="comma-separated tasks to time first in pass 2 (the rest follow)")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "reports").mkdir(parents=True, exist_ok=True)
    wanted = set(filter(None, args.tasks.split(",")))
    suite = [t for t in load_suite(SUITE_DIR) if not wanted or t.name in wanted]
    sets = tuple(args.sets.split(","))

    gpu_free = [s for s in STAGES if s != "performance"]
    first = Verifier(stages=gpu_free, cache=False, shape_sets=sets)

    def check(task):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        report = first.check(task, task.expert_path.read_text())
        failed = report.failed_stage
        row = {"task": task.name, "pass": 1, "outcome": report.outcome,
               "passed": [s.name for s in report.stages if s.status == "passed"],
               "wall_s": round(time.perf_counter() - t0, 1),
               "failed": f"{failed.name}: {failed.message[:400]}" if failed else None,
               "stages_s": {s.name: round(s.seconds, 1) for s in report.stages}}
        _write(out, "suite.jsonl", row)
        print(json.dumps(row), flush=True)
        return report

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(check, suite))

    full = Verifier(cache=False, shape_sets=sets)
    first_names = [n for n in args.pass2_first.split(",") if n]
    ordered = sorted(suite, key=lambda t: first_names.index(t.name) if t.name in first_names else len(first_names))
    start = time.perf_counter()
    for task in ordered:
        if time.perf_counter() - start > args.pass2_budget_s:
            _write(out, "suite.jsonl", {"task": task.name, "pass": 2, "outcome": "not run (time budget)"})
            continue
        t0 = time.perf_counter()
        report = full.check(task, task.expert_path.read_text())
        (out / "reports" / f"{task.name}.json").write_text(report.model_dump_json(indent=1))
        perf = report.stage("performance")
        failed = report.failed_stage
        row = {"task": task.name, "pass": 2, "outcome": report.outcome,
               "wall_s": round(time.perf_counter() - t0, 1),
               "failed": f"{failed.name}: {failed.message[:400]}" if failed else None,
               "stages_s": {s.name: round(s.seconds, 1) for s in report.stages},
               "performance": perf.details if perf else None}
        _write(out, "suite.jsonl", row)
        print(json.dumps({k: row[k] for k in ("task", "outcome", "wall_s", "failed")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
