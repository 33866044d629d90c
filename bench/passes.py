"""What a pass without a GEMM costs on the H200, and what the alternative would.

The catalogue runs an untuned ``tile_pass`` on its own streaming kernel
(primitives/pass_kernel.py) and a pass given a tile config on quack's SM90
kernel over a zero mainloop (primitives/passes.py).  These experiments ask
how close each comes to the memory's bandwidth, and record the numbers behind
choosing them over an A-operand prologue:

- ``bandwidth``: at T = 16384 and N = 768 / 3072 / 16384 (GPT-2 small's
  hidden and MLP widths, a 7B-class MLP), each pass the GPT-2 experts run
  against the same math under ``torch.compile`` and a plain copy (the
  bandwidth reference): dGELU of an incoming gradient with its bias gradient
  (read 2 tiles, write 1), the row moments behind ``row_stats`` (read 1),
  ``normalize_rows`` (read 1, write 1); each on the pass kernel at every
  geometry of ``_geometries()`` (``pass`` is the default one) and on the
  zero mainloop at the pass rule's tile.  Rows carry ms (median, p10-p90,
  interleaved) and GB/s of the bytes the math must move.
- ``rms_prepare``: the entry RMSNorm's aux at LLaMA-3 widths, its PyTorch body
  against the tile pass it runs on CUDA, torch.compile and a copy.
- ``prologue``: the cheapest A-operand transform quack offers (``x * 0.5``, a
  value transform on the register-sourced mainloop) against the same GEMM
  without it, at the GPT-2 small QKV and fc shapes: the floor of what a
  prologue costs before any math is in it.

Usage on the device: ``python3 bench/passes.py OUT.json [EXPERIMENT ...]``;
``--dry-run`` runs the bandwidth and rms_prepare plumbing on the CPU (reference
lowering, small shapes, wall-clock times that mean nothing), which CI does.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import stats, versions  # noqa: E402  # bench/run.py

from coda_agent.storage import write_atomic  # noqa: E402

DGELU = '''
from coda_agent.primitives import Tile, epilogue, erf, exp, row_sum

@epilogue(reductions={"db": row_sum()})
def dgelu(dy: Tile, pre: Tile):
    dpre = dy * (0.5 * (1.0 + erf(pre * 0.7071067811865476)) + pre * exp(-0.5 * pre * pre) * 0.3989422804014327)
    return {"D": dpre, "db": dpre}
'''


def _dgelu_torch(dy: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = pre.float()
    dpre = dy.float() * (0.5 * (1 + torch.erf(p * 0.7071067811865476)) + p * torch.exp(-0.5 * p * p) * 0.3989422804014327)
    return dpre.to(dy.dtype), dpre.sum(0)


def _normalize_torch(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    return ((x.float() - mean[:, None]) * rstd[:, None] * gamma.float() + beta.float()).to(x.dtype)


def _stats_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(x.float(), dim=1, correction=0)
    return mean, torch.rsqrt(var + 1e-5)


def _geometries() -> tuple:
    from coda_agent.primitives.pass_kernel import Geometry

    return (Geometry(2, 4), Geometry(4, 2), Geometry(2, 2), Geometry(8, 1), Geometry(4, 4))


def bandwidth(device: str = "cuda", shapes: tuple = ((16384, 768), (16384, 3072), (16384, 16384)),
              reps: int = 20) -> dict:
    from coda_agent.primitives import column_index, load_program, lowering, pass_kernel, tile_pass
    from coda_agent.primitives.norm import normalize, row_moments
    from coda_agent.primitives.tile_config import PASS_CONFIG

    dgelu = load_program(DGELU, "bench_dgelu").dgelu
    low = "cute" if device == "cuda" else "reference"
    compiled = device == "cuda"
    out: dict[str, Any] = {}
    for t, n in shapes:
        gen = torch.Generator(device=device).manual_seed(t + n)
        dy, pre, x = (torch.randn(t, n, generator=gen, device=device).to(torch.bfloat16) for _ in range(3))
        gamma, beta = torch.randn(n, device=device).bfloat16(), torch.randn(n, device=device).bfloat16()
        mean, rstd = torch.randn(t, device=device), torch.rand(t, device=device) + 0.5
        tile = t * n * 2  # bytes of one bf16 (T, N) tensor

        def within(fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                with lowering(low):
                    return fn()
            return run

        def contenders(epi: Any, **operands: Any) -> dict[str, Callable[[], Any]]:
            """The pass on the pass kernel (default geometry, then the sweep) and on the zero mainloop."""
            def on(g: Any) -> Callable[[], Any]:
                def run() -> Any:
                    with pass_kernel.geometry(g):
                        return tile_pass(epi, **operands)
                return within(run)
            return {"pass": within(lambda: tile_pass(epi, **operands)),
                    **({f"pass {g}": on(g) for g in _geometries()} if compiled else {}),
                    f"zero mainloop {PASS_CONFIG}": within(lambda: tile_pass(epi, config=PASS_CONFIG, **operands))}

        cases: dict[str, tuple[int, dict[str, Callable[[], Any]]]] = {
            "dgelu": (3 * tile, {**contenders(dgelu, dy=dy, pre=pre),
                                 **({"compile": lambda: _compiled(_dgelu_torch)(dy, pre)} if compiled else {})}),
            "row_stats": (tile, {**contenders(row_moments, x=x, shift=mean, col=column_index(n, device), n=float(n)),
                                 **({"compile": lambda: _compiled(_stats_torch)(x)} if compiled else {})}),
            "normalize_rows": (2 * tile, {**contenders(normalize, x=x, mean=mean, rstd=rstd, gamma=gamma, beta=beta),
                                          **({"compile": lambda: _compiled(_normalize_torch)(x, mean, rstd, gamma, beta)}
                                             if compiled else {})}),
        }
        for case, (nbytes, fns) in cases.items():
            fns = {"copy": (lambda: x.clone()), **fns}
            row: dict[str, Any] = {}
            for name in list(fns):
                try:
                    fns[name]()  # compile, outside the timing
                except Exception as e:  # noqa: BLE001 - a config the compile refuses is a row, not a crash
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    del fns[name]
            for name, s in stats(fns, reps, device).items():
                moved = 2 * tile if name == "copy" else nbytes
                row[name] = {**s, "gb_per_s": moved / (s["median_ms"] * 1e-3) / 1e9}
            out[f"{case} T={t} N={n}"] = row
    return out


def rms_prepare(device: str = "cuda", shapes: tuple = ((16384, 2048), (16384, 4096), (16384, 8192)),
                reps: int = 20) -> dict:
    """The entry RMSNorm's aux (``x * gamma`` and the inverse RMS, LLaMA-3 1B / 8B / 70B widths):
    its PyTorch body against the tile pass it runs on CUDA, torch.compile of the same math and a
    copy.  Rows carry ms and GB/s of one read and one write of x."""
    from coda_agent.primitives import lowering
    from coda_agent.primitives.aux import _rms_prepare_torch, rms_prepare_pass

    low = "cute" if device == "cuda" else "reference"
    out: dict[str, Any] = {}
    for t, n in shapes:
        gen = torch.Generator(device=device).manual_seed(t + n)
        x = torch.randn(t, n, generator=gen, device=device).to(torch.bfloat16)
        gamma = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).bfloat16()

        def on_pass() -> Any:
            with lowering(low):
                return rms_prepare_pass(x, gamma, 1e-5)

        fns = {"copy": lambda: x.clone(), "pytorch body": lambda: _rms_prepare_torch(x, gamma, 1e-5),
               "pass": on_pass, **({"compile": lambda: _compiled(_rms_prepare_torch)(x, gamma, 1e-5)}
                                   if device == "cuda" else {})}
        for fn in fns.values():
            fn()  # compile, outside the timing
        moved = 2 * t * n * 2
        out[f"rms_prepare T={t} N={n}"] = {name: {**s_, "gb_per_s": moved / (s_["median_ms"] * 1e-3) / 1e9}
                                           for name, s_ in stats(fns, reps, device).items()}
    return out


_COMPILED: dict[Callable, Callable] = {}


def _compiled(fn: Callable) -> Callable:
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def prologue(reps: int = 20) -> dict:
    """A GEMM with and without quack's cheapest A-operand transform."""
    from quack.operand_transform import a_transform

    from coda_agent.primitives import TileConfig, cute, epilogue
    from coda_agent.primitives.dsl_scope import pipeline_guard

    @a_transform(vec_size=8)
    def halve(x):  # noqa: ANN001, ANN202 - traced by quack
        return x * 0.5

    @epilogue()
    def store(acc):  # noqa: ANN001, ANN202 - the plain GEMM's epilogue
        return {"D": acc}

    out: dict[str, Any] = {}
    mod = cute.epimod(store)
    for m, n, k in ((16384, 2304, 768), (16384, 3072, 768), (16384, 12288, 4096)):
        a = torch.randn(m, k, device="cuda").bfloat16()
        b = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16().t()
        row: dict[str, Any] = {}
        fns: dict[str, Callable[[], Any]] = {}
        for cfg in (TileConfig(), TileConfig(tile_n=128, cluster_m=1), TileConfig(tile_n=256, cluster_m=1, pingpong=False)):
            for name, ta in ((f"plain {cfg}", None), (f"x * 0.5 on A {cfg}", halve)):
                def call(cfg: TileConfig = cfg, ta: Any = ta) -> Any:
                    with pipeline_guard():
                        return mod(a, b, None, out={"D": torch.empty(m, n, dtype=torch.bfloat16, device="cuda")},
                                   out_dtype=torch.bfloat16, store_d=True, config=cfg.to_quack(), tuned=False,
                                   transform_a=ta)
                try:
                    call()
                    fns[name] = call
                except Exception as e:  # noqa: BLE001
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row.update(stats(fns, reps))
        for name, s in row.items():
            if "median_ms" in s:
                s["tflops"] = 2 * m * n * k / (s["median_ms"] * 1e-3) / 1e12
        out[f"M={m} N={n} K={k}"] = row
    return out


