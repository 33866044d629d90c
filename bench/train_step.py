"""A training step (forward, backward, AdamW) of a LLaMA-3, GPT-2, GPT-NeoX or OLMo-2 model for every
contender, on the H200.

The question a training team asks: does the step get shorter, and does it fit
in memory?  Each contender trains the same transformers model of a config
(``bench/train_models.py``: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM`` or
``Olmo2ForCausalLM``, built from a config, no download; bf16 master weights; attention through SDPA's flash
kernel, see ``train_models.register_causal_sdpa``) on the same tokens:

- ``eager``: plain PyTorch;  ``compile``: ``torch.compile(model)``;
- ``liger``: Liger's kernels (``apply_liger_kernel_to_llama``, or OLMo-2's: RoPE, RMSNorm,
  SwiGLU, fused linear cross-entropy), eager;  ``compile_liger``: the same, compiled;
- ``coda``: ``coda_agent.apply_to_llama(model)`` (``apply_to_gpt2`` for GPT-2, ``apply_to_gpt_neox`` for GPT-NeoX,
  ``apply_to_model`` for OLMo-2: its MLPs and LM head),
  compiled around the custom ops;  ``coda_eager``: the same, not compiled;
- ``coda_fp8``: ``apply_to_llama(model, fp8_mlp=True)`` (the MLP blocks' six
  GEMMs in fp8), compiled;  ``compile_torchao_fp8``: torchao's float8 training
  (rowwise scales, every linear but the LM head), compiled: the fp8 anchor.

``--compile-mode reduce-overhead`` compiles the compiled contenders in torch.compile's CUDA-graph
mode (inductor's cudagraph trees: each compiled graph, forward and backward, replays as one CUDA
graph), the configuration a user picks when the host's launches show in a step; each row then
records how many graphs inductor could not capture (``cudagraph_skips``).  Every row records
``host_ms``, the host's time to issue a step, beside the step's device time.
``--master-weights fp32`` trains fp32 parameters under bf16 autocast (HF Trainer's ``bf16=True``);
``--lora RANK`` makes the step a LoRA fine-tune (peft, the attention projections adapted, the base
frozen) for eager, compile and CODA.

Configs (``train_models.CONFIGS``, where the sizes are argued): ``1b`` (LLaMA-3.2-1B
widths, 4 layers) and ``8b`` (LLaMA-3-8B widths, 2 layers), 4 x 4096 tokens a step;
``gpt2-xl`` (GPT-2 XL widths, 6 layers) and ``gpt2-7b`` (H 4096, I 16384, 2 layers),
16 x 1024 tokens a step; ``pythia-1.4b`` (6 layers) and ``pythia-6.9b`` (2 layers), 8 x 2048.
A contender a family cannot run (Liger on GPT-2 and GPT-NeoX: no patch; torchao's float8 on
GPT-2: Conv1D projections; CODA fp8 on either: no fp8 MLP) is not run
and is recorded as skipped, with the reason.  Per contender: tokens/s and
ms/step (median of the timed steps, CUDA events), peak memory, the compile
(first-step) time, the SM clock, and one profiled step split by kernel into
GEMM / attention / other, with the time inside CODA's catalogue launches (the
share of the step the fused ops cover) and the cap: step time minus the
non-attention non-GEMM time, the best any fusion of the rest could reach.

Then the loss curves (``bench/loss_curve.py``): 200 steps of a small config,
eager fp32 and bf16, CODA bf16, torchao's float8 and CODA fp8, the fp8 rows at
``--band-seeds`` seeds for torchao's noise band.  ``--plot DIR`` draws
DIR/loss_curve.json to PNG (matplotlib, the ``plot`` extra; on the GPU machine
the PNG is drawn if matplotlib is there, else from the JSON afterwards).

Every measurement runs in its own process (Liger patches transformers' module
globals, compile caches and peak memory must not leak between contenders, and
a crash or an out-of-memory is one failed row): on CUDA a fresh interpreter
(multiprocessing's ``spawn``: the H200 refused to initialise CUDA in a child
forked from a server whose imports had touched it), on the CPU a fork of a
server that imported torch, transformers and the catalogue once and did
nothing else (``forkserver``: the imports are some seconds of every
measurement otherwise).  The driver runs them in priority order within
``--budget-s`` (default 360 s, compile warm-ups included), skips what no longer
fits (recorded as skipped), and rewrites ``OUT/train_step.json`` after each.
``--dry-run`` runs the plumbing on CPU at its family's tiny config (reference lowering;
"compiled" contenders through AOTAutograd without code generation; Liger
skipped), which CI tests.

    source scripts/gpu-env.sh && python3 bench/train_step.py --out bench/results/h200-<date>-train
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from coda_agent.primitives.lowering import PLAIN_GEMM_LIBRARIES
from coda_agent.primitives.tuning import POOLS
from coda_agent.storage import write_atomic

sys.path.insert(0, str(Path(__file__).parent))
import loss_curve  # noqa: E402
from step_profile import split_step  # noqa: E402
from train_models import build, family_of, refusal  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

CONTENDERS = ("eager", "compile", "liger", "compile_liger", "coda", "coda_eager", "coda_fp8", "compile_torchao_fp8")
COMPILED = ("compile", "compile_liger", "coda", "coda_fp8", "compile_torchao_fp8")
CUDA_ONLY = ("liger", "torchao")  # Liger's kernels are Triton, torchao's float8 GEMMs are _scaled_mm
# What the default run measures first: the comparisons the question turns on, then the rest.
# Priority: the rows the target compares (CODA against the strongest compiled
# baseline) first at both configs, then the other baselines, then the loss curve.
PLAN = [("1b", "compile"), ("1b", "coda"), ("8b", "compile"), ("8b", "coda"), ("1b", "compile_liger"),
        ("8b", "compile_liger"), ("1b", "eager"), ("8b", "eager"), ("curve", "curve"),
        ("8b", "compile_torchao_fp8"), ("8b", "coda_fp8"), ("1b", "compile_torchao_fp8"), ("1b", "coda_fp8"),
        ("1b", "liger"), ("8b", "liger"), ("1b", "coda_eager"), ("8b", "coda_eager"),
        # GPT-2's rows in the same order (the contenders its family refuses are never planned)
        ("gpt2-xl", "compile"), ("gpt2-xl", "coda"), ("gpt2-7b", "compile"), ("gpt2-7b", "coda"),
        ("gpt2-xl", "eager"), ("gpt2-7b", "eager"), ("gpt2-xl", "coda_eager"), ("gpt2-7b", "coda_eager"),
        # GPT-NeoX's (Pythia's)
        ("pythia-1.4b", "compile"), ("pythia-1.4b", "coda"), ("pythia-6.9b", "compile"), ("pythia-6.9b", "coda"),
        ("pythia-1.4b", "eager"), ("pythia-6.9b", "eager"), ("pythia-1.4b", "coda_eager"),
        ("pythia-6.9b", "coda_eager"),
        # OLMo-2's (apply_to_model: its MLPs and LM head), against compile and Liger's OLMo-2 patch
        ("olmo2-1b", "compile"), ("olmo2-1b", "coda"), ("olmo2-7b", "compile"), ("olmo2-7b", "coda"),
        ("olmo2-1b", "compile_liger"), ("olmo2-7b", "compile_liger"), ("olmo2-1b", "eager"), ("olmo2-7b", "eager"),
        ("olmo2-1b", "coda_eager"), ("olmo2-7b", "coda_eager")]
MEASURED = tuple(dict.fromkeys(c for c, k in PLAN if k != "curve"))


def prepare(model: Any, config: str, contender: str, device: str, xent_mib: int = 0,
            compile_mode: str = "default") -> Any:
    """Patch and/or compile ``model`` (of ``config``) for one contender (the optimizer is built afterwards);
    ``xent_mib``: the LM-head kernel's logits chunk, if not the expert's (:func:`xent_variant`);
    ``compile_mode``: torch.compile's mode for the compiled contenders (``reduce-overhead``
    replays each compiled graph as a CUDA graph, so the host launches nothing inside it)."""
    why = refusal(config, contender)
    if why:  # the driver never plans it; a direct call must not time something else under its name
        raise SystemExit(why)
    if "liger" in contender:  # the family's Liger patch (LLaMA's, OLMo-2's)
        import liger_kernel.transformers as liger

        getattr(liger, family_of(config).liger)(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                                fused_linear_cross_entropy=True, model=model)
    if contender == "compile_torchao_fp8":  # torchao's float8 training, rowwise scales, the LM head left bf16
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
    if contender.startswith("coda"):
        kernels = {"lm_head_xent": xent_variant(xent_mib)} if xent_mib else None
        family_of(config).patch(model, contender == "coda_fp8", kernels)
    if contender in COMPILED:
        mode = None if compile_mode == "default" or device != "cuda" else compile_mode
        model = torch.compile(model, backend="inductor" if device == "cuda" else "aot_eager", mode=mode)
    return model


def xent_variant(mib: int) -> Any:
    """The lm_head_xent expert with a logits chunk of ``mib`` MiB instead of its own budget: each
    chunk re-reads and rewrites the (V, H) weight gradient it accumulates into, so the chunk trades
    that traffic against the memory of one chunk's logits."""
    from coda_agent.kernels import Kernel
    from coda_agent.tasks import SUITE_DIR
    from coda_agent.tasks.llama3.experts import lm_head_xent

    source = Path(lm_head_xent.__file__).read_text()
    budget = "LOGITS_BYTES = 256 * 2**20"
    if budget not in source:
        raise SystemExit(f"--xent-mib: the lm_head_xent expert no longer sets {budget!r}")
    return Kernel.from_source(source.replace(budget, f"LOGITS_BYTES = {mib} * 2**20"),
                              (SUITE_DIR / "lm_head_xent.yaml").read_text(), origin=f"lm_head_xent@{mib}MiB")


