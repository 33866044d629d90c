"""Does a patched model train like the unpatched one?  Loss curves of the real kernels.

``bench/train_step.py`` times steps; this module trains a small LLaMA-3-style
``LlamaForCausalLM`` (the ``curve`` config of train_step: 4 layers, H 512, bytes
as tokens) for 200 steps on the bytes of Python's standard library sources (the
corpus of ``bench/fp8_loss.py``), AdamW with a 20-step warm-up and a cosine
decay, and records every step's loss, for:

- ``eager_fp32``, ``eager_bf16``: the unpatched model; their gap is the bf16
  noise the bf16 rows are read against;
- ``coda_bf16``: ``coda_agent.apply_to_llama(model)``;
- ``torchao_rowwise``: torchao's float8 training, rowwise scales, every linear
  but the LM head (``convert_to_float8_training``), the fp8 anchor;
- ``coda_fp8``: ``apply_to_llama(model, fp8_mlp=True)``: the fp8 experts' MLP
  kernels (delayed per-tensor scales from an amax history, rowwise operands).

Every row of seed 0 starts from the same weights and sees the same batches.
The fp8 rows also run at seeds 1 .. ``band_seeds - 1`` (other initial
weights): the spread of torchao's final losses (the mean of the last 20 steps)
is the noise band CODA's fp8 rows are judged against
(``fp8_loss.band_verdict``), and CODA's own seeds show whether its spread is
torchao's.  ``bench/fp8_loss.py`` compares the fp8 *recipes*, emulated in
PyTorch; this compares the *kernels* a user would train with.

Unlike the timed rows, the curves run eagerly (nothing here is about speed),
in one process, so the catalogue's kernels compile once for every seed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_loss import band_keys, band_verdict, corpus  # noqa: E402

TAIL = 20  # steps whose mean loss is a run's final loss
LR, WARMUP = 2e-3, 20  # peak rate after a linear warm-up, then a cosine decay to 0 at the last step
FP8_ROWS = ("torchao_rowwise", "coda_fp8")


def byte_batches(batch: int, seq: int, steps: int, device: str) -> torch.Tensor:
    """(steps, batch, seq) windows of the standard library's Python sources as bytes (the corpus
    of ``fp8_loss``), the same on every machine and for every row."""
    data = corpus(4 << 20)
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(data) - seq, (steps * batch,), generator=gen)
    return torch.stack([data[s:s + seq] for s in starts.tolist()]).view(steps, batch, seq).to(device)


def _patch(name: str, model: Any) -> None:
    if name == "torchao_rowwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
    elif name.startswith("coda"):
        import coda_agent

        coda_agent.apply_to_llama(model, fp8_mlp=name == "coda_fp8")


def _train(model: Any, data: torch.Tensor, device: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    steps = len(data)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [round(v, 5) for v in torch.stack(losses).float().tolist()]


def runs(fp8: bool, band_seeds: int) -> list[tuple[str, int]]:
    """(row, seed) in the order they train: every row at seed 0, then the fp8 rows' other seeds."""
    rows = ["eager_fp32", "eager_bf16", "coda_bf16", *(FP8_ROWS if fp8 else ())]
    return [(r, 0) for r in rows] + [(r, s) for s in range(1, band_seeds if fp8 else 1) for r in FP8_ROWS]


def loss_curves(steps: int, device: str, config: str, build: Callable[..., tuple[Any, int, int]],
                fp8: bool = True, band_seeds: int = 3) -> dict[str, Any]:
    """Per-step training loss of every row of :func:`runs` (``build(config, device, dtype, seed)``
    makes the model); a failing row is recorded by its error, the others still train."""
    base, batch, seq = build(config, device, torch.float32)
    data = byte_batches(batch, seq, steps, device)
    curves: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for name, seed in runs(fp8, band_seeds):
        key = f"{name}/{seed}"
        model, _, _ = build(config, device, torch.float32 if name == "eager_fp32" else torch.bfloat16, seed)
        if seed == 0:
            model.load_state_dict(base.state_dict())
        try:
            _patch(name, model)
            curves[key] = _train(model, data, device)
        except Exception as e:  # noqa: BLE001 - one row's failure is recorded, not the end of the rest
            errors[key] = f"{type(e).__name__}: {str(e)[:400]}"
        del model
    return summarize(curves, errors, config, steps, batch * seq)


def summarize(curves: dict[str, list[float]], errors: dict[str, str], config: str, steps: int,
              tokens: int) -> dict[str, Any]:
    def gap(a: str, b: str) -> float | None:
        if a not in curves or b not in curves:
            return None
        return round((torch.tensor(curves[a]) - torch.tensor(curves[b])).abs().mean().item(), 5)

    final = {k: round(sum(v[-TAIL:]) / len(v[-TAIL:]), 5) for k, v in curves.items()}
    band, verdict = band_verdict(final, band_keys(final))
    return {"config": config, "steps": steps, "tokens_per_step": tokens, "lr": LR, "warmup": WARMUP, "curves": curves,
            "errors": errors, "final_loss": final,
            # from the same initial weights only: another seed's gap is its initialisation's
            "mean_abs_gap_to_fp32": {k: gap(k, "eager_fp32/0") for k in curves
                                     if k.endswith("/0") and k != "eager_fp32/0"},
            "coda_vs_eager_bf16_mean_abs": gap("coda_bf16/0", "eager_bf16/0"),
            "coda_fp8_vs_torchao_mean_abs": gap("coda_fp8/0", "torchao_rowwise/0"),
            "torchao_rowwise_band": band,
            "fp8_verdict_vs_band": {k: v for k, v in verdict.items() if k.startswith("coda_fp8/")}}


def plot(out: Path) -> Path:
    """OUT/loss_curve.json drawn to OUT/loss_curve.png (matplotlib, the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((out / "loss_curve.json").read_text())
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, ys in data["curves"].items():
        other_seed = not name.endswith("/0")
        ax.plot(range(1, len(ys) + 1), ys, linewidth=0.7 if other_seed else 1.1, linestyle=":" if other_seed else "-",
                label=f"{name} (final {data['final_loss'][name]:.3f})")
    ax.set(xlabel="step", ylabel="training loss", title=f"LLaMA-style {data['config']} config, "
           f"{data['tokens_per_step']} tokens/step: CODA's kernels against eager and torchao")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    return out / "loss_curve.png"
