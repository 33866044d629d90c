"""FP8 in the catalogue (primitives/fp8.py): fp8 GEMMs with their scales in the
epilogue, saturating fp8 outputs, quantize_rows, fast accumulation as a
declared choice, and every misuse named with its fix.  The CPU tier checks the
reference lowering against direct PyTorch math and compiles for sm_90a; the
GPU tier (marker ``gpu``) checks the cute lowering against the reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from coda_agent.primitives import (CatalogueError, TileConfig, compile_only, gemm, load_program, lowering,
                                   quantize_both, quantize_rows)
from coda_agent.primitives.catalogue import EXAMPLES
from coda_agent.primitives.fp8 import mainloop_key, saturate, scale_from_amax
from coda_agent.primitives.tile_config import default_config

HEADER = "from coda_agent.primitives import *\n"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALED = HEADER + '''
@epilogue(outputs={"q": "fp8_e4m3"}, reductions={"amax": col_max()})
def scaled(acc, sa: ColVec, sb: RowVec, qs: ColVec):
    v = acc * sa * sb
    return {"D": v, "q": v * qs, "amax": maximum(v, -v)}
'''


def fp8(*shape, dtype=E4M3, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(4).to(dtype)


@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3)])
def test_fp8_gemm_applies_row_and_column_scales_to_the_exact_product(a_dtype, b_dtype):
    epi = load_program(SCALED, "scaled").scaled
    M, N, K = 96, 80, 64
    A, W = fp8(M, K, dtype=a_dtype, seed=1), fp8(N, K, dtype=b_dtype, seed=2)
    sa, sb, qs = torch.rand(M) + 0.5, torch.rand(N) + 0.5, torch.full((M,), 3.0)
    out = gemm(A, W.t(), epi, sa=sa, sb=sb, qs=qs)
    v = (A.double() @ W.double().t()) * sa.double()[:, None] * sb.double()[None, :]
    assert out["D"].dtype == torch.bfloat16  # an fp8 GEMM's D defaults to bf16
    # within one bf16 rounding of the exact value (the fp32 sum and scale products round first)
    torch.testing.assert_close(out["D"].double(), v, rtol=2 ** -8, atol=0)
    torch.testing.assert_close(out["amax"].double(), v.abs().amax(1), rtol=1e-6, atol=1e-5)
    # fp8 outputs saturate at +-448 (the GPU's .satfinite), never NaN
    want = (v.float() * 3.0).clamp(-448, 448).to(E4M3)
    assert v.abs().max() * 3 > 448 and not out["q"].float().isnan().any()
    assert torch.equal(out["q"].float(), want.float())


def test_fp8_d_output_saturates_and_rounds_to_nearest():
    A, W = fp8(32, 32, seed=3), fp8(48, 32, seed=4)
    out = gemm(A, W.t(), out_dtype="fp8_e5m2")["D"]
    acc = A.float() @ W.float().t()
    assert out.dtype == E5M2
    assert torch.equal(out.float(), acc.clamp(-57344, 57344).to(E5M2).float())
    assert torch.equal(saturate(torch.tensor([1e6, -1e6, 0.3]), E4M3).float(), torch.tensor([448.0, -448.0, 0.3125]))


def test_quantize_rows_uses_power_of_two_scales_and_any_view():
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 3, 40)[:, None]
    x[7] = 0.0  # a zero row gets a finite scale
    r = quantize_rows(x)
    q, scale = r["q"], r["scale"]
    assert q.dtype == E4M3 and q.is_contiguous() and scale.shape == (40,)
    assert torch.equal(torch.exp2(torch.round(torch.log2(scale))), scale)  # powers of two
    peak = q.float().abs().amax(1)
    assert ((peak >= 224) & (peak <= 448))[torch.arange(40) != 7].all()  # the amax lands in the top binade
    # half an fp8 step: 2**-4 relative, or 2**-10 of the scale among the subnormals
    assert bool(((q.float() * scale[:, None] - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale[:, None]).all())
    # A transposed view quantizes x's columns into a contiguous (96, 40) copy.
    y = torch.randn(40, 96, generator=torch.Generator().manual_seed(7))
    t = quantize_rows(y.t())
    assert t["q"].shape == (96, 40) and t["q"].is_contiguous()
    assert torch.equal(t["scale"], scale_from_amax(y.abs().amax(0), E4M3))
    torch.testing.assert_close(t["q"].float() * t["scale"][:, None], y.t(), rtol=2 ** -4, atol=2 ** -9)
    # row_scale / col_scale multiply first: dequantize an fp8 input, fold a norm weight
    g = torch.rand(96) + 0.5
    again = quantize_rows(q, row_scale=scale, col_scale=g)
    torch.testing.assert_close(again["q"].float() * again["scale"][:, None], x * g, rtol=2 ** -3, atol=0)
    assert torch.equal(scale_from_amax(torch.tensor([448.0, 449.0, 1.0]), E4M3), torch.tensor([1.0, 2.0, 2 ** -8]))


def test_quantize_both_is_quantize_rows_along_each_axis():
    x = (torch.randn(70, 300, generator=torch.Generator().manual_seed(9)) * torch.logspace(-3, 3, 300)).to(
        torch.bfloat16)
    x[:, 11] = 0.0  # a zero column gets a finite scale
    for view in (x, x.t()):
        both, rows, cols = quantize_both(view), quantize_rows(view), quantize_rows(view.t())
        assert both["qt"].shape == view.t().shape and both["qt"].is_contiguous()
        for got, want in ((both["q"], rows["q"]), (both["scale"], rows["scale"]), (both["qt"], cols["q"]),
                          (both["scale_t"], cols["scale"])):
            assert got.dtype == want.dtype and torch.equal(got.float(), want.float())
        # row_scale: both copies of x * row_scale (RMSNorm's r on rms_prepare's x * gamma)
        r = torch.logspace(-3, 3, view.shape[0])
        both = quantize_both(view, row_scale=r)
        for got, want in ((both["q"], quantize_rows(view, row_scale=r)["q"]),
                          (both["qt"], quantize_rows(view.t(), col_scale=r)["q"])):
            assert torch.equal(got.float(), want.float())
    with pytest.raises(CatalogueError, match=r"row_scale must be a tensor of shape \(70,\)"):
        quantize_both(x, row_scale=torch.ones(300))
    e5 = quantize_both(x, "fp8_e5m2")
    assert e5["q"].dtype == e5["qt"].dtype == E5M2
    with pytest.raises(CatalogueError, match="quantize_both: dtype 'e4m3'"):
        quantize_both(x, "e4m3")
    with pytest.raises(CatalogueError, match="x must be 2-D"):
        quantize_both(x[0])


def test_amaxes_an_epilogue_reduced_give_the_cast_s_bits_and_a_short_one_saturates():
    """quantize_both/quantize_rows with the amaxes given (an epilogue's col_amax()/row_amax() of the
    value it stores): the bits of the cast that reduces them itself; an amax below the tensor's
    clips what lies past it to the format's largest value, and never makes a NaN."""
    x = (torch.randn(70, 300, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 300)).to(
        torch.bfloat16)
    v = x.float()
    for view, ra, ca in ((x, v.abs().amax(1), v.abs().amax(0)), (x.t(), v.abs().amax(0), v.abs().amax(1))):
        own, given = quantize_both(view), quantize_both(view, row_amax=ra, col_amax=ca)
        for key in ("q", "scale", "qt", "scale_t"):
            assert torch.equal(own[key].float(), given[key].float()), key
        rows = quantize_rows(view, row_amax=ra)
        assert torch.equal(rows["q"].float(), own["q"].float()) and torch.equal(rows["scale"], own["scale"])
    short = quantize_both(x, row_amax=v.abs().amax(1) / 16, col_amax=v.abs().amax(0))
    q = short["q"].float()
    assert not q.isnan().any() and q.abs().max() == 448.0
    assert float((q.abs() == 448.0).float().mean()) > 0.01  # the largest of each row clip
    with pytest.raises(CatalogueError, match="give row_amax and col_amax together"):
        quantize_both(x, row_amax=v.abs().amax(1))
    with pytest.raises(CatalogueError, match=r"col_amax must be a tensor of shape \(300,\)"):
        quantize_both(x, row_amax=v.abs().amax(1), col_amax=v.abs().amax(1))
    with pytest.raises(CatalogueError, match=r"row_amax must be a tensor of shape \(70,\)"):
        quantize_rows(x, row_amax=torch.ones(300))


