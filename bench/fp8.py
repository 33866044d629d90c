"""FP8 anchors side by side: the fp8 CODA blocks against torchao's float8
training under torch.compile, the bf16 CODA programs and the plain GEMMs.

For mlp_block and llama3_block (forward + backward, LLaMA-3 8B shapes by
default), on the same inputs and output gradients, timed interleaved with the
L2 flushed (``bench/run.py: stats``):

- ``coda_fp8``: the fp8 expert (tasks/llama3_fp8), quack's SM90 fp8 mainloop;
- ``coda_bf16``: the bf16 expert (tasks/llama3);
- ``torchao_rowwise`` / ``torchao_tensorwise``: the block's PyTorch module with
  every projection converted by ``torchao.float8.convert_to_float8_training``
  (``Float8LinearConfig.from_recipe_name``), under ``torch.compile``;
- ``compile_bf16``: ``torch.compile`` of the bf16 reference;
- ``gemm_fp8_fast`` / ``gemm_fp8``: the task's plain GEMMs in fp8 through the
  catalogue's ``gemm`` (fast accumulation / promoted), the speed of light of
  an fp8 block; ``gemm_scaled_mm``: the same through ``torch._scaled_mm``
  (rowwise scales, fast accumulation); ``gemm_bf16``: cuBLAS bf16.

``--profile`` adds each block's fp8 program under torch.profiler: the kernels
that cost most, device ms per catalogue launch, the whole call's kernel time
beside its span on the device, and the longest idle gaps.  ``--tune`` tunes the
CODA programs' GEMMs on their shapes first (``coda_fp8_tuned``: each tuned
call's winner and candidates' times; the runs after read the tuning cache).
``--compare DIR`` adds ``coda_fp8_compare``, the fp8 program ``DIR/<block>_fp8.py``
(another version of the expert, e.g. the one before a change: timed interleaved with
it on the same machine, profiled too with ``--profile``).
``--casts`` adds the casts alone, at the gradients' shapes of an 8B layer:
``quantize_rows`` along each axis alone and along both (two calls),
``quantize_both`` (one call, two reads) and a copy of the bf16 tensor (the
memory's pace); on CUDA also the amax pass alone at 18 strip geometries.

Each contender's peak memory beyond what is live before its call (inputs,
weights) is recorded beside its time (``peak_gib``).  The issue's targets are
printed per row: ``coda_fp8`` at least 1.2x ``torchao_rowwise`` and within
1.05x of the fp8 plain GEMMs.  Writes ``OUT/fp8-anchors.json`` after every
row; stops starting rows after ``--budget-s``.  Usage on the device (about 4
minutes: torch.compile of four torchao modules dominates)::

    python3 bench/fp8.py OUT --sets llama3-8b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from run import peak_mem_gib, stats, versions  # noqa: E402  (bench/run.py)
from step_profile import _inside_coda, device_kernels  # noqa: E402  (bench/step_profile.py)

from coda_agent.tasks import SUITE_DIR, load_task  # noqa: E402
from coda_agent.storage import write_atomic  # noqa: E402

FP8_SUITE = SUITE_DIR.parent / "llama3_fp8"
BLOCKS = ("mlp_block", "llama3_block")


def _rms_norm(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * gamma


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight = nn.Parameter(w.detach().clone())
    return lin


class MLPBlock(nn.Module):
    """mlp_block's reference as a module whose projections torchao can convert."""

    def __init__(self, inputs: dict[str, torch.Tensor], eps: float):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(inputs["gamma"].detach().clone())
        self.gate_up, self.down = _linear(inputs["w_gu"]), _linear(inputs["w_down"])

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        gu = self.gate_up(_rms_norm(h, self.gamma, self.eps))
        return {"y": h + self.down(F.silu(gu[:, 0::2]) * gu[:, 1::2])}


