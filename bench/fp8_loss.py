"""FP8 recipes compared by what they do to training: loss curves on a small LLaMA.

Issue 21 asks which scale an epilogue should quantize with when it writes an
fp8 GEMM operand itself.  A row's *current* amax spans every N tile of the
GEMM that produces it, so an epilogue cannot use it.  The candidates:

- ``coda_delayed``: a per-tensor scale from an amax history (TransformerEngine's
  delayed scaling: ``448 / max(history)``, 16 steps, the epilogue reduces each
  step's amax for free);
- ``coda_rowscale``: a per-row scale known before the GEMM, moved past it the
  way CODA moves RMSNorm's ``r``: the row's bound ``sqrt(H) * max|gamma| *
  rms(row)`` (``|x_i| <= sqrt(H) * rms(x)`` for any row), with the rms of the
  residual stream one addition earlier (which the block has already computed);
- ``coda_tileblock``: a current scale per (row, 128-column block), tile-local,
  but its consumer needs a GEMM that scales per K block inside the mainloop
  (SM100's block-scaled MMA; quack's SM90 mainloop has no such hook), so it is
  emulated here to learn what it would buy.

Every other GEMM operand of the coda rows (weights, the attention output,
SwiGLU's output, gradients) gets current row-wise scales along its GEMM's K,
which an auxiliary cast computes (``tasks/llama3_fp8/references.py``).  The
anchors: ``bf16`` and torchao's float8 training, ``torchao_rowwise`` and
``torchao_tensorwise`` (``convert_to_float8_training``).  The noise band is the
spread of ``--band-seeds`` runs of ``torchao_rowwise`` (same data, other
initializations).

The model is LLaMA-shaped (RMSNorm, SwiGLU, GQA with SDPA, RoPE, untied LM
head), trained on the bytes of Python's standard library sources (on every
machine, deterministic order) with AdamW.  The coda rows emulate the recipes'
numerics in PyTorch (fp8 round trips, fp32 GEMMs): they measure numerics, not
speed.  Results go to ``OUT/loss.jsonl`` as they come (one line per step);
``--plot`` renders ``OUT/loss.png`` (matplotlib) and ``OUT/summary.json``.
Usage on the device (about 4 minutes for the default 200 steps, seven runs)::

    python3 bench/fp8_loss.py OUT --steps 200
    python3 bench/fp8_loss.py OUT --plot          # where matplotlib is
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from coda_agent.storage import write_atomic
from coda_agent.tasks.llama3_fp8 import references as R

RECIPES = ("bf16", "torchao_rowwise", "torchao_tensorwise", "coda_delayed", "coda_rowscale",
           "coda_tileblock")
HISTORY = 16  # delayed scaling's amax history (steps)
BLOCK = 128  # coda_tileblock's column block


@dataclass(frozen=True)
class Config:
    layers: int = 4
    hidden: int = 512
    inter: int = 1408
    heads: int = 8
    kv_heads: int = 4
    seq: int = 256
    batch: int = 32
    vocab: int = 256  # bytes
    lr: float = 2e-3
    warmup: int = 20


CONFIGS = {"small": Config(),  # the H200's: 16 x 256 tokens x 4 layers of H = 512
           "mini": Config(layers=2, hidden=128, inter=384, heads=4, kv_heads=2, seq=128, batch=8),  # a CPU's
           "tiny": Config(layers=2, hidden=64, inter=192, heads=2, kv_heads=1, seq=64, batch=4)}  # --dry-run


# --------------------------------------------------------------------------- data


def corpus(nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the standard library's .py files, sorted by path."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(lib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        out += path.read_bytes()
        if len(out) >= nbytes:
            break
    return torch.frombuffer(out[:nbytes], dtype=torch.uint8).long()


def batches(data: torch.Tensor, cfg: Config, steps: int) -> list[torch.Tensor]:
    """Fixed batches (every recipe sees the same ones): (batch, seq + 1) windows."""
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(data) - cfg.seq - 1, (steps, cfg.batch), generator=gen)
    return [torch.stack([data[s:s + cfg.seq + 1] for s in row.tolist()]) for row in starts]


# --------------------------------------------------------------------------- epilogue quantizers


class EpilogueScales:
    """The scale an epilogue quantizes its fp8 output with, per recipe, and the
    state that recipe keeps: the amax history of delayed scaling, the residual
    stream's last rms for the row-scale bound."""

    def __init__(self, recipe: str):
        self.recipe = recipe
        self.history: dict[str, list[float]] = {}
        self.last_rms: torch.Tensor | None = None
        self.saturated = 0
        self.elements = 0

    def begin_forward(self) -> None:
        self.last_rms = None  # the entry norm's kernel sees its whole row: its scale is exact

    def quantize(self, name: str, h: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """h * gamma (rows, H) after the epilogue's fp8 store; straight-through."""
        v = h * gamma
        with torch.no_grad():
            rms = h.float().pow(2).mean(-1).sqrt()
            if self.recipe == "coda_tileblock":
                q = _tile_block_round_trip(v.float())
            else:
                qscale = self._qscale(name, v, gamma, rms if self.last_rms is None else self.last_rms)
                scaled = v.float() * qscale
                self.saturated += int((scaled.abs() > R.fp8_max(R.E4M3)).sum())
                self.elements += scaled.numel()
                q = R.saturate(scaled, R.E4M3) / qscale
            self.last_rms = rms
        return v + (q.to(v.dtype) - v).detach()

    def _qscale(self, name: str, v: torch.Tensor, gamma: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
        fmax = R.fp8_max(R.E4M3)
        if self.recipe == "coda_rowscale":
            bound = math.sqrt(v.shape[-1]) * gamma.float().abs().max() * rms
            return (fmax / bound.clamp_min(R.EPS))[:, None]
        amax = float(v.float().abs().max())
        hist = self.history.setdefault(name, [])
        # The first step has no history: it uses its own amax (TransformerEngine starts at
        # scale 1 and corrects after a step; starting right avoids one garbage step).
        scale = fmax / max(max(hist or [amax]), R.EPS)
        hist.append(amax)
        del hist[:-HISTORY]
        return torch.tensor(scale, device=v.device)


def _tile_block_round_trip(v: torch.Tensor) -> torch.Tensor:
    rows, cols = v.shape
    pad = -cols % BLOCK
    blocks = F.pad(v, (0, pad)).view(rows, -1, BLOCK)
    scale = R.rowwise_scale(blocks.abs().amax(-1), R.E4M3)[..., None]
    return (R.saturate(blocks / scale, R.E4M3) * scale).view(rows, -1)[:, :cols]


# --------------------------------------------------------------------------- the model


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (B, heads, S, D) by pos * theta^(-2i/D)."""
    d = x.shape[-1]
    inv = 500000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    c, s = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.hidden // cfg.heads
        self.cfg, self.d = cfg, d
        self.norm_attn = nn.Parameter(torch.ones(cfg.hidden))
        self.norm_mlp = nn.Parameter(torch.ones(cfg.hidden))
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * d, bias=False)
        self.o = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.inter, bias=False)  # rows [g0, u0, g1, u1, ...]
        self.down = nn.Linear(cfg.inter, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor, mm: Callable, epi: EpilogueScales | None, idx: int
                ) -> torch.Tensor:
        cfg, d = self.cfg, self.d
        b, s, _ = h.shape
        x = self._norm_linear(h, self.norm_attn, self.qkv, mm, epi, f"{idx}.attn")
        q, k, v = x.view(b, s, -1, d).transpose(1, 2).split((cfg.heads, cfg.kv_heads, cfg.kv_heads), 1)
        pos = torch.arange(s, device=h.device)
        a = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, is_causal=True,
                                           enable_gqa=True)
        h = h + mm(a.transpose(1, 2).reshape(b, s, -1), self.o)
        gu = self._norm_linear(h, self.norm_mlp, self.gate_up, mm, epi, f"{idx}.mlp")
        return h + mm(F.silu(gu[..., 0::2]) * gu[..., 1::2], self.down)

    def _norm_linear(self, h: torch.Tensor, gamma: torch.Tensor, lin: nn.Linear, mm: Callable,
                     epi: EpilogueScales | None, name: str) -> torch.Tensor:
        """RMSNorm(h) @ W^T.  With an epilogue recipe, CODA's form: the producing
        epilogue stores h * gamma in fp8 and the GEMM's epilogue multiplies by r = rstd(h),
        which its input keeps for the backward (the experts' recipe,
        tasks/llama3_fp8/references.py): the weight gradient reads RMSNorm's output per
        feature and the incoming gradient without r."""
        hf = h.float()
        r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
        if epi is None:
            return mm((hf * r).to(h.dtype) * gamma, lin)
        rows = h.reshape(-1, h.shape[-1])
        hg = epi.quantize(name, rows, gamma)
        return mm(hg.view_as(h).float() * r, lin, on_grid=True).to(h.dtype)


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden))
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, mm: Callable, epi: EpilogueScales | None) -> torch.Tensor:
        h = self.embed(tokens)
        if epi is not None:
            epi.begin_forward()
        for i, layer in enumerate(self.layers):
            h = layer(h, mm, epi, i)
        hf = h.float()
        h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * self.norm
        return F.linear(h, self.head.weight)  # the LM head stays in bf16 (as torchao's recipes leave it)


def plain_mm(x: torch.Tensor, lin: nn.Linear, on_grid: bool = False) -> torch.Tensor:
    return lin(x)


def fp8_mm(x: torch.Tensor, lin: nn.Linear, on_grid: bool = False) -> torch.Tensor:
    """The coda rows' GEMM: row-wise current fp8 operands (``x`` as it is when an
    epilogue already stored it in fp8), fp32 accumulate, bf16 result."""
    rows = x.reshape(-1, x.shape[-1])
    y = R.linear(rows, lin.weight, lowp=True, x_on_grid=on_grid)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


# --------------------------------------------------------------------------- training


def build(recipe: str, cfg: Config, seed: int, device: str) -> tuple[nn.Module, Callable, EpilogueScales | None]:
    torch.manual_seed(seed)
    model = Model(cfg).to(device=device, dtype=torch.bfloat16)
    if recipe.startswith("torchao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe.removeprefix("torchao_"))
        # Every linear of the layers; the LM head stays bf16 in every row.
        convert_to_float8_training(model.layers, config=config)
        return model, plain_mm, None
    if recipe.startswith("coda_"):
        return model, fp8_mm, EpilogueScales(recipe)
    return model, plain_mm, None


def train(recipe: str, cfg: Config, data: list[torch.Tensor], seed: int, device: str,
          emit: Callable[[dict], None], deadline: float) -> None:
    model, mm, epi = build(recipe, cfg, seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = len(data)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    for step, batch in enumerate(data):
        if time.time() > deadline:
            emit({"recipe": recipe, "seed": seed, "stopped": "time budget", "step": step})
            return
        t0 = time.perf_counter()
        tokens = batch.to(device)
        logits = model(tokens[:, :-1], mm, epi)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if device == "cuda":
            torch.cuda.synchronize()
        row = {"recipe": recipe, "seed": seed, "step": step, "loss": loss.item(),
               "ms": round((time.perf_counter() - t0) * 1e3, 2)}
        if epi is not None and epi.elements:
            row["saturated"] = epi.saturated / epi.elements
        emit(row)


def run(out: Path, recipes: list[str], cfg: Config, steps: int, band_seeds: int, device: str,
        budget_s: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "loss.jsonl"
    data = batches(corpus(4 << 20), cfg, steps)
    deadline = time.time() + budget_s
    with path.open("w") as fh:
        def emit(row: dict) -> None:
            fh.write(json.dumps(row) + "\n")
            fh.flush()

        emit({"config": asdict(cfg), "steps": steps, "device": device, "torch": torch.__version__})
        runs = [(r, 0) for r in recipes] + [("torchao_rowwise", s) for s in range(1, band_seeds)]
        for recipe, seed in runs:
            try:
                train(recipe, cfg, data, seed, device, emit, deadline)
            except Exception as e:  # noqa: BLE001 - one recipe's failure is a line, not the end
                emit({"recipe": recipe, "seed": seed, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return path


# --------------------------------------------------------------------------- summary and plot


def band_keys(final: dict[str, float]) -> list[str]:
    """The runs whose spread is the noise band: torchao rowwise at every seed."""
    return [k for k in final if k.startswith("torchao_rowwise/")]


def band_verdict(final: dict[str, float], band: list[str]) -> tuple[list[float | None], dict[str, str]]:
    """The noise band, [min, max] of the final losses of the runs ``band`` names (one recipe, other
    seeds), and each run's place against it: ``within`` (the band widened by its own width on
    each side, since a few seeds sample the spread, not bound it), ``better`` or ``worse``."""
    values = [final[k] for k in band]
    if not values:
        return [None, None], {}
    lo, hi = min(values), max(values)
    width = hi - lo  # one seed: no width, the run must match it
    return [lo, hi], {k: "within" if lo - width <= v <= hi + width else ("better" if v < lo else "worse")
                      for k, v in final.items()}


def summarize(path: Path, tail: int = 20) -> dict:
    """Final loss (mean of the last ``tail`` steps) per run, the noise band of the
    torchao_rowwise seeds, and which rows land inside it."""
    curves: dict[tuple[str, int], list[float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            curves.setdefault((row["recipe"], row["seed"]), []).append(row["loss"])
    final = {f"{r}/{s}": sum(c[-tail:]) / len(c[-tail:]) for (r, s), c in curves.items()}
    seeds = band_keys(final)
    band, verdict = band_verdict(final, seeds)
    return {"final_loss": final, "torchao_rowwise_band": band, "band_seeds": len(seeds),
            "verdict_vs_band": verdict, "steps": {f"{r}/{s}": len(c) for (r, s), c in curves.items()}}


def plot(path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            curves.setdefault(f"{row['recipe']} (seed {row['seed']})", []).append((row["step"], row["loss"]))
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for name, pts in sorted(curves.items()):
        steps, losses = zip(*pts)
        k = 10  # a moving average keeps the curves readable; the raw points stay in loss.jsonl
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        band = name.startswith("torchao_rowwise") and "seed 0" not in name
        ax.plot(steps, smooth, label=name, linewidth=0.8 if band else 1.4, linestyle=":" if band else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, moving average of 10)")
    ax.set_title("FP8 recipes on a small LLaMA (bytes of the Python stdlib)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for loss.jsonl, summary.json and loss.png")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--config", choices=sorted(CONFIGS), default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--band-seeds", type=int, default=3,
                    help="torchao_rowwise runs (seeds 0..N-1) whose spread is the noise band")
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting steps after this long")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the mini config (about 20 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, the tiny config: checks the plumbing")
    ap.add_argument("--plot", action="store_true", help="only render OUT/loss.png and OUT/summary.json")
    args = ap.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        ap.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    path = args.out / "loss.jsonl"
    if not args.plot:
        device = "cpu" if args.dry_run else args.device
        cfg = CONFIGS["tiny" if args.dry_run else args.config]
        path = run(args.out, recipes, cfg, args.steps, args.band_seeds, device, args.budget_s)
    elif not path.is_file():
        ap.error(f"{path} does not exist; run without --plot first")
    summary = summarize(path)
    write_atomic(args.out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary["verdict_vs_band"]))
    try:
        plot(path, args.out / "loss.png")
    except ImportError:
        print("matplotlib is not installed here: run --plot where it is", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
