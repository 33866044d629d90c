"""``expm1`` in the math vocabulary, on the CPU: within a few fp32 roundings of fp64's
``torch.expm1`` from subnormal arguments to overflow, where ``exp(x) - 1.0`` loses the digits of
a small result; on Python numbers; an ELU epilogue in a GEMM under the reference lowering against
``F.elu``; and traced and compiled for sm_90a under the cute lowering with no slow-path CALL.
The GPU tier (tests/test_primitives_gpu.py) holds the two lowerings to each other."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from coda_agent.primitives import TileConfig, compile_only, exp, expm1, gemm, load_program, lowering


def sweep(dtype: torch.dtype) -> torch.Tensor:
    """Both signs of 1e-40 (subnormal in fp32) to 88 (e**88 is near fp32's largest), densely
    through the series' edge at 0.5, and the far negative side, where e**x - 1 is -1."""
    mags = torch.logspace(-40, math.log10(88.0), 4001, dtype=torch.float64)
    near = torch.linspace(-0.6, 0.6, 2401, dtype=torch.float64)
    return torch.cat([mags, -mags, near, torch.tensor([0.0, -1e4, -200.0], dtype=torch.float64)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relative_error_is_a_few_roundings_everywhere(dtype):
    """Relative to fp64's expm1: at most 6 fp32 roundings in fp32, where exp(x) - 1.0 errs by whole
    percent at 1e-7 and wholly below fp32's epsilon; in fp64 the series' truncation at |x| = 1/2,
    under 1e-9 (the vocabulary computes in fp32: fp64 is the reference lowering's numbers path)."""
    x = sweep(dtype)
    got, want = expm1(x), torch.expm1(x.double())
    assert got.dtype == dtype and torch.isfinite(got).all()
    rel = ((got.double() - want).abs() / want.abs().clamp_min(1e-300)).max().item()
    assert rel < (6 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 1e-9), rel
    small = x.abs() < 1e-7
    naive = ((exp(x[small]) - 1.0).double() - want[small]).abs() / want[small].abs().clamp_min(1e-300)
    if dtype == torch.float32:
        assert naive.max().item() > 0.1  # the subtraction it replaces, for scale


def test_numbers_and_edges():
    assert expm1(0.0) == 0.0 and expm1(1e-10) == pytest.approx(1e-10, rel=1e-15)
    assert expm1(1.0) == pytest.approx(math.e - 1.0, rel=1e-15) and expm1(-1e4) == -1.0
    edge = torch.tensor([float("inf"), float("-inf"), float("nan")])
    got = expm1(edge)
    assert got[0] == float("inf") and got[1] == -1.0 and torch.isnan(got[2])


ELU = '''
from coda_agent.primitives import epilogue, expm1, where


@epilogue()
def elu(acc):
    return {"D": where(acc > 0.0, acc, 1.7 * expm1(acc))}
'''


def test_an_elu_epilogue_matches_f_elu_under_the_reference_lowering():
    gen = torch.Generator().manual_seed(5)
    M, N, K = 200, 144, 64
    A, B = torch.randn(M, K, generator=gen).to(torch.bfloat16), torch.randn(K, N, generator=gen).to(torch.bfloat16)
    with lowering("reference"):
        got = gemm(A, B, load_program(ELU, "elu").elu, out_dtype="fp32")["D"]
    want = F.elu(A.double() @ B.double(), alpha=1.7)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_it_compiles_for_sm90a_under_the_cute_lowering():
    """Traced with CuTeDSL values and compiled: HGMMA, no slow-path CALL (the parts are the fast
    exp, a select and fmas), no spill at 128x128."""
    M, N, K = 256, 256, 128
    A, B = torch.randn(M, K).to(torch.bfloat16), torch.randn(K, N).to(torch.bfloat16)
    with compile_only() as kernels:
        gemm(A, B, load_program(ELU, "elu_sm90a").elu, config=TileConfig(tile_n=128, cluster_m=1))
    (k,) = kernels
    assert k.sass is not None, "cuobjdump wheel missing: pip install nvidia-cuda-cuobjdump"
    assert k.sass.sm90a and k.sass.hgmma > 0 and k.sass.calls == 0, k.sass
    assert k.sass.spill_stores == 0 and k.sass.spill_loads == 0, k.sass


def test_the_gpu_bar_past_one_half_holds_the_fast_exps_argument_rounding():
    """On the GPU, past |x| = 1/2, expm1 is the fast exp less one, and the fast exp is 2**t of t =
    x * log2(e) rounded to fp32: t's half ulp, |t| * 2**-24, times ln 2 is a relative error of
    |x| * 2**-24 in e**x.  Modelled here with an exact 2**t, that rounding alone reaches the
    3.4e-6 an H100 measured at x = 66 (tests/test_primitives_gpu.py's bar), and stays under the bar."""
    x = sweep(torch.float32)
    x = x[(x.abs() >= 0.5) & (x.abs() <= 88)]
    t = (x * math.log2(math.e)).to(torch.float32).double()
    want = torch.expm1(x.double())
    rel = (torch.exp2(t) - 1 - want).abs() / want.abs()
    assert 3e-6 < rel.max().item()
    assert (rel / (6 * torch.finfo(torch.float32).eps + x.abs().double() * 2.0 ** -24)).max().item() < 1