class Llama3Block(nn.Module):
    """llama3_block's reference as a module (out-proj, MLP, the next QKV)."""

    def __init__(self, inputs: dict[str, torch.Tensor], eps: float):
        super().__init__()
        self.eps = eps
        self.gamma_mlp = nn.Parameter(inputs["gamma_mlp"].detach().clone())
        self.gamma_attn = nn.Parameter(inputs["gamma_attn"].detach().clone())
        self.o, self.gate_up = _linear(inputs["w_o"]), _linear(inputs["w_gu"])
        self.down, self.qkv = _linear(inputs["w_down"]), _linear(inputs["w_qkv"])

    def forward(self, attn: torch.Tensor, h: torch.Tensor) -> dict[str, torch.Tensor]:
        h1 = h + self.o(attn)
        gu = self.gate_up(_rms_norm(h1, self.gamma_mlp, self.eps))
        h2 = h1 + self.down(F.silu(gu[:, 0::2]) * gu[:, 1::2])
        return {"h_out": h2, "qkv": self.qkv(_rms_norm(h2, self.gamma_attn, self.eps))}


MODULES = {"mlp_block": (MLPBlock, ("h",)), "llama3_block": (Llama3Block, ("attn", "h"))}


def _program(task: Any, inputs: dict, grads: dict, lowering_name: str, source: str | None = None
             ) -> Callable[[], Any]:
    """The task's expert (or the program ``source``) as one forward + backward call."""
    from coda_agent.kernels.contract import run
    from coda_agent.primitives import load_program, lowering

    prog = load_program(source if source is not None else task.expert_path.read_text(), task.name)
    params = dict(task.spec.params)

    def fused() -> Any:
        with lowering(lowering_name):
            return run(prog, inputs, params, grads, task.spec.outputs, task.spec.gradients)
    return fused


def _torch_block(name: str, inputs: dict, grads: dict, eps: float, recipe: str | None,
                 compiled: bool) -> Callable[[], Any]:
    cls, acts = MODULES[name]
    module = cls(inputs, eps)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
    fwd = torch.compile(module) if compiled else module
    xs = [inputs[a].detach().clone().requires_grad_(True) for a in acts]

    def run() -> Any:
        out = fwd(*xs)
        torch.autograd.backward([out[k] for k in sorted(out)], [grads[f"d{k}"] for k in sorted(out)])
        return out
    return run


def _plain_gemms(shapes: list[tuple[int, int, int]], device: str) -> dict[str, Callable[[], Any]]:
    from coda_agent.primitives import gemm, lowering, quantize_rows

    low = "cute" if device == "cuda" else "reference"
    bf16 = [(torch.randn(m, k, device=device, dtype=torch.bfloat16),
             torch.randn(n, k, device=device, dtype=torch.bfloat16)) for m, n, k in shapes]
    fp8 = [(quantize_rows(a), quantize_rows(b)) for a, b in bf16]

    def catalogue(fast: bool) -> Callable[[], Any]:
        def run() -> Any:
            with lowering(low):
                return [gemm(a["q"], b["q"].t(), fast_accum=fast) for a, b in fp8]
        return run

    def scaled_mm() -> Any:
        return [torch._scaled_mm(a["q"], b["q"].t(), scale_a=a["scale"][:, None], scale_b=b["scale"][None, :],
                                 out_dtype=torch.bfloat16, use_fast_accum=True) for a, b in fp8]

    return {"gemm_fp8_fast": catalogue(True), "gemm_fp8": catalogue(False), "gemm_scaled_mm": scaled_mm,
            "gemm_bf16": lambda: [a @ b.t() for a, b in bf16]}


