"""Regenerate the benchmark table in BENCHMARKS.md from bench/results/*.json.

The table sits between two marker lines so the prose around it is kept:
``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``.
Usage: ``python bench/table.py [results.json[=title] ...]`` (default: the newest
bench/results/h200-*.json); each file becomes a section with the issue's targets
checked under it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from coda_agent.storage import write_atomic

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


BACKWARD = ("swiglu_bwd", "rmsnorm_bwd", "rope_bwd", "layernorm_bwd", "gelu_bwd")  # backward math, one direction
BLOCKS = ("mlp_block", "llama3_block", "gpt2_block")  # forward + backward of a whole block
# forward-only tasks whose outputs are a training step's gradients (the fused LM heads)
TRAINING_STEPS = ("lm_head_xent", "lm_head_xent_frozen", "lm_head_xent_softcap", "lm_head_xent_softcap_frozen")


def _kind(task: str) -> str:
    return ("block" if task in BLOCKS else "backward"
            if task in BACKWARD or task in TRAINING_STEPS else "forward")


def _gib(row: dict, key: str) -> str:
    v = row.get(key)
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def render(results: dict, title: str = "") -> str:
    v = results["versions"]
    steady = results.get("regime") == "steady"
    lines = ([f"#### {title}", ""] if title else []) + [
        f"Run {results['date']} on {v['gpu']}: torch {v['torch']} (CUDA {v['cuda']}), quack "
        f"{v['quack-kernels']}, cutlass-dsl {v['nvidia-cutlass-dsl']}, liger {v['liger-kernel']}, "
        f"catalogue {v['catalogue']}. {results['method']}"
        + ("; the SM clock is the fused program's. Times in ms per call: mean (range of the passes)"
           if steady else f", {results['reps']} reps. Times in ms: median (p10-p90)")
        + "; host = ms the host needs to enqueue one fused call "
        "(not part of the device time). Ratios: fused/GEMM (target <= 1.05), speedups = "
        "baseline time / fused time. Peak: GiB allocated beyond what was live before the call.", "",
        "| task | kind | shapes | fused | host | plain GEMMs (cuBLAS) | quack GEMM | eager | compile | liger "
        "| fused/GEMM | vs compile | vs eager | vs liger | TFLOP/s | SM MHz | peak fused / compile / liger "
        "| configs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['task']} | | {r['shape_set']} | error: {r['error'][:80]} |" + " |" * 14)
            continue
        cfgs = "; ".join(sorted(set(r.get("configs", []))))
        host = r["fused"].get("host_ms")
        lines.append(
            f"| {r['task']} | {_kind(r['task'])} | {r['shape_set']} | {_ms(r, 'fused')} | "
            f"{f'{host:.2f}' if host is not None else '-'} | {_ms(r, 'gemm_cublas')} | "
            f"{_ms(r, 'gemm_quack')} | {_ms(r, 'eager')} | {_ms(r, 'compile')} | {_ms(r, 'liger')} | "
            f"{_x(r, 'fused_over_gemm')} | {_x(r, 'speedup_vs_compile')} | {_x(r, 'speedup_vs_eager')} | "
            f"{_x(r, 'speedup_vs_liger')} | {_x(r, 'tflops')} | {_clock(r)} | {_gib(r, 'fused_peak_gib')} / "
            f"{_gib(r, 'compile_peak_gib')} / {_gib(r, 'liger_peak_gib')} | {cfgs} |")
    ok = [r for r in results["rows"] if "error" not in r]
    lines += ["", *targets(ok), *clock_lines(ok)]
    for r in (r for r in ok if "flag" in r):
        lines.append(f"- flagged: {r['task']} {r['shape_set']}: {r['flag']}")
    for r in (r for r in ok if r.get("host_bound")):
        lines.append(f"- host-bound back to back (the GPU idles while the host enqueues, so these "
                     f"times are the host's): {r['task']} {r['shape_set']}: {', '.join(r['host_bound'])}")
    return "\n".join(lines)


def _clock(row: dict) -> str:
    """The SM clock while the row was timed: median (lowest)."""
    c = row.get("clock")
    return f"{c['sm_mhz_median']:.0f} ({c['sm_mhz_min']:.0f})" if c else "-"


def clock_lines(rows: list[dict]) -> list[str]:
    """One line on the clock the whole run ran at, and what held it down."""
    clocked = [r for r in rows if r.get("clock")]
    if not clocked:
        return []
    mhz = sorted(r["clock"]["sm_mhz_median"] for r in clocked)
    held: dict[str, int] = {}
    for r in clocked:
        for reason in r["clock"]["reasons"]:
            held[reason] = held.get(reason, 0) + 1
    why = "; ".join(f"{k} in {v} of {len(clocked)} rows" for k, v in sorted(held.items())) or "none reported"
    return [f"- SM clock while timed (median per row): {mhz[0]:.0f}-{mhz[-1]:.0f} MHz, rated "
            f"{clocked[0]['clock']['sm_mhz_max_rated']:.0f}; reasons the driver held it down: {why}"]


def _ceiling(rows: list[dict], kind: str) -> str:
    """What a kernel exactly at the plain GEMMs' speed would score against
    torch.compile: the speedup left to win by fusing at all."""
    # compile / GEMM = (compile / fused) * (fused / GEMM), against the same GEMM baseline.
    vals = [r["speedup_vs_compile"] * r["fused_over_gemm"]
            for r in rows if _kind(r["task"]) == kind and "speedup_vs_compile" in r]
    return f" (at plain-GEMM speed: {geomean(vals):.3f})" if vals else ""


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, met or missed, for the rows of one run."""
    def gm(key: str, kind: str | None = None) -> tuple[float, int]:
        vals = [r.get(key, 0) for r in rows if kind is None or _kind(r["task"]) == kind]
        return geomean(vals), len(vals)

    def line(text: str, value: float, n: int, ok: bool) -> str:
        return f"- {text}: **{value:.3f}** over {n} rows, {'met' if ok else 'missed'}"

    out = []
    v, n = gm("fused_over_gemm")
    out.append(line("geomean fused / plain GEMM (target <= 1.05)", v, n, v <= 1.05))
    for kind, goal in (("forward", 1.2), ("backward", 1.15), ("block", 1.15)):
        v, n = gm("speedup_vs_compile", kind)
        if n:
            out.append(line(f"geomean speedup over torch.compile, {kind} tasks (target >= {goal})",
                            v, n, v >= goal) + _ceiling(rows, kind))
    for r in rows:
        if r["task"] == "lm_head_xent" and r["shape_set"] == "llama3-1b":
            ms, peak = r["fused"]["median_ms"], r.get("fused_peak_gib")
            out.append(f"- LM head + cross-entropy forward+backward at 1B: **{ms:.1f} ms** (target <= 40, "
                       f"{'met' if ms <= 40 else 'missed'}), peak **{peak:.2f} GiB** beyond the inputs "
                       f"(target <= 1, {'met' if peak is not None and peak <= 1 else 'missed'})"
                       + (f"; of it, the outputs {r['fused_output_gib']:.2f} GiB" if "fused_output_gib" in r else ""))
    return out


def main() -> int:
    """``python bench/table.py [RESULTS.json[=TITLE] ...]``: one section per file."""
    args = sys.argv[1:] or [str(p) for p in sorted((ROOT / "bench" / "results").glob("h200-*.json"))[-1:]]
    if not args:
        print("no results in bench/results/")
        return 1
    update(args)
    return 0


def update(args: list[str], doc: Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace ``doc``'s table section with one section per ``FILE[=TITLE]``."""
    sections = []
    for arg in args:
        path, _, title = arg.partition("=")
        sections.append(render(json.loads(Path(path).read_text()), title))
    text = doc.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    body = "\n\n".join(sections)
    write_atomic(doc, f"{head}{START}\n{body}\n{END}{tail}")
    print(f"updated {doc} from {', '.join(a.partition('=')[0] for a in args)}")


if __name__ == "__main__":
    sys.exit(main())