def test_fp8_misuse_names_the_fix():
    A, W = fp8(64, 64), fp8(64, 64)
    with pytest.raises(CatalogueError, match=r"fp8 B must be K-major.*W\.t\(\)"):
        gemm(A, W)  # a (K, N) row-major B is N-major
    with pytest.raises(CatalogueError, match="fp8 A must be K-major"):
        gemm(A.t(), W.t())
    with pytest.raises(CatalogueError, match="takes both in fp8.*quantize_rows"):
        gemm(A, W.t().to(torch.bfloat16))
    with pytest.raises(CatalogueError, match="fast_accum=True is a choice of the fp8 mainloop"):
        gemm(A.to(torch.bfloat16), W.t().to(torch.bfloat16), fast_accum=True)
    with pytest.raises(CatalogueError, match="16 of fp8"):
        gemm(fp8(64, 40), fp8(64, 40).t())  # K = 40 fp8 elements: 40-byte rows
    with pytest.raises(CatalogueError, match="reduce-add store"):
        gemm(A, W.t(), accumulate_into=torch.zeros(64, 64, dtype=E4M3))
    with pytest.raises(CatalogueError, match=r"outputs \['y'\] are fp8.*16-bit on SM90.*quantize_rows"):
        load_program(HEADER + '''
@epilogue(outputs={"y": "fp8_e4m3"}, pairs="acc")
def swiglu(acc):
    g, u = unpack(acc)
    return {"D": acc, "y": silu(g) * u}
''', "paired_fp8")
    with pytest.raises(CatalogueError, match="quantize_rows: dtype 'fp8'"):
        quantize_rows(torch.ones(4, 16), dtype="fp8")
    with pytest.raises(CatalogueError, match=r"row_scale must be a tensor of shape \(4,\)"):
        quantize_rows(torch.ones(4, 16), row_scale=torch.ones(16))