def launch_split(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler: the kernel ms inside each ``coda::`` launch,
    summed by launch name (largest first), and the call's kernel ms in all.

    On CUDA a kernel belongs to the launch whose range holds its start on the device
    timeline (a record_function range shows there as a user annotation; the ranges'
    ``device_time_total`` misses the DSL's and Triton's launches: H200 run 14 read 0 for
    most).  That span is drawn from the kernels the profiler correlates with the range,
    which the DSL's and Triton's driver-API launches are not, so it can swallow the
    kernels of later launches (run 15: the GEMMs under ``quantize_rows``): read the
    launches as a sketch and ``top_kernels`` (by kernel name, where each GEMM carries its
    epilogue's name) as the split.  On the CPU (a dry run) the ranges' own CPU time
    stands in."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    kernels = device_kernels(events)
    by_name: dict[str, list[float]] = {}
    if device == "cuda":
        spans = sorted({(e.name, e.time_range.start, e.time_range.end) for e in events
                        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("coda::")},
                       key=lambda s: s[2] - s[1])  # innermost first
        for k in kernels:
            owner = next((name for name, a, b in spans if a <= k.time_range.start <= b), "outside any launch")
            by_name.setdefault(owner, []).append(k.time_range.elapsed_us() / 1e3)
    else:
        for e in events:
            if e.name.startswith("coda::") and not _inside_coda(e):
                by_name.setdefault(e.name, []).append(e.cpu_time_total / 1e3)
    launches = {k: {"ms": round(sum(v), 4), "kernels": len(v)} for k, v in
                sorted(by_name.items(), key=lambda kv: -sum(kv[1]))}
    out: dict[str, Any] = {"kernels_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3, 4),
                           "launches": launches}
    if kernels:  # the device's span from first kernel start to last end: past kernels_ms, the GPU idled
        out["span_ms"] = round((max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)) / 1e3, 4)
        per_kernel: dict[str, list[float]] = {}
        for k in kernels:
            per_kernel.setdefault(k.name[:120], []).append(k.time_range.elapsed_us() / 1e3)
        out["top_kernels"] = [{"name": n, "ms": round(sum(v), 4), "count": len(v)} for n, v in
                              sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]]
        ordered = sorted(kernels, key=lambda k: k.time_range.start)
        gaps = [((b.time_range.start - a.time_range.end) / 1e3, a.name[:60], b.name[:60])
                for a, b in zip(ordered, ordered[1:]) if b.time_range.start > a.time_range.end]
        out["idle_gaps"] = [{"ms": round(ms, 4), "after": a, "before": b} for ms, a, b in sorted(gaps, reverse=True)[:10]]
    return out


def bench_casts(reps: int, device: str) -> list[dict]:
    """The cast kernels alone: ms and the GB/s of one read of x and its fp8 writes."""
    from coda_agent.primitives import quantize_both, quantize_rows

    shapes = ((16384, 4096), (16384, 14336), (16384, 28672)) if device == "cuda" else ((256, 384),)
    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16) * 3
        fns = {"rows": lambda: quantize_rows(x), "cols": lambda: quantize_rows(x.t()),
               "rows_and_cols": lambda: (quantize_rows(x), quantize_rows(x.t())), "both": lambda: quantize_both(x),
               "copy": lambda: x.clone()}
        row: dict[str, Any] = {"shape": [m, n], **stats(fns, reps, device, warmup=3 if device == "cuda" else 0)}
        gb = {"rows": 3, "cols": 3, "rows_and_cols": 4, "both": 4, "copy": 4}  # bytes per element, least traffic
        for k, per in gb.items():
            row[k]["gb_per_s"] = per * m * n / (row[k]["median_ms"] * 1e6)
        row["both_speedup_vs_rows_and_cols"] = row["rows_and_cols"]["median_ms"] / row["both"]["median_ms"]
        if device == "cuda":
            row["amax_geometry"] = amax_geometries(x, reps, device)
        rows.append(row)
        print(json.dumps({"shape": [m, n], **{k: round(row[k]["median_ms"], 4) for k in fns}}), flush=True)
        del x
    return rows