LORA_CONTENDERS = ("eager", "compile", "coda", "coda_eager", "coda_fp8")  # coda_fp8: the frozen MLPs in fp8


def lora_refusal(contender: str) -> str | None:
    """Why ``contender`` does not run under ``--lora`` (None: it does): the others patch other parts."""
    return None if contender in (*LORA_CONTENDERS, "curve") else f"--lora runs {', '.join(LORA_CONTENDERS)}"


def with_lora(model: Any, config: str, rank: int) -> Any:
    """``model`` as a LoRA fine-tune of rank ``rank`` (peft) on its family's attention projections:
    the base frozen, the adapters trained (alpha = 2 * rank, no dropout)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=list(family_of(config).lora_targets)))


def measure(config: str, contender: str, steps: int, warmup: int, device: str, tune: float | None = None,
            xent_mib: int = 0, tune_pool: str = "default", compile_mode: str = "default",
            master_weights: str = "bf16", lora: int = 0) -> dict[str, Any]:
    """ms/step, tokens/s, peak memory and the profiled split of one contender at one config.
    ``tune``: a CODA contender's first step tunes each GEMM the tuning cache does not hold
    (``autotune``), backward included; 0 times the candidates in single calls, more each back to
    back for that many seconds (the regime of a step at the power cap), from ``tune_pool``.
    ``host_ms`` is the median time the host spends issuing a timed step: a step whose host time
    reaches its device time is bound by the host, and faster kernels do not shorten it.
    ``master_weights="fp32"``: the model and AdamW's state in fp32, every step inside
    ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision, as HF's Trainer runs ``bf16=True``).
    ``lora``: a LoRA fine-tune of that rank (:func:`with_lora`) instead of full training."""
    amp = master_weights == "fp32"
    model, batch, seq = build(config, device, torch.float32 if amp else torch.bfloat16)
    if lora:
        if why := lora_refusal(contender):  # the driver never plans it; a direct call is refused alike
            raise SystemExit(why)
        model = with_lora(model, config, lora)
    model = prepare(model, config, contender, device, xent_mib, compile_mode)
    graphs = compile_mode == "reduce-overhead" and device == "cuda" and contender in COMPILED
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen, device=device)
    model.train()

    def step() -> None:
        if graphs:  # a new iteration: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from coda_agent.primitives.tuning import autotune

    t0 = time.time()
    tuning = tune is not None and contender.startswith("coda")
    # Under CUDA graphs the compiled backward is captured on its first run, where nothing can be
    # timed: the tuning step runs eagerly (the same ops at the same shapes), and the compiled
    # steps after it read its winners.
    eager = torch.compiler.set_stance("force_eager") if tuning and graphs else contextlib.nullcontext()
    with autotune(steady_s=tune or None, pool=tune_pool) if tuning else contextlib.nullcontext() as tuned, eager:
        step()
        sync()
    row: dict[str, Any] = {"config": config, "contender": contender, "tokens": batch * seq,
                           "master_weights": master_weights, "lora_rank": lora or None,
                           "first_step_s": round(time.time() - t0, 1)}
    if tuned is not None:
        row["tuned"] = [{**{k: t[k] for k in ("epilogue", "MNK", "best", "regime")}, "pool": tune_pool,
                         "times_ms": {c: round(ms, 4) for c, ms in t["times_ms"].items()}} for t in tuned]
        row["untuned"] = tuned.untuned
    for _ in range(warmup):
        step()
    sync()
    times, host = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        t_start = time.time()
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            a.record()
            step()
            b.record()
            host.append((time.perf_counter() - t) * 1e3)
            times.append((a, b))
        sync()
        row["host_ms"] = round(statistics.median(host), 2)
        ms = [a.elapsed_time(b) for a, b in times]
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        # What the process holds from the allocator over the whole run: a CUDA-graph row replays
        # inside its graphs' pool, whose blocks the timed steps' allocation peak does not see.
        row["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        row["window"] = (t_start, time.time())
    else:
        ms = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t) * 1e3)
    row["ms"] = round(statistics.median(ms), 2)
    row["ms_p10_p90"] = [round(v, 2) for v in _p10_p90(ms)]
    row["tokens_per_s"] = round(row["tokens"] / row["ms"] * 1e3)
    row["split_ms"], row["where"] = split_step(step, device)
    row["cap_ms"] = round(row["ms"] - row["split_ms"]["other"], 2)
    from torch._dynamo.utils import counters

    row["graph_breaks"] = sum(counters["graph_break"].values())
    if contender in COMPILED:
        row["compile_mode"] = compile_mode
        # inductor counts every graph it could not run as a CUDA graph (the reasons go to its log)
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] if graphs else None
    row["graph_break_reasons"] = sorted({" ".join(r.split("\n")[:2]) for r in counters["graph_break"]})[:10]
    return row


def _p10_p90(ms: list[float]) -> tuple[float, float]:
    s = sorted(ms)
    return s[int(0.1 * (len(s) - 1))], s[int(math.ceil(0.9 * (len(s) - 1)))]


def child(args: argparse.Namespace, device: str, name: str) -> None:
    """The measurement ``name`` (CONFIG:CONTENDER, or curve), its result written under ``args.out``."""
    out = Path(args.out)
    if name == "curve":
        config = args.curve_config or ("tiny" if args.dry_run else "curve")
        result = loss_curve.loss_curves(args.curve_steps, device, config, build, band_seeds=args.band_seeds)
        write_atomic(out / "loss_curve.json", json.dumps(result, indent=1))
        try:
            loss_curve.plot(out)
        except ImportError:
            print("matplotlib is not installed: draw the PNG later with --plot", out)
        return
    config, contender = name.split(":")
    from coda_agent.primitives import plain_gemms

    tune = args.tune_steady if args.tune_steady else (0.0 if args.tune else None)
    if tune is not None:  # this run's winners only: a cache from an earlier run (another pool) would answer
        os.environ["CODA_CACHE_DIR"] = str(out / "cache")
    with plain_gemms(args.plain_gemms):
        row = measure(family_of(config).tiny if args.dry_run else config, contender, args.steps, args.warmup, device, tune,
                      args.xent_mib, args.tune_pool, args.compile_mode, args.master_weights, args.lora)
    if contender.startswith("coda"):
        row.update({"xent_mib": args.xent_mib or None, "plain_gemms": args.plain_gemms})
    row["config"] = config
    write_atomic(out / f"step-{config}-{contender}.json", json.dumps(row, indent=1))


def _forked(args: argparse.Namespace, device: str, name: str, log: str) -> None:
    """:func:`child` in a measurement's own process, its output to ``log`` (in the checkout, as a
    script's would be)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(ROOT)
    child(args, device, name)


