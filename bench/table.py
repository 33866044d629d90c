"""Regenerate the benchmark table in BENCHMARKS.md from bench/results/*.json.

The table sits between two marker lines so the prose around it is kept:
``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``.
Usage: ``python bench/table.py [results.json]`` (default: the newest h200-*.json).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def _ms(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, dict):
        return "-"
    return f"{v['median_ms']:.3f} ({v['p10_ms']:.3f}-{v['p90_ms']:.3f})"


def _x(row: dict, key: str) -> str:
    v = row.get(key)
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def geomean(values: list[float]) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def render(results: dict) -> str:
    v = results["versions"]
    lines = [f"Run {results['date']} on {v['gpu']}: torch {v['torch']} (CUDA {v['cuda']}), quack "
             f"{v['quack-kernels']}, cutlass-dsl {v['nvidia-cutlass-dsl']}, liger {v['liger-kernel']}, "
             f"catalogue {v['catalogue']}. {results['method']}, {results['reps']} reps. "
             "Times in ms: median (p10-p90). Ratios: fused/GEMM (target <= 1.05), speedups "
             "= baseline time / fused time.", "",
             "| task | shapes | fused | plain GEMMs (cuBLAS) | quack GEMM | eager | compile | liger "
             "| fused/GEMM | vs compile | vs eager | vs liger | TFLOP/s | configs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | {r['shape_set']} | error: {r['error'][:80]} |" + " |" * 11)
            continue
        cfgs = "; ".join(sorted(set(r.get("configs", []))))
        lines.append(
            f"| {r['task']} | {r['shape_set']} | {_ms(r, 'fused')} | {_ms(r, 'gemm_cublas')} | "
            f"{_ms(r, 'gemm_quack')} | {_ms(r, 'eager')} | {_ms(r, 'compile')} | {_ms(r, 'liger')} | "
            f"{_x(r, 'fused_over_gemm')} | {_x(r, 'speedup_vs_compile')} | {_x(r, 'speedup_vs_eager')} | "
            f"{_x(r, 'speedup_vs_liger')} | {_x(r, 'tflops')} | {cfgs} |")
    ok = [r for r in results["rows"] if "error" not in r]
    lines += ["", f"Geomean over {len(ok)} rows: fused/GEMM "
              f"{geomean([r['fused_over_gemm'] for r in ok]):.3f}, speedup vs torch.compile "
              f"{geomean([r.get('speedup_vs_compile', 0) for r in ok]):.3f}, vs eager "
              f"{geomean([r['speedup_vs_eager'] for r in ok]):.3f}."]
    flagged = [r for r in ok if "flag" in r]
    for r in flagged:
        lines.append(f"- flagged: {r['task']} {r['shape_set']}: {r['flag']}")
    return "\n".join(lines)


def main() -> int:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "bench" / "results").glob("h200-*.json"))[-1:]
    if not paths:
        print("no results in bench/results/")
        return 1
    table = render(json.loads(paths[-1].read_text()))
    doc = ROOT / "BENCHMARKS.md"
    text = doc.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{START}\n{table}\n{END}{tail}")
    print(f"updated {doc} from {paths[-1].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
