"""What a training step's plain GEMMs cost under sustained load: quack's tiles against cuBLAS.

The bf16 training step runs at the H200's 700 W power cap (runs 18 and 19), where a GEMM's time
follows its energy: the clock drops until the power fits.  CODA's GEMMs ran the 1B step at a 7%
lower clock than torch.compile's cuBLAS GEMMs and gave back the time fusion had saved.  This asks,
one GEMM shape of the step at a time, whether the cause is the mainloop's tiles: each contender
(cuBLAS through ``torch.mm``, and quack's plain GEMM at each tile of ``primitives.tuning``'s wide
pool) runs back to back for ``--seconds`` after the clock settles (``measure_steady``), with the
SM clock and power sampled meanwhile (``clocks.ClockSampler``).  Per contender: ms per call,
TFLOPS, median MHz and W, and the energy per call (W x ms) as TFLOP per joule.

The shapes are the 1B step's (``train_models.CONFIGS``: T = 16384 tokens, the LM head in chunks of
1024 rows) with the operand layouts the step gives them: forward ``x @ W^T`` (both operands
K-major), the input gradients ``dY @ W`` (B N-major) and the weight gradients ``dY^T @ X`` (A
M-major).  Fresh random inputs (never zeros), the same tensors for every contender of a shape.

    source scripts/gpu-env.sh && python3 bench/gemm_energy.py OUT.json [--shapes gate_up,down]

``--dry-run`` runs the plumbing on the CPU at shapes 64x smaller (the reference lowering; the
"tiles" all run the same torch.mm), which CI does; it measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from coda_agent.primitives import TileConfig, lowering
from coda_agent.primitives.timing import measure_steady
from coda_agent.primitives.tuning import POOLS
from coda_agent.storage import write_atomic

sys.path.insert(0, str(Path(__file__).parent))
from clocks import ClockSampler  # noqa: E402

T, H, I, QKV, V, CHUNK = 16384, 2048, 8192, 3072, 128256, 1024
# name: (M, N, K, A layout, B layout).  A is (M, K): "k" K-contiguous, "m" M-contiguous; B is
# (K, N): "k" K-contiguous (a weight's transpose), "n" N-contiguous.
SHAPES: dict[str, tuple[int, int, int, str, str]] = {
    "qkv": (T, QKV, H, "k", "k"),
    "gate_up": (T, 2 * I, H, "k", "k"),
    "down": (T, H, I, "k", "k"),
    "logits_chunk": (CHUNK, V, H, "k", "k"),
    "dx_gate_up": (T, H, 2 * I, "k", "n"),
    "dx_down": (T, I, H, "k", "n"),
    "dw_gate_up": (2 * I, H, T, "m", "n"),
    "dw_down": (H, I, T, "m", "n"),
    "dw_lm_chunk": (V, H, CHUNK, "m", "n"),
}


def operands(m: int, n: int, k: int, a_layout: str, b_layout: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, K) and B (K, N) in the given layouts, bf16, N(0, 1) / sqrt(K) scaled."""
    gen = torch.Generator(device=device).manual_seed(m * 31 + n * 7 + k)

    def draw(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=torch.bfloat16)

    A = draw(m, k) if a_layout == "k" else draw(k, m).t()
    B = draw(n, k).t() if b_layout == "k" else draw(k, n)
    return A, B / k ** 0.5


def contenders(A: torch.Tensor, B: torch.Tensor, pool: str, device: str) -> dict[str, Callable[[], Any]]:
    """cuBLAS and quack's plain GEMM at each tile of ``pool``, all writing one D."""
    from coda_agent.primitives import cute

    D = torch.empty(A.shape[0], B.shape[1], dtype=torch.bfloat16, device=device)
    fns: dict[str, Callable[[], Any]] = {"cublas": lambda: torch.mm(A, B, out=D)}
    for cfg in POOLS[pool]:
        if device == "cuda":
            fns[f"quack {cfg}"] = _quack(cute, A, B, D, cfg)
        else:  # the dry run: no tiles on a CPU
            fns[f"quack {cfg}"] = fns["cublas"]
    return fns


def _quack(cute: Any, A: torch.Tensor, B: torch.Tensor, D: torch.Tensor, cfg: TileConfig) -> Callable[[], Any]:
    return lambda: cute.run(None, A, B, {}, buffers={"D": D}, config=cfg, accumulate=False)


def measure_shape(name: str, scale: int, seconds: float, pool: str, device: str,
                  sampler: ClockSampler | None) -> list[dict[str, Any]]:
    m, n, k, la, lb = SHAPES[name]
    m, n, k = (max(64, d // scale) for d in (m, n, k))
    A, B = operands(m, n, k, la, lb, device)
    rows = []
    for contender, fn in contenders(A, B, pool, device).items():
        row: dict[str, Any] = {"shape": name, "MNK": [m, n, k], "layouts": la + lb, "contender": contender}
        try:
            fn()  # compiles
            steady = measure_steady(fn, seconds=seconds, device=device)
        except Exception as e:  # noqa: BLE001 - a tile this shape cannot use is one failed row
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        clock = sampler.summary(*steady.wall) if sampler is not None else None
        row.update(ms=round(steady.ms, 4), calls=steady.calls, tflops=round(2 * m * n * k / steady.ms / 1e9, 1))
        if clock:
            joules = clock["power_w_median"] * steady.ms / 1e3
            row.update(sm_mhz=clock["sm_mhz_median"], watts=clock["power_w_median"], joules=round(joules, 4),
                       tflop_per_j=round(2 * m * n * k / 1e12 / joules, 3), reasons=clock["reasons"])
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per contender, each shape's best quack tile against cuBLAS."""
    lines = ["| shape (M, N, K) | contender | ms | TFLOPS | MHz | W | TFLOP/J | vs cuBLAS |", "|---" * 8 + "|"]
    cublas = {r["shape"]: r["ms"] for r in rows if r["contender"] == "cublas" and "ms" in r}
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['contender']} | {r['error'][:60]} | | | | | |")
            continue
        ratio = cublas[r["shape"]] / r["ms"] if r["shape"] in cublas else float("nan")
        lines.append(f"| {r['shape']} {tuple(r['MNK'])} | {r['contender']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{r.get('sm_mhz', '')} | {r.get('watts', '')} | {r.get('tflop_per_j', '')} | {ratio:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the results JSON (a .md table beside it)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per contender, back to back")
    ap.add_argument("--pool", choices=sorted(POOLS), default="wide", help="quack's tiles (primitives.tuning.POOLS)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, shapes 64x smaller: the plumbing only")
    args = ap.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    if args.seconds <= 0:
        ap.error("--seconds takes a positive number")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark runs on the H200 (use --dry-run to check the plumbing)")
    device, scale = ("cpu", 64) if args.dry_run else ("cuda", 1)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": device, "seconds": args.seconds,
                              "pool": args.pool, "rows": []}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    out = Path(args.out)
    scope = lowering("reference") if device == "cpu" else contextlib.nullcontext()
    with ClockSampler() if device == "cuda" else contextlib.nullcontext() as sampler, scope:
        for name in names:
            result["rows"] += measure_shape(name, scale, args.seconds, args.pool, device, sampler)
            write_atomic(out, json.dumps(result, indent=1))  # a part stopped at its limit keeps what it has
            print(json.dumps({"shape": name, "done": True}), flush=True)
    write_atomic(out.with_suffix(".md"), table(result["rows"]) + "\n")
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
