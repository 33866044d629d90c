"""The activations' derivatives in the math vocabulary (``sigmoid_grad``, ``silu_grad``,
``tanh_grad``, ``gelu_tanh_grad``, ``gelu_grad``), on the CPU: each against
``torch.autograd`` of the PyTorch function it differentiates, in fp64 and fp32 and out to
|x| = 1e4 (finite everywhere); inside epilogues run by ``tile_pass`` and ``gemm`` under the
reference lowering, Pair lanes included; traced and compiled for sm_90a under the cute
lowering with no slow-path CALL; and accepted in a program by the verifier's static stage and
its PyTorch audit, which still flags them called on the host."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda_agent.primitives import (TileConfig, compile_only, gelu_grad, gelu_tanh_grad, gemm, load_program,
                                   lowering, sigmoid_grad, silu_grad, tanh_grad, tile_pass)
from coda_agent.tasks import SUITES, load_task
from coda_agent.verifier import Verifier

# name -> (the vocabulary's derivative, the PyTorch function it differentiates)
GRADS = {
    "sigmoid_grad": (sigmoid_grad, torch.sigmoid),
    "silu_grad": (silu_grad, F.silu),
    "tanh_grad": (tanh_grad, torch.tanh),
    "gelu_tanh_grad": (gelu_tanh_grad, lambda x: F.gelu(x, approximate="tanh")),
    "gelu_grad": (gelu_grad, F.gelu),
}
# |error| <= ATOL + RTOL * |fp64 autograd's value|, the reference for both dtypes: a few
# roundings of the dtype.  In fp32 the bound is absolute: where an activation saturates,
# 1 - sigmoid(x) and 1 - tanh(x) are differences of numbers near 1 and keep only fp32's absolute
# precision there, in PyTorch's own fp32 backward as much as here (its vectorised tanh-GELU
# backward gives 0 at x = -5.15, where the derivative is -5.8e-7).
TOL = {torch.float64: (1e-14, 1e-12), torch.float32: (1e-6, 1e-6)}


def points(dtype: torch.dtype) -> torch.Tensor:
    """A dense sweep of [-30, 30] (past where every activation saturates) and far points."""
    far = torch.tensor([1e-6, 50.0, 100.0, 1e3, 1e4], dtype=torch.float64)
    return torch.cat([torch.linspace(-30.0, 30.0, 6001, dtype=torch.float64), far, -far]).to(dtype)


def autograd_of(f, x: torch.Tensor, dy: torch.Tensor | None = None) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    y = f(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y) if dy is None else dy)
    return g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(GRADS))
def test_each_derivative_is_autograd_of_its_function(name, dtype):
    grad, f = GRADS[name]
    x = points(dtype)
    got, want = grad(x), autograd_of(f, x.double())
    assert got.dtype == dtype and torch.isfinite(got).all(), x[~torch.isfinite(got)]
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_the_tolerance_tells_the_two_gelu_derivatives_apart():
    """The comparison above can fail: the tanh form's derivative is not the exact one's."""
    x = points(torch.float64)
    atol, rtol = TOL[torch.float64]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(gelu_tanh_grad(x), autograd_of(F.gelu, x), atol=atol, rtol=rtol)


def test_numbers_and_values_at_zero():
    assert [g(0.0) for g, _ in GRADS.values()] == [0.25, 0.5, 1.0, 0.5, 0.5]
    assert silu_grad(2.0) == pytest.approx(float(autograd_of(F.silu, torch.tensor(2.0, dtype=torch.float64))))


HEADER = "from coda_agent.primitives import *\n"
GRADS_PASS = HEADER + '''
@epilogue(outputs={"s": "fp32", "si": "fp32", "t": "fp32", "gt": "fp32"})
def grads(dy: Tile, pre: Tile):
    return {"D": dy * gelu_grad(pre), "s": dy * sigmoid_grad(pre), "si": dy * silu_grad(pre),
            "t": dy * tanh_grad(pre), "gt": dy * gelu_tanh_grad(pre)}
'''


def test_in_a_tile_pass_under_the_reference_lowering():
    pre = points(torch.float32)[:6000].reshape(50, 120)  # [-30, 30), fp32
    dy = torch.randn(pre.shape, generator=torch.Generator().manual_seed(3))
    epi = load_program(GRADS_PASS, "grads_pass").grads
    with lowering("reference"):
        out = tile_pass(epi, dy=dy, pre=pre)
    atol, rtol = TOL[torch.float32]
    for key, name in {"D": "gelu_grad", "s": "sigmoid_grad", "si": "silu_grad", "t": "tanh_grad",
                      "gt": "gelu_tanh_grad"}.items():
        want = autograd_of(GRADS[name][1], pre.double(), dy.double()).float()
        torch.testing.assert_close(out[key], want, atol=atol * 4, rtol=rtol * 4, msg=lambda m: f"{name}: {m}")


# Gemma's GeGLU backward (the tanh form) over the interleaved (gate, up) pre-activation.
DGEGLU = HEADER + '''
@epilogue(outputs={"dg": "fp32"})
def dgeglu(acc, pre: PairedTile):   # acc: dL/d(gelu_tanh(g) * u), one column per pair
    g, u = unpack(pre)
    dg = acc * u * gelu_tanh_grad(g)
    return {"D": pack(dg, acc * gelu_tanh(g)), "dg": dg}   # D in pre's dtype, dg in fp32
'''


def test_a_geglu_backward_in_a_gemm_epilogue_over_pairs():
    gen = torch.Generator().manual_seed(7)
    M, N, K = 200, 144, 64
    dout, w = torch.randn(M, K, generator=gen), torch.randn(K, N // 2, generator=gen) / K ** 0.5
    g, u = 3 * torch.randn(M, N // 2, generator=gen), torch.randn(M, N // 2, generator=gen)
    pre = torch.stack([g, u], dim=-1).flatten(-2).to(torch.bfloat16)  # columns (g0, u0, g1, u1, ...)
    epi = load_program(DGEGLU, "dgeglu").dgeglu
    with lowering("reference"):
        got = gemm(dout.to(torch.bfloat16), w.to(torch.bfloat16), epi, pre=pre)
    da = dout.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double()
    g64, u64 = pre.double()[:, 0::2].requires_grad_(True), pre.double()[:, 1::2].requires_grad_(True)
    dg, du = torch.autograd.grad(F.gelu(g64, approximate="tanh") * u64, (g64, u64), da)
    torch.testing.assert_close(got["dg"].double(), dg, atol=1e-5, rtol=1e-5)
    want = torch.stack([dg, du], dim=-1).flatten(-2)
    torch.testing.assert_close(got["D"].double(), want.to(torch.bfloat16).double(), atol=2 ** -6, rtol=2 ** -7)


ALL_GRADS = HEADER + '''
@epilogue(outputs={"a": "bf16"})
def all_grads(acc, dy: Tile):
    return {"D": dy * (sigmoid_grad(acc) + silu_grad(acc) + tanh_grad(acc)),
            "a": dy * (gelu_tanh_grad(acc) + gelu_grad(acc))}
'''


@pytest.mark.slow
def test_they_compile_for_sm90a_under_the_cute_lowering():
    """Traced with CuTeDSL values (each part's cute form) and compiled: HGMMA and no slow-path
    CALL (the parts are the fast forms; an IEEE division would add one).  The GeGLU backward, a
    real epilogue, is spill-free at 128x128; all five at once in one epilogue are a trace test,
    not a register budget."""
    P = load_program(ALL_GRADS + DGEGLU[len(HEADER):], "grads_sm90a")
    M, N, K = 256, 384, 128
    A, B = torch.randn(M, K).to(torch.bfloat16), torch.randn(K, N).to(torch.bfloat16)
    tile = TileConfig(tile_n=128, cluster_m=1)
    with compile_only() as kernels:
        gemm(A, B, P.all_grads, config=tile, dy=torch.randn(M, N).to(torch.bfloat16))
        gemm(A, B[:, :N // 2], P.dgeglu, config=tile, pre=torch.randn(M, N).to(torch.bfloat16))
    assert [k.epilogue for k in kernels] == ["all_grads", "dgeglu"]
    for k in kernels:
        assert k.sass is not None, "cuobjdump wheel missing: pip install nvidia-cuda-cuobjdump"
        assert k.sass.sm90a and k.sass.hgmma > 0, (k.epilogue, k.sass)
        assert k.sass.calls == 0, (k.epilogue, k.sass)
    geglu = kernels[1].sass
    assert geglu.spill_stores == 0 and geglu.spill_loads == 0, geglu


# gelu_bwd (tasks/gpt2/gelu_bwd.yaml) with the vocabulary's derivative instead of the expert's
# hand-written one.
GELU_BWD = '''
from coda_agent.primitives import Tile, epilogue, gelu_grad, gemm, row_sum


@epilogue(reductions={"db": row_sum()})
def dgelu(acc, pre: Tile):
    dpre = acc * gelu_grad(pre)
    return {"D": dpre, "db": dpre}


def forward(dout, w_proj, pre):
    out = gemm(dout, w_proj, dgelu, pre=pre)
    return {"dpre": out["D"], "db": out["db"]}
'''


def test_a_program_using_them_passes_the_static_and_reference_stages():
    task = load_task(SUITES["gpt2"] / "gelu_bwd.yaml")
    # The same derivative applied on the host: PyTorch compute the audit must still see.
    on_host = GELU_BWD.replace('''    return {"dpre": out["D"], "db": out["db"]}''',
                               '''    return {"dpre": out["D"] * gelu_grad(pre), "db": out["db"]}''')
    assert on_host != GELU_BWD
    with Verifier(stages=["static", "reference"], cache=False, timeout_s=300) as v:
        report = v.check(task, GELU_BWD)
        bad = v.check(task, on_host).stage("reference")
    assert report.outcome == "cpu_passed", [(s.name, s.status, s.message) for s in report.stages]
    assert bad.status == "failed" and "PyTorch compute in the program at line 13" in bad.message, bad.message