EXPERIMENTS: dict[str, Callable[[], dict]] = {"bandwidth": bandwidth, "prologue": prologue, "rms_prepare": rms_prepare}


def run_experiments(path: Path, experiments: dict[str, Callable[[], dict]], **header: Any) -> int:
    """Each experiment in turn, the results file rewritten after each (a run cut
    short keeps what finished; a failing experiment is a section with its error)."""
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "versions": versions(), **header}
    for name, experiment in experiments.items():
        t0 = time.time()
        try:
            result[name] = experiment()
        except Exception as e:  # noqa: BLE001 - keep the other experiments
            traceback.print_exc(limit=5)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        result[f"{name}_s"] = round(time.time() - t0, 1)
        write_atomic(path, json.dumps(result, indent=1))
        print(f"{name}: {result[f'{name}_s']} s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    small = ((256, 128), (1000, 200))
    on_cpu = {"bandwidth": lambda: bandwidth("cpu", small, reps=2), "rms_prepare": lambda: rms_prepare("cpu", small, 2)}
    path, wanted = Path(argv[0]), argv[1:] or list(on_cpu if dry else EXPERIMENTS)
    unknown = [w for w in wanted if w not in (on_cpu if dry else EXPERIMENTS)]
    if unknown:
        print(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)} (a dry run has {list(on_cpu)})")
        return 2
    if dry:
        return run_experiments(path, {name: on_cpu[name] for name in wanted}, dry_run=True)
    return run_experiments(path, {name: EXPERIMENTS[name] for name in wanted})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