def test_promoting_fp8_gemms_run_cooperative_and_key_their_mainloop():
    for fast in (False, True):
        cfg = default_config(None, {}, n=4096, m=16384, fp8_promote=not fast)
        assert cfg.pingpong == fast and cfg.tile_n == 192
    a, b = fp8(16, 16), fp8(16, 16, dtype=E5M2)
    keys = {mainloop_key(a, b.t(), f) for f in (False, True)} | {mainloop_key(a.bfloat16(), b.bfloat16(), False)}
    assert len(keys) == 3  # a tuned config for one accumulation mode never serves the other


def test_promoting_fp8_gemms_get_only_tiles_that_hold_both_accumulators():
    from coda_agent.primitives import tuning
    from coda_agent.primitives.tile_config import fits_promoted

    promoted = tuning.candidates_for(None, {}, promote=True)
    assert promoted and all(fits_promoted(c) for c in promoted)
    assert TileConfig(128, 64, 1, 1, True) in promoted and TileConfig(128, 192, 2, 1, False) in promoted
    assert tuning.candidates_for(None, {}) == list(tuning.CANDIDATES)  # bf16 and fast accumulation: unchanged
    # the rule's cooperative 128x256 (a padded plain N) holds 128 sums per thread: 128x128 when promoting
    assert default_config(None, {}, n=1024, m=16384) == TileConfig(128, 256, 1, 1, False)
    assert default_config(None, {}, n=1024, m=16384, fp8_promote=True) == TileConfig(128, 128, 1, 1, False)
    # short of shared memory, an untuned call retries on a lean tile: one that holds both accumulators
    from coda_agent.primitives.tile_config import lean_staging
    assert lean_staging(TileConfig(), None) == TileConfig(128, 128, 1, 1, True)
    lean = lean_staging(TileConfig(), None, fp8_promote=True)
    assert lean == TileConfig(128, 128, 1, 1, False) and fits_promoted(lean)


# --------------------------------------------------------------------------- sm_90a compile


