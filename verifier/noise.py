"""More samples of the reference's own rounding noise, for the elements one sample cannot bound.

The judge's bar is the reference's own error, ``ref_lo - ref_hi``
(:mod:`.compare`): a program may err by ``factor`` times the largest of it.
Over many elements of about the same noise that largest error is a steady
statistic: the extreme of thousands of samples.  Where a few elements carry
most of a tensor's noise it is one sample of one element's error, as likely
small as large: a weight gradient's column fed by an outlier feature (a
hidden-state channel at 8 to 64 times the row's RMS, constant in sign over
the tokens) sums thousands of roundings into one value hundreds of times the
others, and the reference's error there is one draw of that sum's noise.  An
honest program with errors of the same size as the reference's then exceeds
twice the reference's in about three draws in ten (two half-normals' ratio):
the GPT-2 MLP block's dgamma did, in 10 of 16 checks with outlier channels.

So a result that fails the first look gets a second one: the judge nudges
every float input by at most an ulp of its dtype (each element times
``1 + eps * u``, u uniform in [-1, 1], rounded back: the inputs stay a draw of
the same distribution, and every rounding downstream lands elsewhere) and
every float param by as much at the ulp of the coarsest dtype the results
round to (fp8 aside), runs both references on the nudged call, and keeps
``ref_lo - ref_hi`` there as another sample of the reference's noise at each
element.  With :data:`SAMPLES` of them :func:`sample_noise` summarises, per
result, the per-element RMS of the noise (the original sample included), the
RMS of its norm, and the largest mean and standard error of the mean over the
samples; :func:`.compare.compare` then lets an element err by ``factor *``
:data:`SIGMAS` of its own noise RMS where that exceeds the first look's bar,
and a result's mean by ``dense_factor`` times the largest sample's.
An honest program with the reference's noise fails that with the probability
of a Student t with ``SAMPLES + 1`` degrees of freedom beyond 6: about 2e-4 an
element.  Elements of ordinary noise keep the first look's bar (six of their
own sigmas is below twice the extreme of thousands), so a program wrong there
gains nothing from the second look; it costs ``2 * SAMPLES`` reference runs,
paid only by a result that failed the first.

The params move too because some results are pinned by a param, not by the
inputs.  A clamp's bound or a cap that most elements saturate at makes a
tensor of a few distinct values whose roundings no nudge of the inputs moves:
the reference's error there is one draw, the same in every sample.  Where a
weight gradient sums such a tensor against gradients of one sign (a clamped
SwiGLU's activation at large magnitudes, dW_down = dy^T @ act), that draw,
lucky or not, set both the bias and the per-column errors allowed, and an
honest program that rounds the bound once (as torch's clamp of a bf16 tensor
does) failed half of such draws.  Nudged by an ulp, the bound's rounding
lands elsewhere in every sample: the bars then hold the spread of the
reference's rounding there, about an ulp of the saturated values, so an
error of a few ulps of them passes the second look where it is all the
noise there is, and a larger one still fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SAMPLES = 8  # nudged draws of the reference's noise a second look takes
SIGMAS = 3.0  # an element may err by factor * SIGMAS of its own noise RMS (6 at the default factor 2)


@dataclass
class Noise:
    """The reference's noise on one result over the original draw and :data:`SAMPLES` nudged ones."""

    rms: torch.Tensor  # per element, the RMS of ref_lo - ref_hi over the samples (non-finite as 0)
    norm: float  # the RMS over the samples of ||ref_lo - ref_hi||
    mean: float  # the largest |mean(ref_lo - ref_hi)| of a sample
    se: float  # the largest standard error of the mean of a sample (compare.mean_noise)


def nudged(tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every float tensor with each element times ``1 + eps * u`` (u uniform in [-1, 1], eps its
    dtype's), rounded back to its dtype; zeros, infinities and integer tensors as they are."""
    out = {}
    for k, v in tensors.items():
        if not v.is_floating_point() or v.numel() == 0:
            out[k] = v
            continue
        u = torch.rand(v.shape, generator=gen, device=v.device, dtype=torch.float64) * 2.0 - 1.0
        wide = torch.float64 if v.dtype == torch.float64 else torch.float32
        out[k] = (v.to(wide) * (1.0 + torch.finfo(v.dtype).eps * u.to(wide))).to(v.dtype)
    return out


def nudged_params(params: dict[str, Any], ulp: float, gen: torch.Generator) -> dict[str, Any]:
    """Every float param times ``1 + ulp * u`` (u uniform in [-1, 1]); the others as they are."""
    out = dict(params)
    for k, v in params.items():
        if isinstance(v, float) and v != 0.0 and math.isfinite(v):
            u = float(torch.rand((), generator=gen, device=gen.device, dtype=torch.float64)) * 2.0 - 1.0
            out[k] = v * (1.0 + ulp * u)
    return out


def _errors(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    work = torch.float64 if hi.device.type == "cpu" else torch.float32
    e = lo.to(hi.device, work) - hi.to(work)
    return torch.where(torch.isfinite(e), e, torch.zeros_like(e))


def sample_noise(task, inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None,
                 params: dict[str, Any], hi_dtype: torch.dtype, seed: int, hi: dict[str, torch.Tensor],
                 lo: dict[str, torch.Tensor], names: list[str]) -> dict[str, Noise]:
    """The reference's noise on the float results ``names`` (module docstring), from the original
    draw's ``hi``/``lo`` references and :data:`SAMPLES` nudged draws of ``inputs`` and ``grads``;
    accumulated draw by draw, so it holds one result's worth of memory beyond the references."""
    from coda_agent.verifier.compare import mean_noise, norm64  # compare imports this module
    from coda_agent.verifier.inputs import run_reference

    names = [n for n in names if hi[n].is_floating_point()]
    first = {n: _errors(lo[n], hi[n]) for n in names}
    sumsq = {n: first[n].square() for n in names}
    norms = {n: [float(norm64(first[n]))] for n in names}
    means = {n: [_mean(first[n])] for n in names}
    ses = {n: [mean_noise(first[n], first[n].numel())] for n in names}
    del first
    device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x901CE)
    # An fp8 result's ulp (1/8 at e4m3) would move a param far past its own rounding: the
    # params enter the math through 16- and 32-bit ops.
    ulp = max((torch.finfo(t.dtype).eps for t in lo.values() if t.is_floating_point() and t.element_size() > 1),
              default=0.0)
    for _ in range(SAMPLES):
        x = nudged(inputs, gen)
        g = nudged(grads, gen) if grads else None
        p = nudged_params(params, ulp, gen)
        ref_hi = run_reference(task, x, g, hi_dtype, params=p)
        ref_lo = run_reference(task, x, g, None, params=p)
        for n in names:
            e = _errors(ref_lo[n], ref_hi[n])
            sumsq[n] += e.square()
            norms[n].append(float(norm64(e)))
            means[n].append(_mean(e))
            ses[n].append(mean_noise(e, e.numel()))
        del ref_hi, ref_lo
    k = SAMPLES + 1
    return {n: Noise(rms=(sumsq[n] / k).sqrt(), norm=(sum(v * v for v in norms[n]) / k) ** 0.5,
                     mean=max(means[n]), se=max(ses[n])) for n in names}


def _mean(e: torch.Tensor) -> float:
    return abs(float(e.sum())) / max(e.numel(), 1)