def run_child(ctx: Any, args: argparse.Namespace, device: str, name: str, timeout: float) -> tuple[bool, str]:
    """(whether measurement ``name`` finished, the tail of its output), killed at ``timeout``."""
    t0 = time.time()
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        proc = ctx.Process(target=_forked, args=(args, device, name, log.name))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            return False, f"killed at the budget's end after {time.time() - t0:.0f} s"
        return proc.exitcode == 0, Path(log.name).read_text(errors="replace")[-6000:]


def drive(args: argparse.Namespace, device: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(filter(None, args.contenders.split(","))) or set(CONTENDERS) | {"curve"}
    configs = set(filter(None, args.configs.split(",")))
    plan = [(c, k) for c, k in PLAN if k in wanted and (c in configs or k == "curve")]
    # What a config's family cannot run is said, not silently dropped (PLAN never lists it).
    refused = [{"run": f"{c}:{k}", "why": why} for c in MEASURED if c in configs for k in CONTENDERS
               if k in wanted and (why := refusal(c, k))]
    if args.lora:
        refused += [{"run": f"{c}:{k}", "why": why} for c, k in plan if (why := lora_refusal(k))]
        plan = [(c, k) for c, k in plan if not lora_refusal(k)]
    if device != "cuda":
        plan = [(c, k) for c, k in plan if not any(lib in k for lib in CUDA_ONLY)]
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": device, "budget_s": args.budget_s,
                               "steps": args.steps, "warmup": args.warmup, "rows": [], "skipped": refused}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    deadline = time.time() + args.budget_s
    # On the CPU (the dry run CI does) each measurement forks from a server that imported torch,
    # transformers and the catalogue once.  On CUDA each one is a fresh interpreter: a fork of a
    # process whose imports touched CUDA cannot initialise CUDA again.
    ctx = multiprocessing.get_context("spawn" if device == "cuda" else "forkserver")
    if device != "cuda":
        ctx.set_forkserver_preload(["torch", "transformers", "coda_agent.kernels.llama", "coda_agent.kernels.gpt2",
                                    "coda_agent.kernels.gpt_neox"])
    from clocks import ClockSampler

    with ClockSampler() if device == "cuda" else contextlib.nullcontext() as sampler:
        for config, contender in plan:
            left = deadline - time.time()
            name = "curve" if contender == "curve" else f"{config}:{contender}"
            if left < 20:
                results["skipped"].append({"run": name, "why": f"budget of {args.budget_s} s spent"})
                continue
            t0 = time.time()
            ok, log = run_child(ctx, args, device, name, left)
            write_atomic(out / f"{name.replace(':', '-')}.log", log)
            if contender == "curve":
                results["curve"] = "loss_curve.json" if ok else {"error": log[-600:]}
            elif ok:
                row = json.loads((out / f"step-{config}-{contender}.json").read_text())
                window = row.pop("window", None)
                if sampler is not None and window:
                    row["clock"] = sampler.summary(*window)
                results["rows"].append(row)
            else:
                results["rows"].append({"config": config, "contender": contender, "error": log[-600:]})
            results.setdefault("wall_s", {})[name] = round(time.time() - t0, 1)
            write_atomic(out / "train_step.json", json.dumps(results, indent=1))
            print(json.dumps({"run": name, "ok": ok, "s": results["wall_s"][name]}), flush=True)
    write_atomic(out / "train_step.json", json.dumps(results, indent=1))
    print(f"wrote {out / 'train_step.json'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train-step"))
    ap.add_argument("--configs", default="1b,8b", help=f"comma-separated of {', '.join(MEASURED)}")
    ap.add_argument("--contenders", default="", help=f"comma-separated of {', '.join(CONTENDERS)}, curve "
                                                       "(default: all)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="wall-clock budget of the whole run")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3, help="steps after the first (compile) step, untimed")
    ap.add_argument("--curve-steps", type=int, default=200)
    ap.add_argument("--curve-config", choices=("curve", "mini", "tiny"), default=None,
                    help="the loss curves' config (default: curve, or tiny with --dry-run; mini: a CPU's)")
    ap.add_argument("--band-seeds", type=int, default=3, help="seeds of the curve's fp8 rows (torchao's noise band)")
    ap.add_argument("--tune", action="store_true", help="CODA rows tune their GEMMs in the first step, "
                    "each candidate in single flushed calls (cached on disk for the rows after)")
    ap.add_argument("--tune-steady", type=float, default=0.0, metavar="SECONDS",
                    help="as --tune, but each candidate timed back to back for SECONDS (the power-capped regime)")
    ap.add_argument("--tune-pool", choices=sorted(POOLS), default="default",
                    help="the candidates --tune and --tune-steady pick from (primitives.tuning.POOLS)")
    ap.add_argument("--xent-mib", type=int, default=0, help="CODA rows: the LM-head kernel's logits chunk in "
                    "MiB (default: the expert's)")
    ap.add_argument("--plain-gemms", choices=PLAIN_GEMM_LIBRARIES, default="quack",
                    help="CODA rows: the library of the GEMMs without an epilogue (primitives.plain_gemms)")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                    help="torch.compile's mode for the compiled rows (reduce-overhead: CUDA graphs)")
    ap.add_argument("--master-weights", choices=("bf16", "fp32"), default="bf16",
                    help="fp32: every contender keeps fp32 weights and steps under bf16 autocast (mixed precision)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help=f"a LoRA fine-tune (peft) of that rank on the attention projections, not full training "
                         f"({', '.join(LORA_CONTENDERS)})")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config, reference lowering: the plumbing")
    ap.add_argument("--plot", metavar="DIR", help="draw DIR/loss_curve.json to DIR/loss_curve.png and exit")
    args = ap.parse_args()
    unknown = sorted(set(filter(None, args.configs.split(","))) - set(MEASURED))
    if unknown:  # a misspelt config would otherwise measure nothing and say so only by an empty table
        ap.error(f"--configs: no config {', '.join(unknown)}; the step measures {', '.join(MEASURED)}")
    if args.tune_steady < 0 or args.xent_mib < 0:
        ap.error("--tune-steady and --xent-mib take positive numbers (0: off)")
    if args.plot:
        print(loss_curve.plot(Path(args.plot)))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark runs on the H200 (use --dry-run to check the plumbing)")
    return drive(args, "cuda" if not args.dry_run else "cpu")


if __name__ == "__main__":
    sys.exit(main())
