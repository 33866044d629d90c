"""A LLaMA-3-style training step (forward, backward, AdamW) for every contender, on the H200.

The question a training team asks: does the step get shorter, and does it fit
in memory?  Each contender trains the same transformers ``LlamaForCausalLM``
(built from a config, no download; bf16 master weights; attention through
SDPA's flash kernel, see :func:`register_causal_sdpa`) on the same tokens:

- ``eager``: plain PyTorch;  ``compile``: ``torch.compile(model)``;
- ``liger``: Liger's kernels (``apply_liger_kernel_to_llama``: RoPE, RMSNorm,
  SwiGLU, fused linear cross-entropy), eager;  ``compile_liger``: the same, compiled;
- ``coda``: ``coda_agent.apply_to_llama(model)``, compiled around the custom
  ops;  ``coda_eager``: the same, not compiled;
- ``coda_fp8``: ``apply_to_llama(model, fp8_mlp=True)`` (the MLP blocks' six
  GEMMs in fp8), compiled;  ``compile_torchao_fp8``: torchao's float8 training
  (rowwise scales, every linear but the LM head), compiled: the fp8 anchor.

Configs: ``1b`` (LLaMA-3.2-1B widths: H 2048, I 8192, 32/8 heads of 64,
V 128256, 4 layers) and ``8b`` (LLaMA-3-8B widths: H 4096, I 14336, 32/8 heads
of 128, 2 layers), both 4 x 4096 tokens a step.  Per contender: tokens/s and
ms/step (median of the timed steps, CUDA events), peak memory, the compile
(first-step) time, the SM clock, and one profiled step split by kernel into
GEMM / attention / other, with the time inside CODA's catalogue launches (the
share of the step the fused ops cover) and the cap: step time minus the
non-attention non-GEMM time, the best any fusion of the rest could reach.

Then the loss curve: 200 steps of a small config on a fixed synthetic corpus
(a random bigram chain, so the loss has something to learn), CODA and eager
in bf16 against eager in fp32; the gap between bf16 eager and fp32 is the bf16
noise CODA's curve is read against.  ``--plot DIR`` draws it to PNG
(matplotlib, the ``plot`` extra; on the GPU machine the PNG is drawn if
matplotlib is there, else from the JSON afterwards).

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
``--dry-run`` runs the plumbing on CPU at a tiny config (reference lowering;
"compiled" contenders through AOTAutograd without code generation; Liger
skipped), which CI tests.

    source scripts/gpu-env.sh && python3 bench/train_step.py --out bench/results/h200-<date>-train
"""

from __future__ import annotations

import argparse
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

from coda_agent.storage import write_atomic

ROOT = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, vocab_size=128256, num_hidden_layers=4, batch=4, seq=4096),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=128256, num_hidden_layers=2, batch=4, seq=4096),
    "curve": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, vocab_size=8192, num_hidden_layers=4, batch=8, seq=256),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=512, num_hidden_layers=2, batch=2, seq=32),
}
CONTENDERS = ("eager", "compile", "liger", "compile_liger", "coda", "coda_eager", "coda_fp8", "compile_torchao_fp8")
CUDA_ONLY = ("liger", "torchao")  # Liger's kernels are Triton, torchao's float8 GEMMs are _scaled_mm
# What the default run measures first: the comparisons the question turns on, then the rest.
# Priority: the rows the target compares (CODA against the strongest compiled
# baseline) first at both configs, then the other baselines, then the loss curve.
PLAN = [("1b", "compile"), ("1b", "coda"), ("8b", "compile"), ("8b", "coda"), ("1b", "compile_liger"),
        ("8b", "compile_liger"), ("1b", "eager"), ("8b", "eager"), ("curve", "curve"),
        ("8b", "compile_torchao_fp8"), ("8b", "coda_fp8"), ("1b", "compile_torchao_fp8"), ("1b", "coda_fp8"),
        ("1b", "liger"), ("8b", "liger"), ("1b", "coda_eager"), ("8b", "coda_eager")]
ATTENTION = ("flash", "fmha", "attention", "sdpa", "scaled_dot")
GEMM = ("gemm", "matmul", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "_mm_", "tem_fused_mm")


CAUSAL_SDPA = "sdpa_causal"