@pytest.mark.slow
def test_every_promoted_candidate_compiles_spill_free_and_the_rule_is_the_compilers():
    """What fits_promoted admits compiles without spills for a heavy fp8 epilogue (the paired
    dSwiGLU backward of llama3_block_fp8), and a tile it refuses spills there."""
    import importlib.util

    from coda_agent.primitives import tuning
    from coda_agent.tasks import SUITE_DIR

    path = SUITE_DIR.parent / "llama3_fp8" / "experts" / "llama3_block_fp8.py"
    spec = importlib.util.spec_from_file_location("llama3_block_fp8_expert", path)
    expert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(expert)
    M, N, K = 256, 512, 256
    g, w = quantize_rows(torch.randn(M, K)), quantize_rows(torch.randn(N, K))
    ops = dict(pre=torch.randn(M, 2 * N).bfloat16(), a_scale=g["scale"], w_scale=w["scale"])
    refused = TileConfig(128, 128, 1, 1, True)
    with compile_only() as kernels:
        for cfg in (*tuning.candidates_for(expert.dswiglu, ops, promote=True), refused):
            gemm(g["q"], w["q"].t(), expert.dswiglu, config=cfg, **ops)
    *admitted, spilling = kernels
    assert [k.sass.spill_stores for k in admitted] == [0] * len(admitted), [k.config for k in admitted]
    assert spilling.sass.spill_stores > 0


@pytest.mark.slow
def test_fp8_gemms_compile_with_qgmma_and_fast_accumulation_is_another_kernel():
    epi = load_program(HEADER + EXAMPLES["fp8"], "fp8_example").scale_to_fp8
    M, N, K = 256, 384, 128
    A, W = fp8(M, K), fp8(N, K)
    ops = dict(a_scale=torch.ones(M), w_scale=torch.ones(N), q_scale=torch.ones(M))
    with compile_only() as kernels:
        gemm(A, W.t(), epi, **ops)
        gemm(A, W.t(), epi, fast_accum=True, config=TileConfig(tile_n=128, cluster_m=1), **ops)
    promote, fast = kernels
    for k in kernels:
        assert k.sass is not None and k.sass.sm90a and k.sass.hgmma > 0  # QGMMA
    assert "cooperative" in promote.config and promote.sass.spill_stores == 0
    assert fast.sass.spill_stores == 0
    # Promotion adds a register accumulator and its adds: a different, longer kernel.
    assert fast.sass.hgmma != promote.sass.hgmma or fast.sass.instructions != promote.sass.instructions


