"""The judge's precision where a result's own precision sets the bar: the fp64 reference kept
through a reference's casts to fp32, an fp32 result's last bits, and the typical element of a
result whose max rule is widened."""

from __future__ import annotations

from pathlib import Path

import torch

from coda_agent.tasks.spec import Tolerance, load_task
from coda_agent.verifier.compare import compare
from coda_agent.verifier.inputs import make_inputs, run_reference

OLMO = Path(__file__).parent / "tasks" / "families" / "olmo" / "olmo_ln_qkv.yaml"


def test_the_high_reference_keeps_its_precision_through_the_references_casts_to_fp32():
    """OLMo's reference, ported from HF, upcasts with ``x.to(torch.float32)`` and returns its row
    statistics in fp32: the judge's fp64 reference computes them in fp64 all the same (so the
    bf16 reference's fp32 rounding shows as its noise), and leaves the default dtype as it was."""
    t = load_task(OLMO)
    x = make_inputs(t.spec, "small", 0)
    hi, lo = run_reference(t, x, None, torch.float64), run_reference(t, x, None, None)
    assert hi["rstd"].dtype == torch.float64 and lo["rstd"].dtype == torch.float32
    xd = x["x"].double()
    exact = torch.rsqrt(xd.var(-1, unbiased=False) + t.spec.params["eps"])
    assert torch.allclose(hi["rstd"], exact, rtol=1e-12, atol=0)
    noise = (lo["rstd"].double() - hi["rstd"]).abs().max()
    assert 0 < noise <= 1e-6 * exact.abs().max()
    assert torch.get_default_dtype() == torch.float32


def test_an_fp32_result_may_differ_from_an_fp32_reference_in_its_last_bits():
    """On the GPU the judge's reference is fp32: a result that the reference computes wholly in
    fp32 has no noise of its own there (lo equals hi), and an honest program that sums in another
    order differs in the last bits; 2^-20 of each element's value is allowed, and an error of
    2^-14 of it (a value computed in a lower precision, in part) still fails."""
    g = torch.Generator().manual_seed(4)
    hi = (torch.randn(300, generator=g) * 2.0 ** torch.randint(-12, 12, (300,), generator=g)).float()
    sign = torch.where(torch.rand(300, generator=g) < 0.5, -1.0, 1.0)
    ulps = torch.nextafter(torch.nextafter(hi, hi + sign * hi.abs()), hi + sign * hi.abs())  # 2 ulps away
    assert compare("rstd", "s", ulps, hi, hi.clone(), Tolerance()) is None
    coarse = hi * (1.0 + sign * 2.0 ** -14)
    m = compare("rstd", "s", coarse, hi, hi.clone(), Tolerance())
    assert m is not None and m.max_abs_err > m.allowed, m


def test_a_widened_max_rule_keeps_the_typical_element_to_the_references_precision():
    """A kink's tolerance (max rule 1000x, norm rule 6%) lets a handful of flipped elements through,
    and every element rounded to fp8's 4 significant bits (3% RMS) would pass those two rules as
    well; the median element's relative error, 4x the bf16 reference's at most, tells them apart."""
    g = torch.Generator().manual_seed(5)
    hi = torch.randn(256, 512, generator=g, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    kink = Tolerance(factor=1000, norm_factor=2, rel_norm=0.06)
    flipped = lo.clone()
    flipped[torch.randint(0, 256, (40,), generator=g), torch.randint(0, 512, (40,), generator=g)] += 0.5
    assert compare("dx", "s", flipped, hi, lo, kink) is None
    fp8 = hi.to(torch.float8_e4m3fn).to(torch.bfloat16)
    m = compare("dx", "s", fp8, hi, lo, kink)
    assert m is not None and "the typical element errs by" in m.pattern, m
    assert compare("dx", "s", fp8, hi, lo, Tolerance(factor=1000, rel_norm=0.06)) is not None  # factor alone too