def register_causal_sdpa() -> str:
    """An attention implementation for unpadded causal training: transformers' SDPA
    attention with no mask, so SDPA's ``is_causal`` picks the flash kernel.  Under
    ``torch.compile`` transformers' own "sdpa" materializes the causal mask (it cannot
    prove, while tracing, that no token is padded), and with an explicit mask SDPA runs
    its memory-efficient kernel instead: a 1B step's attention took 34.7 ms compiled
    against 10.8 ms eager (bench/results/h200-2026-12-01/train).  Every contender of this
    benchmark uses it, so they differ only in what the comparison is about."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)
    return CAUSAL_SDPA


def build(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, int, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = dict(CONFIGS[name])
    batch, seq = c.pop("batch"), c.pop("seq")
    torch.manual_seed(seed)
    cfg = LlamaConfig(**c, max_position_embeddings=max(seq, 8192), rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation=register_causal_sdpa())
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype), batch, seq


def prepare(model: Any, contender: str, device: str) -> Any:
    """Patch and/or compile ``model`` for one contender (the optimizer is built afterwards)."""
    if "liger" in contender:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    if contender == "compile_torchao_fp8":  # torchao's float8 training, rowwise scales, the LM head left bf16
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
    if contender.startswith("coda"):
        import coda_agent

        coda_agent.apply_to_llama(model, fp8_mlp=contender == "coda_fp8")
    if contender in ("compile", "compile_liger", "coda", "coda_fp8", "compile_torchao_fp8"):
        model = torch.compile(model, backend="inductor" if device == "cuda" else "aot_eager")
    return model


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    return "gemm" if any(k in low for k in GEMM) else "other"


def split_step(step: Any, device: str) -> dict[str, float]:
    """One step under torch.profiler: kernel ms by class, and the ms inside catalogue launches."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0, "coda_gemm": 0.0, "coda_aux": 0.0}
    events = prof.events()
    for e in device_kernels(events):
        split[classify(e.name)] += e.time_range.elapsed_us() / 1e3
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA and e.name.startswith("coda::") and not _inside_coda(e):
            split["coda_gemm" if e.name.startswith("coda::gemm") else "coda_aux"] += e.device_time_total / 1e3
    split["kernels"] = split["gemm"] + split["attention"] + split["other"]
    split["fused_share"] = (split["coda_gemm"] + split["coda_aux"]) / split["kernels"] if split["kernels"] else 0.0
    return {k: round(v, 3) for k, v in split.items()}


def device_kernels(events: Any) -> list[Any]:
    """The kernels among a profile's device events, each once.  A record_function range (the
    catalogue's ``coda::`` launches) also appears on the device timeline as a user annotation
    spanning its kernels: counting it adds the range's span to the kernels it holds (H200 run 12:
    the CODA rows' kernel time came to 1.8x the step).  The profiler can also report a kernel the
    DSL launches more than once; one kernel has one name and one start."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation or e.name.startswith("coda::"):
            continue
        key = (e.name, e.time_range.start, e.time_range.end)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _inside_coda(e: Any) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("coda::"):
            return True
        parent = parent.cpu_parent
    return False


def measure(config: str, contender: str, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """ms/step, tokens/s, peak memory and the profiled split of one contender at one config."""
    model, batch, seq = build(config, device, torch.bfloat16)
    model = prepare(model, contender, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen, device=device)
    model.train()

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.time()
    step()
    sync()
    row: dict[str, Any] = {"config": config, "contender": contender, "tokens": batch * seq,
                           "first_step_s": round(time.time() - t0, 1)}
    for _ in range(warmup):
        step()
    sync()
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        t_start = time.time()
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            times.append((a, b))
        sync()
        ms = [a.elapsed_time(b) for a, b in times]
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
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
    row["split_ms"] = split_step(step, device)
    row["cap_ms"] = round(row["ms"] - row["split_ms"]["other"], 2)
    from torch._dynamo.utils import counters

    row["graph_breaks"] = sum(counters["graph_break"].values())
    row["graph_break_reasons"] = sorted({" ".join(r.split("\n")[:2]) for r in counters["graph_break"]})[:10]
    return row


def _p10_p90(ms: list[float]) -> tuple[float, float]:
    s = sorted(ms)
    return s[int(0.1 * (len(s) - 1))], s[int(math.ceil(0.9 * (len(s) - 1)))]


def bigram_corpus(vocab: int, batch: int, seq: int, steps: int, device: str) -> torch.Tensor:
    """(steps, batch, seq) tokens from a fixed random bigram chain (4 likely successors per token)."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    succ = torch.randint(0, vocab, (vocab, 4), generator=gen)
    tok = torch.randint(0, vocab, (steps * batch,), generator=gen)
    out = torch.empty(steps * batch, seq, dtype=torch.long)
    for t in range(seq):
        out[:, t] = tok
        tok = succ[tok, torch.randint(0, 4, tok.shape, generator=gen)]
    return out.view(steps, batch, seq).to(device)