def amax_geometries(x: torch.Tensor, reps: int, device: str = "cuda") -> list[dict]:
    """quantize_both's amax pass alone (both directions) at each strip geometry, fastest first:
    ms and the read's GB/s (one bf16 read of x), the shipped geometry marked.  Beside them, at the
    shipped geometry, the pass for one direction alone (``rows only``, ``cols only``: which fold
    costs), and ``x.amax()``, a plain read reduction (what a read of x costs on this GPU)."""
    from coda_agent.primitives import quantize_triton as qt

    ramax, camax = torch.zeros(x.shape[0], device=x.device), torch.zeros(x.shape[1], device=x.device)
    grid = [(step, width, programs, warps) for step in (4096, 8192, 16384) for width in (128, 512, 2048)
            for programs in (528, 1024, 2048) for warps in (4, 8) if width <= step]
    fns = {f"step{s} width{c} programs{p} warps{w}": (lambda s=s, c=c, p=p, w=w: qt._amaxes(
        x, ramax, camax, step=s, width=c, programs=p, warps=w)) for s, c, p, w in grid}
    fns["rows only"] = lambda: qt._amaxes(x, ramax, None)
    fns["cols only"] = lambda: qt._amaxes(x, None, camax)
    fns["x.amax()"] = lambda: x.amax()
    res = stats(fns, reps, device, warmup=2 if device == "cuda" else 0)
    shipped = f"step{qt.AMAX_STEP} width{qt.AMAX_WIDTH} programs{qt.AMAX_PROGRAMS} warps{qt.AMAX_WARPS}"
    out = [{"geometry": k, "median_ms": res[k]["median_ms"], "gb_per_s": 2 * x.numel() / (res[k]["median_ms"] * 1e6),
            "shipped": k == shipped} for k in fns]
    return sorted(out, key=lambda r: r["median_ms"])


