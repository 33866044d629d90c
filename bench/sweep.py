"""Targeted H200 sweeps behind the tile heuristic and the experts' knobs.

``bench/run.py`` times whole tasks with the configs the heuristic picks; this
script asks narrower questions, each an experiment writing one JSON section:

- ``few_tiles``: plain GEMMs with few output tiles (the dx GEMM of a 1024-row
  LM-head chunk: M = 1024, K = V) against full-size controls, every candidate
  config: does a 128x128 tile that fills the SMs beat the wide 128x192 tile
  (``primitives/gemm.py: WIDE_TILE_GAIN``)?
- ``narrow_n``: the RoPE backward epilogue at N = head_dim (64, 128): is a tile
  as narrow as the output better than 128?
- ``paired_tile``: the dSwiGLU backward (PairedTile in, packed pairs out, a
  row reduction) at LLaMA-3 1B and 8B, the suite's worst fused / GEMM ratios,
  over the candidates and narrower or differently clustered tiles, timed
  interleaved;
- ``dswiglu_parts``: the same GEMM with parts of that epilogue (the
  pre-activation round trip alone, the math alone, all of it, all of it with an
  IEEE division) at four configs: what the epilogue's time is spent on;
- ``lm_head_chunks``: the lm_head_xent expert at LLaMA-3 1B with its logits
  chunk budget at 256 / 448 / 512 MiB: time and peak memory;
- ``lm_head_bf16_dw``: the LM head's dw summed across chunks in fp32 or bf16
  (two ways of rounding) at LLaMA-3 1B: the verifier's verdict, three seeds;
- ``contention``: a launch-heavy small program timed alone and with every CPU
  core busy, at the shipped spin margin (``tuning.SPIN_FACTOR``) and twice it;
- ``power``: the dSwiGLU GEMM with and without its epilogue, each run back to
  back for seconds at LLaMA-3 1B and 8B while ``bench/clocks.py`` reads the SM
  clock and board power: is what the epilogue costs its traffic's power, paid
  as a lower clock at the power cap?

Usage on the device: ``python3 bench/sweep.py OUT.json [EXPERIMENT ...]``.
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
from run import outputs_gib, peak_mem_gib, stat, stats, versions  # noqa: E402  # bench/run.py

ROOT = Path(__file__).resolve().parent.parent
V, T = 128256, 16384


def _configs(extra: tuple = ()) -> list:
    from coda_agent.primitives.tuning import CANDIDATES

    return list(CANDIDATES) + list(extra)


def _sweep(call: Callable[[Any], Any], configs: list) -> dict:
    """Every config that runs, timed interleaved (``stats``); one that cannot
    run at this shape is a row with its error, not a crash."""
    out: dict[str, Any] = {}
    runnable: dict[str, Callable[[], Any]] = {}
    for cfg in configs:
        try:
            call(cfg)  # compiles
            runnable[str(cfg)] = lambda cfg=cfg: call(cfg)
        except Exception as e:  # noqa: BLE001
            out[str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    out.update(stats(runnable, 20))
    return out


def few_tiles() -> list[dict]:
    from coda_agent.primitives import gemm, lowering
    from coda_agent.primitives.gemm import default_config

    rows = []
    for m, n, k in [(1024, 2048, V), (1024, 4096, V), (1024, 8192, V),
                    (T, 2048, 2048), (T, 8192, 2048)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        with lowering("cute"):
            times = _sweep(lambda cfg: gemm(a, b, config=cfg), _configs())
        cublas = stat(lambda: a @ b, 20)
        rows.append({"MNK": [m, n, k], "heuristic": str(default_config(None, {}, n, m)),
                     "cublas": cublas, "configs": times})
    return rows


def narrow_n() -> list[dict]:
    from coda_agent.primitives import TileConfig, gemm, load_program, lowering

    task = _task("rope_bwd")
    prog = load_program(task.expert_path.read_text(), task.name)
    rows = []
    for d in (64, 128):
        dS = torch.randn(T, T, device="cuda", dtype=torch.bfloat16) / T ** 0.5
        k = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 131072, (T,), device="cuda").float()
        freq = torch.rand(d, device="cuda")
        extra = (TileConfig(128, 64, 1, 1, True), TileConfig(128, 64, 2, 1, True),
                 TileConfig(64, 128, 1, 1, False))
        with lowering("cute"):
            times = _sweep(lambda cfg: gemm(dS, k, prog.rope_inverse, config=cfg, pos=pos, freq=freq),
                           _configs(extra))
        rows.append({"MNK": [T, d, T], "epilogue": "rope_inverse", "cublas_plain": stat(lambda: dS @ k, 20),
                     "configs": times})
    return rows


def paired_tile() -> list[dict]:
    from coda_agent.primitives import TileConfig, gemm, load_program, lowering

    task = _task("swiglu_bwd")
    prog = load_program(task.expert_path.read_text(), task.name)
    extra = (TileConfig(128, 64, 1, 1, True), TileConfig(128, 64, 2, 1, True),
             TileConfig(128, 96, 2, 1, True), TileConfig(128, 128, 1, 2, True),
             TileConfig(256, 64, 2, 1, False), TileConfig(128, 128, 2, 2, True),
             TileConfig(128, 64, 1, 2, True), TileConfig(128, 192, 1, 2, True))
    rows = []
    # LLaMA-3 1B, the suite's worst fused / GEMM ratio, and 8B, where it decides
    # whether the backward tasks reach their target.
    for h, i in ((2048, 8192), (4096, 14336)):
        dout = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, i, device="cuda", dtype=torch.bfloat16) / h ** 0.5
        pre = torch.randn(T, 2 * i, device="cuda", dtype=torch.bfloat16)
        with lowering("cute"):
            times = _sweep(lambda cfg: gemm(dout, w, prog.dswiglu, config=cfg, pre=pre), _configs(extra))
            plain = _sweep(lambda cfg: gemm(dout, w, config=cfg), [TileConfig(128, 128, 1, 2, True),
                                                                   TileConfig(128, 192, 2, 1, True)])
        rows.append({"MNK": [T, i, h], "epilogue": "dswiglu", "cublas_plain": stat(lambda: dout @ w, 20),
                     "quack_plain": plain, "configs": times})
    return rows


# Variants of the dSwiGLU epilogue, to split its cost: the pre-activation round
# trip alone, the math without the extra output and the reduction, the expert's
# full epilogue, and the full epilogue with an IEEE division in its sigmoid (the
# catalogue's sigmoid before 2026.11.29-4).
DSWIGLU_PARTS = '''
from coda_agent.primitives import PairedTile, col_sum, epilogue, exp, pack, sigmoid, unpack


@epilogue()
def copy(acc, pre: PairedTile):
    g, u = unpack(pre)
    return {"D": pack(acc * g, acc * u)}


@epilogue()
def math_only(acc, pre: PairedTile):
    g, u = unpack(pre)
    sg = sigmoid(g)
    return {"D": pack(acc * u * sg * (1.0 + g * (1.0 - sg)), acc * g * sg)}


@epilogue(outputs={"postact": "bf16"}, reductions={"s": col_sum()})
def ieee_division(acc, pre: PairedTile):
    g, u = unpack(pre)
    sg = 1.0 / (1.0 + exp(-g))
    act = g * sg
    dg = acc * u * sg * (1.0 + g * (1.0 - sg))
    du = acc * act
    return {"D": pack(dg, du), "postact": act * u, "s": dg * g + du * u}
'''


def dswiglu_parts() -> list[dict]:
    """Where the dSwiGLU epilogue's time goes at LLaMA-3 1B, per tile config."""
    from coda_agent.primitives import TileConfig, gemm, load_program, lowering

    task = _task("swiglu_bwd")
    full = load_program(task.expert_path.read_text(), task.name).dswiglu
    parts = load_program(DSWIGLU_PARTS, "dswiglu_parts")
    h, i = 2048, 8192
    dout = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(h, i, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    pre = torch.randn(T, 2 * i, device="cuda", dtype=torch.bfloat16)
    variants = {"plain": None, "copy": parts.copy, "math_only": parts.math_only, "full": full,
                "ieee_division": parts.ieee_division}
    configs = [TileConfig(128, 128, 2, 1, True), TileConfig(128, 128, 1, 2, True),
               TileConfig(128, 192, 2, 1, True), TileConfig(256, 128, 2, 1, False)]
    rows = []
    for cfg in configs:
        row: dict[str, Any] = {"config": str(cfg)}
        for name, epi in variants.items():
            if name == "ieee_division" and cfg != configs[0]:
                continue
            ops = {} if epi is None else {"pre": pre}
            try:
                with lowering("cute"):
                    row[name] = stat(lambda: gemm(dout, w, epi, config=cfg, **ops), 20)
            except Exception as e:  # noqa: BLE001 - a config the epilogue cannot use is a row
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
    rows.append({"config": "cuBLAS", "plain": stat(lambda: dout @ w, 20)})
    return rows


def lm_head_chunks() -> list[dict]:
    from coda_agent.primitives import launch_ledger, load_program, lowering
    from coda_agent.verifier.inputs import make_inputs

    task = _task("lm_head_xent")
    inputs = make_inputs(task.spec, "llama3-1b", seed=11, device="cuda")
    rows = []
    for budget in (256 * 2**20, 448 * 2**20, 512 * 2**20):
        prog = load_program(task.expert_path.read_text(), task.name)
        prog.LOGITS_BYTES = budget  # the module global the expert sizes its chunk by

        def step() -> Any:
            with lowering("cute"):
                return prog.forward(**inputs)

        with launch_ledger() as ledger:
            out = step()
        held = outputs_gib(out)
        del out
        torch.cuda.empty_cache()
        rows.append({"logits_bytes": budget, "time": stat(step, 10), "peak_gib": peak_mem_gib(step),
                     "outputs_gib": held,
                     "configs": sorted({f"{l.name}: {l.config}" for l in ledger if l.kind == "gemm"})})
        torch.cuda.empty_cache()
    return rows


def lm_head_bf16_dw() -> list[dict]:
    """The accuracy of the LM head's dw by how it is summed across token chunks, at
    LLaMA-3 1B, judged by the verifier's own compare against its fp32 / bf16
    references (three seeds).  The expert's chunks feed three sums of
    dw = sum over chunks of dlogits^T @ x_c, formed with fp32 torch matmuls (TF32
    off) of the expert's dlogits, which is what the kernels compute up to
    summation order:

    - ``fp32``: an fp32 dw (what the expert returned before run 4 of 2026-11-29);
    - ``bf16_one_rounding``: dw kept in bf16, each chunk's fp32 product added to it in
      fp32 and rounded once (a GEMM reading the running dw as its C operand);
    - ``bf16_reduce_add``: each chunk's product rounded to bf16, then added into the
      bf16 dw and rounded again (the TMA reduce-add store: what ``accumulate_into``
      does to a bf16 buffer, and what the expert ships);
    and ``shipped``, the expert's own dw.  ``lm_head_chunks`` times the expert."""
    from coda_agent.primitives import gemm, load_program, lowering, xent_grad_
    from coda_agent.verifier.inputs import make_inputs, run_reference

    task = _task("lm_head_xent")
    prog = load_program(task.expert_path.read_text(), task.name)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for seed in (11, 12, 13):
        inputs = make_inputs(task.spec, "llama3-1b", seed=seed, device="cuda")
        hi = run_reference(task, inputs, None, torch.float32)["dw"]
        lo = run_reference(task, inputs, None, None)["dw"]
        torch.cuda.empty_cache()
        with lowering("cute"):
            shipped = prog.forward(**inputs)["dw"]
        x, w, target, dloss = (inputs[k] for k in ("x", "w", "target", "dloss"))
        t, v = x.shape[0], w.shape[0]
        fit = max(128, prog.LOGITS_BYTES // (2 * v) // 128 * 128)
        lo_err = float((lo.float() - hi).abs().max())
        row: dict[str, Any] = {"seed": seed, "lo_max_abs_err": lo_err,
                               "shipped": _judge(task, shipped, hi, lo, lo_err)}
        for chunk in (fit, 2 * fit):
            sums = {"fp32": torch.zeros_like(w, dtype=torch.float32),
                    "bf16_one_rounding": torch.zeros_like(w), "bf16_reduce_add": torch.zeros_like(w)}
            for r0 in range(0, t, chunk):
                x_c, t_c = x[r0:r0 + chunk], target[r0:r0 + chunk]
                with lowering("cute"):
                    res = gemm(x_c, w.t(), prog.logits_lse, out_dtype="bf16", target=t_c)
                    dlogits = xent_grad_(res["D"], res["lse"], t_c, dloss[r0:r0 + chunk])
                part = dlogits.float().t() @ x_c.float()
                sums["fp32"] += part
                sums["bf16_one_rounding"] = (sums["bf16_one_rounding"].float() + part).bfloat16()
                sums["bf16_reduce_add"] = (sums["bf16_reduce_add"].float()
                                           + part.bfloat16().float()).bfloat16()
                del res, dlogits, part
            for name, got in sums.items():
                row[f"{name}_{chunk}_rows"] = _judge(task, got, hi, lo, lo_err)
            del sums
        rows.append(row)
        del hi, lo, shipped
        torch.cuda.empty_cache()
    return rows


def _judge(task: Any, got: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, lo_err: float) -> dict:
    from coda_agent.verifier.compare import compare

    err = float((got.float() - hi).abs().max())
    return {"max_abs_err": err, "over_lo": err / lo_err,
            "passes": compare("dw", "llama3-1b", got.float(), hi, lo, task.spec.tolerance) is None,
            "rel_norm": float((got.float() - hi).norm() / hi.norm())}


def _burn() -> None:
    while True:
        pass


def contention() -> list[dict]:
    """rope_bwd at LLaMA-3 70B (0.27 ms of GPU work, 0.3-0.4 ms of host work:
    the case most exposed to launch gaps) timed alone and with every CPU core
    busy, as the verifier's side-by-side workers make it, at two spin margins."""
    import multiprocessing as mp
    import os

    from coda_agent.primitives import load_program, lowering, tuning
    from coda_agent.verifier.inputs import make_inputs

    task = _task("rope_bwd")
    prog = load_program(task.expert_path.read_text(), task.name)
    inputs = make_inputs(task.spec, "llama3-70b", seed=5, device="cuda")

    def call() -> Any:
        with lowering("cute"):
            return prog.forward(**inputs)

    rows = []
    for busy in (0, os.cpu_count() or 16):
        burners = [mp.Process(target=_burn, daemon=True) for _ in range(busy)]
        for b in burners:
            b.start()
        try:
            for factor, floor in ((tuning.SPIN_FACTOR, tuning.SPIN_FLOOR_MS), (3.0, 0.1)):
                saved = tuning.SPIN_FACTOR, tuning.SPIN_FLOOR_MS
                tuning.SPIN_FACTOR, tuning.SPIN_FLOOR_MS = factor, floor
                try:
                    rows.append({"busy_cores": busy, "spin": [factor, floor], **stat(call, 50)})
                finally:
                    tuning.SPIN_FACTOR, tuning.SPIN_FLOOR_MS = saved
        finally:
            for b in burners:
                b.terminate()
    return rows


def power(seconds: float = 3.0, settle: float = 1.0) -> list[dict]:
    """Each contender runs alone, back to back, for ``seconds``; its time and the
    clock summary cover the part after ``settle`` seconds (board power is a
    one-second average; ``tuning.measure_steady``).  Two
    passes in opposite orders, so a drift over the experiment shows as a
    difference between them."""
    from clocks import ClockSampler  # bench/clocks.py
    from coda_agent.primitives import TileConfig, gemm, load_program, lowering
    from coda_agent.primitives.tuning import measure_steady

    task = _task("swiglu_bwd")
    full = load_program(task.expert_path.read_text(), task.name).dswiglu
    parts = load_program(DSWIGLU_PARTS, "dswiglu_parts")
    paired = TileConfig(128, 128, 1, 2, True)  # what the heuristic gives the expert
    rows: list[dict] = []
    with ClockSampler(period_s=0.05) as sampler:
        for shapes, (h, i) in {"llama3-1b": (2048, 8192), "llama3-8b": (4096, 14336)}.items():
            dout = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(h, i, device="cuda", dtype=torch.bfloat16) / h ** 0.5
            pre = torch.randn(T, 2 * i, device="cuda", dtype=torch.bfloat16)

            def quack(epi: Any, **ops: Any) -> Callable[[], Any]:
                def run() -> Any:
                    with lowering("cute"):
                        return gemm(dout, w, epi, config=paired, **ops)
                return run

            contenders = {"cublas_plain": lambda: dout @ w, "quack_plain": quack(None),
                          "pre_round_trip": quack(parts.copy, pre=pre), "full_epilogue": quack(full, pre=pre)}
            names = list(contenders)
            for order in (names, names[::-1]):
                for name in order:
                    run = measure_steady(contenders[name], seconds - settle, settle)
                    rows.append({"shapes": shapes, "MNK": [T, i, h], "config": str(paired), "contender": name,
                                 "pass": 0 if order is names else 1, "ms_per_call": run.ms, "calls": run.calls,
                                 "clock": sampler.summary(*run.wall)})
                    print(json.dumps(rows[-1]), flush=True)
    if sampler.error:
        rows.append({"clock_error": sampler.error})
    return rows


def _task(name: str) -> Any:
    from coda_agent.tasks import SUITE_DIR, load_suite

    return next(t for t in load_suite(SUITE_DIR) if t.name == name)


EXPERIMENTS = {"few_tiles": few_tiles, "narrow_n": narrow_n, "paired_tile": paired_tile,
               "dswiglu_parts": dswiglu_parts, "lm_head_bf16_dw": lm_head_bf16_dw,
               "lm_head_chunks": lm_head_chunks, "contention": contention, "power": power}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    path, wanted = Path(argv[0]), argv[1:] or list(EXPERIMENTS)
    unknown = [w for w in wanted if w not in EXPERIMENTS]
    if unknown:
        print(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
        return 2
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "versions": versions()}
    for name in wanted:
        t0 = time.time()
        try:
            result[name] = EXPERIMENTS[name]()
        except Exception as e:  # noqa: BLE001 - keep the other experiments
            traceback.print_exc(limit=5)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        result[f"{name}_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(result, indent=1))
        print(f"{name}: {result[f'{name}_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