def loss_curve(steps: int, device: str, config: str) -> dict[str, Any]:
    """Per-step training loss of eager fp32, eager bf16 and CODA bf16 on the same corpus and init."""
    import coda_agent

    base, batch, seq = build(config, device, torch.float32)
    data = bigram_corpus(base.config.vocab_size, batch, seq, steps, device)
    curves: dict[str, list[float]] = {}
    for name, dtype, patch in (("eager_fp32", torch.float32, False), ("eager_bf16", torch.bfloat16, False),
                               ("coda_bf16", torch.bfloat16, True)):
        model, _, _ = build(config, device, dtype)
        model.load_state_dict(base.state_dict())
        if patch:
            coda_agent.apply_to_llama(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
        model.train()
        losses = []
        for ids in data:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves[name] = [round(v, 5) for v in torch.stack(losses).float().tolist()]
    fp32 = torch.tensor(curves["eager_fp32"])
    gap = {k: round((torch.tensor(v) - fp32).abs().mean().item(), 5) for k, v in curves.items() if k != "eager_fp32"}
    return {"config": config, "steps": steps, "tokens_per_step": batch * seq, "lr": 1e-3, "curves": curves,
            "mean_abs_gap_to_fp32": gap,
            "coda_vs_eager_bf16_mean_abs": round((torch.tensor(curves["coda_bf16"])
                                                  - torch.tensor(curves["eager_bf16"])).abs().mean().item(), 5)}


def plot(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((out / "loss_curve.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, ys in data["curves"].items():
        ax.plot(range(1, len(ys) + 1), ys, label=f"{name} (mean |gap| to fp32 "
                f"{data['mean_abs_gap_to_fp32'].get(name, 0):.4f})", linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title=f"LLaMA-style {data['config']} config, "
           f"{data['tokens_per_step']} tokens/step: CODA vs eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    return out / "loss_curve.png"


def child(args: argparse.Namespace, device: str, name: str) -> None:
    """The measurement ``name`` (CONFIG:CONTENDER, or curve), its result written under ``args.out``."""
    out = Path(args.out)
    if name == "curve":
        result = loss_curve(args.curve_steps, device, "tiny" if args.dry_run else "curve")
        write_atomic(out / "loss_curve.json", json.dumps(result, indent=1))
        try:
            plot(out)
        except ImportError:
            print("matplotlib is not installed: draw the PNG later with --plot", out)
        return
    config, contender = name.split(":")
    row = measure("tiny" if args.dry_run else config, contender, args.steps, args.warmup, device)
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
    if device != "cuda":
        plan = [(c, k) for c, k in plan if not any(lib in k for lib in CUDA_ONLY)]
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": device, "budget_s": args.budget_s,
                               "steps": args.steps, "warmup": args.warmup, "rows": [], "skipped": []}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    deadline = time.time() + args.budget_s
    # On the CPU (the dry run CI does) each measurement forks from a server that imported torch,
    # transformers and the catalogue once.  On CUDA each one is a fresh interpreter: a fork of a
    # process whose imports touched CUDA cannot initialise CUDA again.
    ctx = multiprocessing.get_context("spawn" if device == "cuda" else "forkserver")
    if device != "cuda":
        ctx.set_forkserver_preload(["torch", "transformers", "coda_agent.kernels.llama"])
    sys.path.insert(0, str(Path(__file__).parent))
    from clocks import ClockSampler

    with ClockSampler() if device == "cuda" else _Nothing() as sampler:
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


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train-step"))
    ap.add_argument("--configs", default="1b,8b", help="of 1b, 8b")
    ap.add_argument("--contenders", default="", help=f"comma-separated of {', '.join(CONTENDERS)}, curve "
                                                       "(default: all)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="wall-clock budget of the whole run")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=3, help="steps after the first (compile) step, untimed")
    ap.add_argument("--curve-steps", type=int, default=200)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny config, reference lowering: the plumbing")
    ap.add_argument("--plot", metavar="DIR", help="draw DIR/loss_curve.json to DIR/loss_curve.png and exit")
    args = ap.parse_args()
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark runs on the H200 (use --dry-run to check the plumbing)")
    return drive(args, "cuda" if not args.dry_run else "cpu")


if __name__ == "__main__":
    sys.exit(main())