_TRITON = textwrap.dedent("""
    import torch
    from coda_agent.primitives import quantize
    from coda_agent.primitives.quantize_triton import quantize_both_triton, quantize_rows_triton
    torch.manual_seed(0)
    x = (torch.randn(70, 300) * torch.logspace(-2, 2, 70)[:, None]).to(torch.bfloat16)
    g, s = torch.rand(300) + 0.5, torch.rand(70) + 0.5
    for view, rs, cs in ((x, None, None), (x.t(), None, s), (x, s, g)):
        got = quantize_rows_triton(view, torch.float8_e4m3fn, rs, cs)
        want = quantize.quantize_rows(view, "fp8_e4m3", rs, cs)  # CPU tensors: the PyTorch path
        assert torch.equal(got["scale"], want["scale"]), (got["scale"] - want["scale"]).abs().max()
        a, b = got["q"].float(), want["q"].float()
        # The interpreter's numpy fp8 cast is not the GPU's round-to-nearest-even: it rounds
        # ties away, misrounds subnormals and drops the carry when a value rounds up to the
        # next power of two (-127.5 -> -64, not -128).  So: the scales exactly, the values
        # within one fp8 step (2**-3 of the binade, 2**-9 among subnormals), or the carry.
        step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2 ** -6))) - 3)
        carry = (a == b / 2) & (torch.log2(b.abs()) % 1 == 0)
        assert bool(((a - b).abs() <= step + 2 ** -9)[~carry].all()), float((a - b)[~carry].abs().max())
        assert carry.float().mean() < 0.05
    # A view whose rows are not contiguous runs the tile kernels: the bits of the row kernels on a
    # contiguous copy, with both scalings
    w = (torch.randn(1100, 300) * torch.logspace(-3, 3, 300)).to(torch.bfloat16)
    for v, rs, cs in ((x, g, s), (x, None, None), (w, torch.rand(300) + 0.5, torch.rand(1100) + 0.5)):
        tiled = quantize_rows_triton(v.t(), torch.float8_e4m3fn, rs, cs)
        rowwise = quantize_rows_triton(v.t().contiguous(), torch.float8_e4m3fn, rs, cs)
        assert torch.equal(tiled["scale"], rowwise["scale"]) and torch.equal(tiled["q"].float(), rowwise["q"].float())
    # quantize_both: the same expressions on tiles, so the same bits as the row kernel along each axis;
    # the wider tensor takes several column blocks and row strips in the amax pass, either way round
    y = x.clone()
    y[:, 5] = 0.0
    wide = (torch.randn(300, 1100) * torch.logspace(-3, 3, 1100)).to(torch.bfloat16)
    for view in (y, y.t(), wide, wide.t(), wide[:, ::3], wide.t()[::2]):  # and views with no unit stride
        both = quantize_both_triton(view, torch.float8_e4m3fn)
        for key, alone in (("", quantize_rows_triton(view, torch.float8_e4m3fn, None, None)),
                           ("t", quantize_rows_triton(view.t(), torch.float8_e4m3fn, None, None))):
            assert torch.equal(both["scale" + ("_t" if key else "")], alone["scale"])
            assert torch.equal(both["q" + key].float(), alone["q"].float())
        assert torch.equal(both["scale"], quantize.quantize_rows(view, "fp8_e4m3")["scale"])  # the CPU path's
        assert torch.equal(both["scale_t"], quantize.quantize_rows(view.t(), "fp8_e4m3")["scale"])
        r = torch.rand(view.shape[0]) * 100 + 0.01  # row_scale: the row kernels' bits with it on each side
        both = quantize_both_triton(view, torch.float8_e4m3fn, r)
        for key, alone in (("", quantize_rows_triton(view, torch.float8_e4m3fn, r, None)),
                           ("t", quantize_rows_triton(view.t(), torch.float8_e4m3fn, None, r))):
            assert torch.equal(both["scale" + ("_t" if key else "")], alone["scale"])
            assert torch.equal(both["q" + key].float(), alone["q"].float())
    # amaxes given (an epilogue's): no amax pass, the same bits, along either layout
    for view in (y, wide.t()):
        own = quantize_both_triton(view, torch.float8_e4m3fn)
        vf = view.float().abs()
        given = quantize_both_triton(view, torch.float8_e4m3fn, None, vf.amax(1), vf.amax(0))
        assert all(torch.equal(own[k].float(), given[k].float()) for k in own)
        rows = quantize_rows_triton(view, torch.float8_e4m3fn, None, None, vf.amax(1))
        assert torch.equal(rows["q"].float(), own["q"].float()) and torch.equal(rows["scale"], own["scale"])
    # the amax pass's geometry (bench/fp8.py --casts sweeps it) never changes the maxima
    from coda_agent.primitives.quantize_triton import _amaxes
    for view in (wide, wide.t()):
        want = None
        for step, width, programs, warps in ((8192, 512, 1024, 8), (2048, 128, 64, 4), (16384, 2048, 7, 2),
                                             (512, 16, 4096, 1)):
            got = (torch.zeros(view.shape[0]), torch.zeros(view.shape[1]))
            _amaxes(view, *got, step=step, width=width, programs=programs, warps=warps)
            want = want or got
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(want[0], view.float().abs().amax(1)) and torch.equal(want[1], view.float().abs().amax(0))
    print("ok")
""")


