"""Every expert program of the suite through the verifier on the H200, in one go.

Pass 1 (optional) runs the candidates concurrently through the stages whose
verdict does not depend on a quiet GPU: static, reference, compile,
correctness, launch audit.  Pass 2 runs every stage, performance included,
``--workers`` candidates at a time: their CPU stages overlap, and the
verifier's GPU lock (verifier/gpu_lock.py) gives each performance stage the
device alone.  Its reports are the ones recorded.  ``--solo TASK`` finally
verifies one candidate with nothing else running: the cost of verifying a new
candidate with warm compile caches.
Each report is written to ``OUT/reports/<task>.json`` as soon as it exists, so
a run cut short by its time limit still leaves every finished verdict.

Usage on the device: ``python3 bench/gpu_suite.py OUT [--sets small,ragged,llama3-1b] [--pass1]``
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


def _row(task, report, which, t0: float) -> dict:  # noqa: ANN001
    failed = report.failed_stage
    perf = report.stage("performance")
    row = {"task": task.name, "pass": which, "outcome": report.outcome,
           "wall_s": round(time.perf_counter() - t0, 1),
           "failed": f"{failed.name}: {failed.message[:400]}" if failed else None,
           "stages_s": {s.name: round(s.seconds, 1) for s in report.stages},
           "gpu_wait_s": {s.name: s.details["gpu_wait_s"] for s in report.stages
                          if "gpu_wait_s" in s.details},
           "performance": perf.details if perf else None}
    print(json.dumps({k: row[k] for k in ("task", "pass", "outcome", "wall_s", "failed")}), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sets", default="small,ragged,llama3-1b")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tasks", default="")
    ap.add_argument("--pass1", action="store_true", help="run the GPU-quiet stages first, concurrently")
    ap.add_argument("--solo", default="", help="comma-separated tasks to verify again alone at the end")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "reports").mkdir(parents=True, exist_ok=True)
    wanted = set(filter(None, args.tasks.split(",")))
    every = {t.name: t for t in load_suite(SUITE_DIR)}
    suite = [t for t in every.values() if not wanted or t.name in wanted]
    sets = tuple(args.sets.split(","))

    if args.pass1:
        first = Verifier(stages=[s for s in STAGES if s != "performance"], cache=False, shape_sets=sets)

        def check(task):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            report = first.check(task, task.expert_path.read_text())
            _write(out, "suite.jsonl", _row(task, report, 1, t0))
            return report

        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(check, suite))

    full = Verifier(cache=False, shape_sets=sets)

    def verify(task):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        report = full.check(task, task.expert_path.read_text())
        (out / "reports" / f"{task.name}.json").write_text(report.model_dump_json(indent=1))
        _write(out, "suite.jsonl", _row(task, report, 2, t0))

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(verify, suite))
    for name in filter(None, args.solo.split(",")):
        task = every[name]
        t0 = time.perf_counter()
        report = full.check(task, task.expert_path.read_text())
        _write(out, "suite.jsonl", _row(task, report, "solo", t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