def bench_block(name: str, shape_set: str, reps: int, device: str, profile: bool = False,
                tune: bool = False, compare: Path | None = None) -> dict:
    from coda_agent.primitives.tuning import autotune
    from coda_agent.verifier.inputs import make_grads, make_inputs

    bf16_task, fp8_task = load_task(SUITE_DIR / f"{name}.yaml"), load_task(FP8_SUITE / f"{name}_fp8.yaml")
    spec = bf16_task.spec
    inputs = make_inputs(spec, shape_set, seed=int(time.time()) & 0xFFFF, device=device)
    grads = make_grads(spec, shape_set, seed=7, device=device)
    fp8_inputs = dict(inputs)
    for extra, t in fp8_task.spec.inputs.items():  # the delayed scales of llama3_block_fp8
        if extra not in fp8_inputs:
            fp8_inputs[extra] = torch.ones(fp8_task.spec.shape_of(t, shape_set), device=device)
    eps = spec.params["eps"]
    compiled = device == "cuda"  # the dry run checks the plumbing; Inductor needs the GPU here
    low = "cute" if device == "cuda" else "reference"
    contenders: dict[str, Callable[[], Any]] = {
        "coda_fp8": _program(fp8_task, fp8_inputs, grads, low),
        "coda_bf16": _program(bf16_task, inputs, grads, low),
        "compile_bf16": _torch_block(name, inputs, grads, eps, None, compiled),
        **_plain_gemms(spec.gemm_shapes(shape_set), device)}
    row: dict[str, Any] = {"block": name, "shape_set": shape_set, "shapes": spec.shapes[shape_set],
                           "compiled": compiled}
    other = compare / f"{name}_fp8.py" if compare is not None else None
    if other is not None and other.exists():
        contenders["coda_fp8_compare"] = _program(fp8_task, fp8_inputs, grads, low, other.read_text())
        row["compare_program"] = str(other)
    for recipe in ("rowwise", "tensorwise"):
        try:
            contenders[f"torchao_{recipe}"] = _torch_block(name, inputs, grads, eps, recipe, compiled)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded
            row[f"torchao_{recipe}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for key in list(contenders):  # warm up: compile here, so a failure is the contender's
        try:
            if tune and key.startswith("coda_"):  # each untuned GEMM of the program tuned on its shapes
                with autotune() as record:
                    contenders[key]()
                row[f"{key}_tuned"] = record
            else:
                contenders[key]()
        except Exception as e:  # noqa: BLE001
            contenders.pop(key)
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # The loop above ran every contender once; on the CPU (a dry run) that is warm-up enough, and
    # each further call of torchao's modules costs seconds there (torch._scaled_mm on the CPU).
    row.update(stats(contenders, reps, device, warmup=3 if device == "cuda" else 0))
    for key, fn in contenders.items():  # beyond what is live before the call (inputs, weights); None on CPU
        row[key]["peak_gib"] = peak_mem_gib(fn, device)
    ms = {k: row[k]["median_ms"] for k in contenders}
    if "coda_fp8" in ms:
        floor = min(ms.get("gemm_fp8_fast", float("inf")), ms.get("gemm_scaled_mm", float("inf")))
        row["coda_fp8_over_fp8_gemms"] = ms["coda_fp8"] / floor
        for other in ("torchao_rowwise", "torchao_tensorwise", "compile_bf16", "coda_bf16"):
            if other in ms:
                row[f"coda_fp8_speedup_vs_{other}"] = ms[other] / ms["coda_fp8"]
        row["targets_met"] = {"vs_torchao_rowwise >= 1.2": row.get("coda_fp8_speedup_vs_torchao_rowwise", 0) >= 1.2,
                              "vs_fp8_gemms <= 1.05": row["coda_fp8_over_fp8_gemms"] <= 1.05}
        if "coda_fp8_compare" in ms:
            row["coda_fp8_speedup_vs_compare"] = ms["coda_fp8_compare"] / ms["coda_fp8"]
        if profile:
            for key in ("coda_fp8", "coda_fp8_compare"):
                if key in contenders:
                    row[f"{key}_profile"] = launch_split(contenders[key], device)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--blocks", default=",".join(BLOCKS))
    ap.add_argument("--sets", default="llama3-8b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=420, help="start no row after this long")
    ap.add_argument("--casts", action="store_true", help="time the cast kernels alone first")
    ap.add_argument("--profile", action="store_true", help="the fp8 program's device ms per catalogue launch")
    ap.add_argument("--tune", action="store_true",
                    help="tune the CODA programs' GEMMs on their shapes first (minutes of compiles on a cold cache)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="a folder of other versions of the fp8 programs (<block>_fp8.py), timed beside them")
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU, reference lowering, eager torch: checks the plumbing, measures nothing")
    args = ap.parse_args()
    if args.compare is not None:
        wanted = [args.compare / f"{name}_fp8.py" for name in args.blocks.split(",")]
        if not any(p.is_file() for p in wanted):
            ap.error(f"--compare {args.compare}: none of {', '.join(p.name for p in wanted)} is there; give the "
                     "folder that holds the other versions of the programs")
    device = "cpu" if args.dry_run else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{'fp8-anchors' if device == 'cuda' else 'fp8-anchors-dryrun'}.json"
    results: dict[str, Any] = {"versions": versions(("torchao",)), "reps": args.reps, "rows": []}
    t0 = time.time()
    if args.casts:
        results["casts"] = bench_casts(args.reps, device)
        write_atomic(path, json.dumps(results, indent=1))
    for name in args.blocks.split(","):
        for shape_set in args.sets.split(","):
            if time.time() - t0 > args.budget_s:
                results["rows"].append({"block": name, "shape_set": shape_set, "skipped": "time budget"})
                continue
            start = time.time()
            try:
                row = bench_block(name, shape_set, args.reps, device, args.profile, args.tune, args.compare)
            except Exception as e:  # noqa: BLE001 - one block's failure is a row
                traceback.print_exc(limit=4)
                row = {"block": name, "shape_set": shape_set, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            row["bench_s"] = round(time.time() - start, 1)
            results["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("block", "shape_set", "coda_fp8_over_fp8_gemms",
                                                      "coda_fp8_speedup_vs_torchao_rowwise",
                                                      "coda_fp8_speedup_vs_compare", "error")}),
                  flush=True)
            write_atomic(path, json.dumps(results, indent=1))
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
