"""A suite's expert programs against the speed of light, on the H200.

For every task of a suite (``--suite``: ``llama3``, the default, ``gpt2`` or
a folder of task YAMLs) and every benchmark shape set it has (LLaMA-3
1B / 8B / 70B, or GPT-2 small / XL / a 7B-class width, all at 16384 tokens,
by default), time with device events, L2
flushed before every rep, medians over ``--reps`` runs on freshly drawn
inputs (never zeros), with spread (p10/p90).  The contenders are timed
interleaved, one rep of each per round, and the GPU's SM clock, power and
temperature are sampled alongside (``bench/clocks.py``), so a row's ratios
compare runs at the same clock and the record says which clock that was:

- the fused program (forward; forward+backward where the task has gradients),
  with the tile configuration tuned once per (program, shape) and cached;
- the plain GEMMs the math needs (``spec.gemms``), through cuBLAS (torch) and
  through quack's plain GEMM: the speed of light for a fused epilogue;
- the PyTorch reference, eager and under ``torch.compile`` (default mode);
- Liger, where it has the op (``bench/liger_baselines.py``).

Writes ``bench/results/<gpu>-<date>-<suite>.json`` (``h200``, ``h100``: :func:`gpu_tag`); with
``--update-benchmarks`` it also regenerates the table in BENCHMARKS.md from that file (``bench/table.py``
renders several runs side by side).  Usage on the device::

    source scripts/gpu-env.sh && python3 bench/run.py --sets llama3-1b,llama3-8b
    source scripts/gpu-env.sh && python3 bench/run.py --suite gpt2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import random
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from coda_agent.primitives import CATALOGUE_VERSION, gemm, launch_ledger, load_program, lowering, tuning
from coda_agent.kernels.contract import run
from coda_agent.primitives.timing import enqueue_ms, measure_each, measure_steady
from coda_agent.storage import write_atomic
from coda_agent.tasks import SUITE_DIR, load_suite
from coda_agent.verifier.inputs import make_grads, make_inputs
from coda_agent.verifier.timing import reference_call
from coda_agent.versions import ENVIRONMENT, environment

ROOT = Path(__file__).resolve().parent.parent


def stats(fns: dict[str, Callable[[], Any]], reps: int, device: str = "cuda", warmup: int = 3) -> dict[str, dict]:
    """Median/p10/p90 ms of each contender and the host ms to enqueue one call,
    from ``measure_each`` (flushed, interleaved: clock drift lands on all
    alike).  On CPU (``--dry-run``) the times are the host's: they check that
    the benchmark runs, not how fast anything is."""
    out = {}
    for name, (times, host) in measure_each(fns, reps, warmup=warmup, device=device).items():
        q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
        out[name] = {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "host_ms": host, "reps": reps}
    return out


def steady_stats(fns: dict[str, Callable[[], Any]], seconds: float, sampler: Any = None,
                 passes: int = 2, device: str = "cuda") -> dict[str, dict]:
    """Each contender back to back for ``seconds`` (``measure_steady``: the
    regime of a training step, where a kernel's own power draw sets its clock),
    one contender after another, the second pass in the reverse order of the
    first so that a drift over the row shows as a gap between passes.  Per
    contender: the mean ms per call over the passes (``median_ms``, so tables
    read it like the flushed regime's), the passes' range (``p10_ms``/``p90_ms``),
    the host's enqueue time, and the clock it ran at."""
    names = list(fns)
    order = random.Random(0).sample(names, len(names))
    runs: dict[str, list] = {name: [] for name in names}
    for p in range(passes):
        for name in order if p % 2 == 0 else order[::-1]:
            runs[name].append(measure_steady(fns[name], seconds, device=device))
    out = {}
    for name in names:
        ms = [r.ms for r in runs[name]]
        mean = sum(ms) / len(ms)
        host = enqueue_ms(fns[name]) if device == "cuda" else mean  # on CPU all of it is the host's
        out[name] = {"median_ms": mean, "p10_ms": min(ms), "p90_ms": max(ms), "passes_ms": ms,
                     "host_ms": host, "reps": sum(r.calls for r in runs[name])}
        if sampler is not None and (clock := sampler.summary_over([r.wall for r in runs[name]])):
            out[name]["clock"] = clock
    return out


def peak_mem_gib(fn: Callable[[], Any], device: str = "cuda") -> float | None:
    """Peak memory (GiB) allocated during fn() beyond what was live before it."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def outputs_gib(outputs: dict) -> float:
    """GiB held by a call's result tensors: what its peak must hold anyway."""
    return sum(t.nbytes for t in outputs.values() if isinstance(t, torch.Tensor)) / 2**30


def bench_task(task: Any, shape_set: str, reps: int, tune: bool, device: str = "cuda",
               sampler: Any = None, steady_s: float | None = None) -> dict:
    spec = task.spec
    prog = load_program(task.expert_path.read_text(), task.name)
    low = "cute" if device == "cuda" else "reference"
    inputs = make_inputs(spec, shape_set, seed=int(time.time()) & 0xFFFF, device=device)
    params = spec.params_at(shape_set)
    grads = make_grads(spec, shape_set, seed=7, device=device) if spec.has_backward else {}
    row: dict[str, Any] = {"task": spec.name, "shape_set": shape_set, "shapes": spec.shapes[shape_set],
                           "gflop": spec.flops(shape_set) / 1e9}

    def fused() -> Any:
        with lowering(low):
            return run(prog, inputs, params, grads if spec.has_backward else None, spec.outputs, spec.gradients)

    if tune and device == "cuda":
        with tuning.autotune() as tuned:  # every untuned GEMM call: tune once, cache on disk
            fused()
        row["tuned"] = tuned
    with launch_ledger() as ledger:
        outputs = fused()
    row["fused_output_gib"] = outputs_gib(outputs)  # what the task must hold: the memory floor
    del outputs
    row["configs"] = [f"{l.name}: {l.config}" for l in ledger if l.kind == "gemm"]

    # Speed of light: the plain GEMMs the math needs.
    mats = [(torch.randn(m, k, device=device, dtype=torch.bfloat16),
             torch.randn(k, n, device=device, dtype=torch.bfloat16)) for m, n, k in spec.gemm_shapes(shape_set)]

    def quack_gemms() -> Any:
        with lowering(low):
            return [gemm(a, b) for a, b in mats]

    ref = task.reference_fn

    def torch_run(fn: Callable) -> Callable[[], Any]:
        return reference_call(fn, spec, inputs, grads if spec.has_backward else None, params)

    contenders: dict[str, Callable[[], Any]] = {
        "fused": fused, "gemm_cublas": lambda: [a @ b for a, b in mats], "gemm_quack": quack_gemms,
        "eager": torch_run(ref)}
    if device == "cuda":  # a dry run checks the plumbing; torch.compile and Liger need the GPU
        try:
            # Static shapes, as a single-shape training run gets: without dynamic=False the
            # second shape set in one process recompiles the reference with dynamic shapes,
            # whose kernels run up to 1.4x slower on the H200 (swiglu_bwd at 8B: 5.23 vs
            # 3.77 ms, bench/results/h200-2026-11-29-d).
            contenders["compile"] = torch_run(torch.compile(ref, dynamic=False))
            contenders["compile"]()
        except Exception as e:  # noqa: BLE001 - record, keep benchmarking
            contenders.pop("compile", None)
            row["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            from liger_baselines import LIGER  # type: ignore[import-not-found]

            if spec.name in LIGER:
                fn, dims = LIGER[spec.name], spec.shapes[shape_set]
                contenders["liger"] = lambda: fn(inputs, params, grads, dims)
                contenders["liger"]()
        except Exception as e:  # noqa: BLE001
            contenders.pop("liger", None)
            row["liger_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    t0 = time.time()
    if steady_s is not None:
        row.update(steady_stats(contenders, steady_s, sampler, device=device))
        if "clock" in row["fused"]:
            row["clock"] = row["fused"]["clock"]  # each contender ran at its own clock; show the program's
        # A contender whose host enqueues slower than its GPU runs leaves the GPU idle
        # between calls: its steady time is the host's, not the kernels'.
        row["host_bound"] = [n for n in contenders if row[n]["host_ms"] >= 0.9 * row[n]["median_ms"]]
    else:
        row.update(stats(contenders, reps, device))
        if sampler is not None and (clock := sampler.summary(t0, time.time())):
            row["clock"] = clock  # what the GPU ran at while this row was timed
    for name in ("fused", "eager", "compile", "liger"):
        if name in contenders:
            row[f"{name}_peak_gib"] = peak_mem_gib(contenders[name], device)
    return _ratios(spec, shape_set, row)


def _ratios(spec: Any, shape_set: str, row: dict) -> dict:
    f, g = row["fused"]["median_ms"], min(row["gemm_cublas"]["median_ms"], row["gemm_quack"]["median_ms"])
    row["fused_over_gemm"] = f / g
    row["tflops"] = spec.flops(shape_set) / (f * 1e-3) / 1e12
    if "compile" in row:
        row["speedup_vs_compile"] = row["compile"]["median_ms"] / f
    row["speedup_vs_eager"] = row["eager"]["median_ms"] / f
    if "liger" in row:
        row["speedup_vs_liger"] = row["liger"]["median_ms"] / f
    if row["fused_over_gemm"] < 0.9:
        row["flag"] = "faster than the plain GEMMs by >10%: suspicious, check the work done"
    return row


def versions(extra: tuple[str, ...] = ()) -> dict:
    """What a benchmark ran on: libraries (and ``extra`` distributions), CUDA, the GPU, and the
    catalogue's version; every bench/ record names them so."""
    return {**environment((*ENVIRONMENT, *extra)), "catalogue": CATALOGUE_VERSION}


def gpu_tag(name: str) -> str:
    """The results file's prefix for a GPU: its model number ("NVIDIA H100 80GB HBM3" -> "h100")."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", name)
    return m.group(1).lower() if m else "gpu"


def main() -> int:
    from coda_agent.tasks import BENCH_SETS, TaskSpecError, load_suite, suite_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="llama3",
                    help=f"a packaged suite ({', '.join(BENCH_SETS)}) or a folder of task YAMLs")
    ap.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    ap.add_argument("--sets", default=None,
                    help="comma-separated shape sets (default for a packaged suite: "
                         + "; ".join(f"{k}: {','.join(v)}" for k, v in BENCH_SETS.items()) + ")")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--steady", type=float, default=None, metavar="SECONDS",
                    help="time each contender back to back for SECONDS (after a settling half "
                         "second, two passes) instead of one flushed call at a time: a training "
                         "step's regime, where each kernel runs at the clock its own power draw allows")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU with the reference lowering and wall-clock times: checks the "
                         "benchmark's plumbing (CI runs it on the small shape set), measures nothing")
    ap.add_argument("--update-benchmarks", action="store_true",
                    help="regenerate BENCHMARKS.md's table from this run when it ends")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    sys.path.insert(0, str(Path(__file__).parent))
    sets = args.sets or ",".join(BENCH_SETS.get(args.suite, ()))
    if not sets:
        ap.error(f"--sets: {args.suite} is not a packaged suite, so name its shape sets")
    try:
        tasks = load_suite(suite_dir(args.suite))
    except TaskSpecError as e:
        ap.error(f"--suite: {e}")
    wanted = set(filter(None, args.tasks.split(",")))
    unknown = wanted - {t.name for t in tasks}
    if unknown:
        ap.error(f"--tasks: {sorted(unknown)} are not in suite {args.suite} ({', '.join(t.name for t in tasks)})")
    suite = [t for t in tasks if not wanted or t.name in wanted]
    suite_name = Path(args.suite).name
    results = {"date": dt.date.today().isoformat(), "suite": suite_name, "versions": versions(), "reps": args.reps,
               "method": "torch.cuda.Event, 256 MiB L2 flush before each rep, contenders interleaved "
                         "(one rep of each per round, random order), median (p10/p90)",
               "rows": []}
    if args.steady is not None:
        results.update(regime="steady", steady_s=args.steady,
                       method=f"torch.cuda.Event, each contender back to back for {args.steady:g} s after "
                              "0.5 s settling, no L2 flush, two passes in opposite orders")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-steady" if args.steady is not None else ""
    tag = gpu_tag(results["versions"].get("gpu", "")) if device == "cuda" else "dryrun"
    path = out_dir / f"{tag}-{results['date']}-{suite_name}{suffix}.json"
    from clocks import ClockSampler  # bench/clocks.py, on the path above

    with ClockSampler() if device == "cuda" else contextlib.nullcontext() as sampler:
        for task, shape_set in ((t, s) for t in suite for s in sets.split(",") if s in t.spec.shapes):
            t0 = time.time()
            try:
                row = bench_task(task, shape_set, args.reps, tune=not args.no_tune, device=device,
                                 sampler=sampler, steady_s=args.steady)
            except Exception as e:  # noqa: BLE001 - one task's failure is a row, not a crash
                traceback.print_exc(limit=4)
                row = {"task": task.name, "shape_set": shape_set, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            row["bench_s"] = round(time.time() - t0, 1)
            results["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("task", "shape_set", "fused_over_gemm",
                                                      "speedup_vs_compile", "error")}), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            write_atomic(path, json.dumps(results, indent=1))
    if sampler is not None and sampler.error:
        results["clock_error"] = sampler.error  # rows without "clock": the sampler stopped here
        write_atomic(path, json.dumps(results, indent=1))
    print(f"wrote {path}")
    if args.update_benchmarks:
        import table  # bench/table.py, on the path above

        table.update([f"{path}={results['versions']['gpu']}, {suite_name} {sets}, "
                      f"{'untuned' if args.no_tune else 'tuned'}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