def test_quantize_triton_kernels_match_the_cpu_path_in_the_interpreter():
    """The CUDA path's Triton kernels, run by Triton's CPU interpreter (in a
    subprocess: TRITON_INTERPRET is read when the kernels are defined)."""
    res = subprocess.run([sys.executable, "-c", _TRITON], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# --------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cute_fp8_gemm_matches_the_reference_lowering(fast_accum):
    epi = load_program(SCALED, "scaled_gpu").scaled
    M, N, K = 1000, 1168, 4096
    A, W = fp8(M, K).cuda(), fp8(N, K, dtype=E5M2, seed=5).cuda()
    ops = dict(sa=torch.rand(M, device="cuda") + 0.5, sb=torch.rand(N, device="cuda") + 0.5,
               qs=torch.full((M,), 0.05, device="cuda"))
    with lowering("cute"):
        got = gemm(A, W.t(), epi, fast_accum=fast_accum, **ops)
    with lowering("reference"):
        want = gemm(A, W.t(), epi, **ops)
    # fast accumulation adds into fewer bits than fp32 inside the tensor core (no promotion
    # every few K blocks): at K=4096 the H200 gives 2.2e-3, about twice the promoted error
    rel = (got["D"].float() - want["D"].float()).norm() / want["D"].float().norm()
    assert float(rel) < (4e-3 if fast_accum else 1e-3), float(rel)
    # each row's amax is one element of D, so it carries an element's error, not the norm's: the
    # H200 gave 4.3e-3 at one row of 1000 with fast accumulation (bench/results/h200-2026-12-01-d)
    torch.testing.assert_close(got["amax"], want["amax"], rtol=8e-3 if fast_accum else 2e-3, atol=1e-2)
    # q is the kernel's own fp32 value quantized: within one e4m3 step (2^-3) of its D (stored in
    # bf16, whose rounding can move an fp8 rounding by a step) and, where the accumulation is the
    # reference's (promoted), of the reference's q too.  With fast accumulation an element of D
    # near zero can move by several of q's steps (the H200: 0.31 of |q| at |q| ~ 1, run 10).
    bad = got["q"].float().isnan().nonzero()
    assert not len(bad), (f"{len(bad)} NaN codes in q, rows {bad[:, 0].min()}-{bad[:, 0].max()}, "
                          f"columns {bad[:, 1].min()}-{bad[:, 1].max()}: a store the kernel did not make?")
    # (saturating, as the kernel's cvt.satfinite does: torch's own cast gives NaN past 464)
    own = saturate(got["D"].float() * ops["qs"][:, None], E4M3).float()
    assert float(((got["q"].float() - own).abs() / own.abs().clamp_min(1)).max()) <= 2 ** -3
    if not fast_accum:
        q_err = (got["q"].float() - want["q"].float()).abs() / want["q"].float().abs().clamp_min(1)
        assert float(q_err.max()) <= 2 ** -3  # one fp8 step where the fp32 sums round differently


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantize_rows_on_cuda_matches_the_cpu_path():
    x = (torch.randn(4096, 14336) * 3).to(torch.bfloat16)
    for view in (x, x.t()):
        got = quantize_rows(view.cuda() if view is x else x.cuda().t())
        want = quantize_rows(view)
        assert torch.equal(got["scale"].cpu(), want["scale"])
        assert torch.equal(got["q"].cpu().float(), want["q"].float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,cols", [(4096, 14336), (1000, 1168)])
def test_quantize_both_on_cuda_matches_the_cpu_path(rows, cols):
    x = (torch.randn(rows, cols) * torch.logspace(-2, 2, cols)).to(torch.bfloat16)
    for view in (x, x.t()):
        r = torch.logspace(-3, 3, view.shape[0])
        for row_scale in (None, r):
            got = quantize_both(view.cuda() if view is x else x.cuda().t(),
                                row_scale=None if row_scale is None else row_scale.cuda())
            want = quantize_both(view, row_scale=row_scale)
            for key in ("q", "scale", "qt", "scale_t"):
                assert torch.equal(got[key].cpu().float(), want[key].float()), (key, row_scale is None)
        # the amaxes an epilogue reduced, given: the same bits
        vf = view.float().abs()
        got = quantize_both((view.cuda() if view is x else x.cuda().t()), row_amax=vf.amax(1).cuda(),
                            col_amax=vf.amax(0).cuda())
        want = quantize_both(view)
        for key in ("q", "scale", "qt", "scale_t"):
            assert torch.equal(got[key].cpu().float(), want[key].float()), key
