"""Outlier channels: a fresh draw of hidden states as a trained model holds them.

A trained Transformer's hidden states carry outlier features: a few channels
at 20 to 60 times the rest of a row, of one sign down the tokens, and massive
activations near 10^3.  The other draws scale whole rows or whole tensors, so
no element of theirs stands past about 5 times its row's RMS, and a program
that clips there (at 6 times the row's RMS: a guard against overflow, or
outliers cut for a narrower format) passed.  The second fresh draw of every
set (:func:`outlier_inputs`) makes one to three channels of every hidden
state an outlier (:func:`outlier_channels`): the same columns in every tensor of that width
(an activation, the residual it joins and a backward's saved copy are the
same channels), each shifted by the tensor's spread one way and scaled by 8
to 64.  Hidden states are the float inputs of role ``activation``,
``residual`` and ``saved`` with rows of at least 8 columns (a backward reads
the forward's hidden state as ``saved``; a per-row statistic is one column and
stays as drawn); fp8 inputs keep their format's draw.  A fresh draw, not the
edge rows': there rows at 2^5 already set every bar, and the logits an LM
head computes from outlier-led hidden states rank their top class at p > 0.999
nearly always, which starved the predicted targets the edge draw holds (a
program dropping the gradient of tokens predicted at p in (0.5, 0.999) was
rejected in 2 edge draws in 12 with them, 9 in 12 without), and the honest
mlp_block_fp8 expert's weight gradient exceeded the bar in about 6 edge draws
in 100 (an outlier sets a whole row's fp8 scale, and the edge rows' varied eps
moves its roundings), where in a fresh draw of their own the fp8 experts pass
every draw of 600.  Tasks whose GEMMs run in fp8 get them too: there an
outlier is what a recipe's scale must survive, and clipping before the
quantization (finer steps for the ordinary channels) is rejected.
"""

from __future__ import annotations

import torch

from coda_agent.tasks.spec import FLOAT_DTYPES, TaskSpec
from coda_agent.verifier.inputs import make_inputs

ROLES = ("activation", "residual", "saved")  # a hidden state's roles: the tensors outlier features live in
OUTLIERS = (1, 3)  # channels per width made outliers, at least and at most
OUTLIER_SCALE = (3.0, 6.0)  # each scaled by 2**u, u uniform in this range (8 to 64 times)


def outlier_channels(spec: TaskSpec, inputs: dict[str, torch.Tensor], gen: torch.Generator
                     ) -> dict[str, torch.Tensor]:
    """``inputs`` with :data:`OUTLIERS` channels of every hidden state (:data:`ROLES`, module
    docstring): the same columns in every tensor with the same last size, each shifted by the
    tensor's spread one way and scaled by 2**u, u uniform in :data:`OUTLIER_SCALE`."""
    out = dict(inputs)
    picked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, t in spec.inputs.items():
        x = inputs[name]
        if t.role not in ROLES or t.dtype not in FLOAT_DTYPES or t.dtype.startswith("fp8") or x.ndim < 2 \
                or x.shape[-1] < 8 or x.numel() == 0:
            continue
        n = x.shape[-1]
        if n not in picked:
            cols = torch.randperm(n, generator=gen, device=gen.device)[:int(torch.randint(
                OUTLIERS[0], OUTLIERS[1] + 1, (1,), generator=gen, device=gen.device))]
            lo, hi = OUTLIER_SCALE
            scale = torch.exp2(lo + (hi - lo) * torch.rand(len(cols), generator=gen, device=gen.device))
            sign = torch.where(torch.rand(len(cols), generator=gen, device=gen.device) < 0.5, -1.0, 1.0)
            picked[n] = (cols, scale, sign)
        cols, scale, sign = (v.to(x.device) for v in picked[n])
        xf = x.float().clone()
        spread = float(xf.std()) if xf.numel() > 1 else 1.0
        xf[..., cols] = (xf[..., cols] + sign * spread) * scale
        out[name] = xf.to(x.dtype)
    return out


def outlier_inputs(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """:func:`.inputs.make_inputs` with outlier channels in every hidden state (module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x0D71)
    return outlier_channels(spec, make_inputs(spec, shape_set, seed, device), gen)
