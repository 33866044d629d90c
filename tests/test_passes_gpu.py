"""GPU tier of the GPT-2 suite's catalogue additions (H200; skipped without
CUDA): tile passes through the pass kernel and through quack's kernel on its
zero mainloop against the reference lowering, erf / gelu / 16-bit rounding against PyTorch in fp64 and
bit for bit, vector passes on the device, and LayerNorm's statistics, fold and
row-scale.  With CODA_GPU_RESULTS set, each case appends its errors to
``$CODA_GPU_RESULTS/primitives.jsonl``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from test_passes import PROGRAM as PASSES  # the CPU tier's passes: dgelu (reductions, partials), dswiglu
from test_primitives_gpu import _record  # to $CODA_GPU_RESULTS/primitives.jsonl with the other catalogue cases

from coda_agent.primitives import (CatalogueError, TileConfig, launch_ledger, layernorm_fold, load_program, lowering,
                                   normalize_rows, pass_kernel, row_stats, tile_pass, tuning, vector_pass)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROGRAM = load_program('''
from coda_agent.primitives import *

@epilogue(outputs={"g": "fp32", "b16": "fp32", "h16": "fp32"})
def exact(x: Tile):
    return {"D": erf(x), "g": gelu(x), "b16": round_bf16(x), "h16": round_fp16(x)}

@epilogue(outputs={"r0": "fp32"})
def centre(mean: ColVec, rstd: ColVec):
    return {"r0": -rstd * mean}
''', "passes_gpu")

SHAPES = {"even": (2048, 3072), "ragged": (1000, 1264)}


def _compare(case: str, got: dict, want: dict) -> None:
    assert set(got) == set(want)
    errs = {}
    for k in want:
        g, w = got[k].float().cpu(), want[k].float()
        assert g.shape == w.shape and not torch.isnan(g).any(), k
        errs[k] = ((g - w).norm() / w.norm().clamp_min(1e-12)).item()
        # fp32 statistics to fp32 accuracy, except rstd: from sum and sum of squares, the
        # variance of rows with mean/std = 40 (the test's x) loses log2(40^2) ~ 11 bits (H200: 9.4e-5)
        limit = (3e-4 if k == "rstd" else 1e-5) if got[k].dtype == torch.float32 else 8e-3
        assert errs[k] < limit, (case, k, errs[k])
    _record({"case": case, "rel_norm": errs})


def _tiles(m: int, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"dy": torch.randn(m, n, generator=gen).bfloat16(), "pre": (2 * torch.randn(m, n, generator=gen)).bfloat16(),
            "shift": torch.randn(n, generator=gen), "scale": torch.rand(m, generator=gen) + 0.5, "alpha": 0.25}


def _cuda(ops: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tile_pass_on_the_zero_mainloop_matches_the_reference(shape):
    m, n = SHAPES[shape]
    ops = _tiles(m, n, 1)
    with lowering("reference"):
        want = tile_pass(PASSES.dgelu, **ops)  # partials at the default config's tile_n, as the kernel's
    with lowering("cute"):
        got = tile_pass(PASSES.dgelu, **_cuda(ops))
    torch.cuda.synchronize()
    _compare(f"dgelu/{shape}", got, want)


def test_tile_pass_at_every_config_the_tuner_may_pick():
    """tune() times a pass at each candidate (the benchmark tunes every untuned call)."""
    m, n = SHAPES["ragged"]
    ops = _tiles(m, n, 2)
    for cfg in tuning.candidates_for(PASSES.dgelu, ops):
        with lowering("reference"):
            want = tile_pass(PASSES.dgelu, config=cfg, **ops)  # partials laid out per the config's tile_n
        with lowering("cute"):
            got = tile_pass(PASSES.dgelu, config=cfg, **_cuda(ops))
        torch.cuda.synchronize()
        _compare(f"dgelu/{cfg}", got, want)


@pytest.mark.parametrize("config", [None, TileConfig(tile_n=128, cluster_m=1)], ids=["pass kernel", "zero mainloop"])
@pytest.mark.parametrize("shape", [(1000, 632), (4099, 776), (1, 8)], ids=["ragged", "tall", "one row"])
def test_paired_tile_pass_matches_the_reference(shape, config):
    """dSwiGLU over a PairedTile (a Pair a column, D stored paired, a fold of both lanes) on
    the pass kernel and on quack's zero mainloop, at ragged edges; the pass kernel twice, bit
    for bit, and accumulating into D (which quack's kernel cannot: its C is the PairedTile)."""
    m, n = shape
    gen = torch.Generator().manual_seed(m + n)
    dy, pre = torch.randn(m, n, generator=gen).bfloat16(), torch.randn(m, 2 * n, generator=gen).bfloat16()
    base = torch.randn(m, 2 * n, generator=gen).bfloat16()
    with lowering("reference"):
        want = tile_pass(PASSES.dswiglu, dy=dy, pre=pre, config=config)
        summed = base.clone()
        if config is None:
            tile_pass(PASSES.dswiglu, dy=dy, pre=pre, accumulate_into=summed)
    acc = base.cuda()
    with lowering("cute"), launch_ledger() as ledger:
        got = tile_pass(PASSES.dswiglu, dy=dy.cuda(), pre=pre.cuda(), config=config)
        again = tile_pass(PASSES.dswiglu, dy=dy.cuda(), pre=pre.cuda(), config=config)
        if config is None:
            tile_pass(PASSES.dswiglu, dy=dy.cuda(), pre=pre.cuda(), accumulate_into=acc)
        else:
            with pytest.raises(CatalogueError, match="pass kernel only"):
                tile_pass(PASSES.dswiglu, dy=dy.cuda(), pre=pre.cuda(), config=config, accumulate_into=acc)
    torch.cuda.synchronize()
    assert {launch.config for launch in ledger} == {pass_kernel.CONFIG if config is None else str(config)}
    _compare(f"dswiglu/{m}x{n}/{ledger[0].config}", got, want)
    if config is None:
        _compare(f"dswiglu accumulate/{m}x{n}", {"D": acc}, {"D": summed})
        assert all(torch.equal(got[k], again[k]) for k in got)


def test_rope_inverse_pass_turns_back_the_forward_rotation_and_passes_v_through():
    """The drop-in's RoPE backward on the pass kernel: the inverse rotation of a gradient
    against fp64 math on the same fp32 angles (the kernel's product pos * freq) up to 1e5 rad,
    and the columns whose frequency is zero (v) copied bit for bit, as the forward epilogue
    leaves them unrotated."""
    from coda_agent.kernels.llama_ops import rope_inverse

    t, rotated, n = 8192 + 3, 1280, 1536
    gen = torch.Generator().manual_seed(7)
    du = torch.randn(t, n, generator=gen).bfloat16()
    pos = torch.arange(t).float() * 12  # angles to ~1e5 rad at the highest frequency
    freq = torch.cat((1e4 ** -(torch.arange(0, rotated, 2) / rotated), torch.zeros((n - rotated) // 2)))
    with lowering("cute"), launch_ledger() as ledger:
        got = tile_pass(rope_inverse, du=du.cuda(), pos=pos.cuda(), freq=freq.cuda())["D"].cpu()
    torch.cuda.synchronize()
    assert [launch.config for launch in ledger] == [pass_kernel.CONFIG]
    ang = (pos[:, None] * freq[None]).double()
    c, s = ang.cos(), ang.sin()
    e, o = du.double()[:, 0::2], du.double()[:, 1::2]
    want = torch.stack((e * c + o * s, o * c - e * s), -1).flatten(1)
    rel = ((got.double() - want).norm() / want.norm()).item()
    _record({"case": "rope_inverse", "rel_norm": rel})
    assert rel < 3e-3, rel  # bf16 rounding of the result: ~1.1e-3
    assert torch.equal(got[:, rotated:], du[:, rotated:])


def test_erf_gelu_and_rounding_on_the_gpu():
    """libdevice's erff against fp64 (absolute and relative, small arguments
    included); gelu against F.gelu; the 16-bit roundings bit for bit."""
    x = torch.cat([torch.linspace(-9, 9, 1000 * 512 - 4096), torch.logspace(-8, 0, 4096)]).view(1000, 512)
    with lowering("cute"):
        got = tile_pass(PROGRAM.exact, x=x.cuda())
    torch.cuda.synchronize()
    erf64 = torch.erf(x.double())
    abs_err = (got["D"].double().cpu() - erf64).abs()
    small = x.abs() < 1e-2
    rel_small = float((abs_err[small] / erf64[small].abs()).max())
    gelu_err = float((got["g"].double().cpu() - F.gelu(x.double())).abs().max())
    _record({"case": "erf", "max_abs": float(abs_err.max()), "max_rel_small": rel_small, "gelu_max_abs": gelu_err})
    assert float(abs_err.max()) < 5e-7 and rel_small < 1e-6, (float(abs_err.max()), rel_small)
    assert gelu_err < 5e-6 * 9, gelu_err
    assert torch.equal(got["b16"].cpu(), x.bfloat16().float())
    assert torch.equal(got["h16"].cpu(), x.half().float())


def test_vector_pass_on_the_device():
    mean, rstd = torch.randn(4096, device="cuda"), torch.rand(4096, device="cuda") + 0.5
    out = vector_pass(PROGRAM.centre, mean=mean, rstd=rstd)
    assert out["r0"].is_cuda
    torch.testing.assert_close(out["r0"], -rstd * mean)


@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_layernorm_kernels_on_the_gpu(layout):
    gen = torch.Generator().manual_seed(4)
    m, k, n = 1000, 1600, 4800
    x = (20 + 0.5 * torch.randn(m, k, generator=gen)).bfloat16()
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).bfloat16()
    gamma, beta = (1 + 0.1 * torch.randn(k, generator=gen)).bfloat16(), torch.randn(k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    B = w.t() if layout == "transposed" else w.t().contiguous()
    cpu = {"x": x, "B": B, "gamma": gamma, "beta": beta, "bias": bias}
    results = {}
    for where, t in (("reference", cpu), ("cute", {k2: v.cuda() for k2, v in cpu.items()})):
        with lowering(where):
            st = row_stats(t["x"], 1e-5)
            fold = layernorm_fold(t["B"], t["gamma"], t["beta"], t["bias"])
            ln = normalize_rows(t["x"], st["rstd"], t["gamma"], mean=st["mean"], beta=t["beta"])
        torch.cuda.synchronize()
        results[where] = {"mean": st["mean"], "rstd": st["rstd"], "B": fold["B"], "gw": fold["gw"], "c": fold["c"],
                          "ln": ln}
    got = results["cute"]
    assert got["B"].stride() == B.stride()
    assert torch.equal(got["B"].cpu(), results["reference"]["B"])  # one rounding of the same fp32 product
    torch.testing.assert_close(got["gw"].cpu().double(), got["B"].cpu().double().sum(0), atol=1e-4, rtol=1e-5)
    _compare(f"layernorm/{layout}", got, results["reference"])


@pytest.mark.parametrize("shape", [(1000, 1264), (16384, 4096)], ids=["ragged", "llama3-8b"])
def test_rms_prepare_on_cuda_is_one_pass_with_the_bits_of_the_cpu_path(shape):
    """On CUDA rms_prepare runs its tile pass (one aux launch, the pass inside it): x * gamma bit
    for bit against the CPU path, the inverse RMS to fp32 rounding."""
    from coda_agent.primitives import aux

    gen = torch.Generator().manual_seed(9)
    x = (3 * torch.randn(*shape, generator=gen)).bfloat16()
    gamma = (1 + 0.1 * torch.randn(shape[1], generator=gen)).bfloat16()
    want = aux.rms_prepare(x, gamma, 1e-6)
    with launch_ledger() as ledger:
        got = aux.rms_prepare(x.cuda(), gamma.cuda(), 1e-6)
    torch.cuda.synchronize()
    assert [(e.kind, e.name) for e in ledger] == [("aux", "rms_prepare")]
    assert torch.equal(got["xg"].cpu(), want["xg"])
    torch.testing.assert_close(got["rstd"].cpu(), want["rstd"], rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- the pass kernel

KERNEL_SHAPES = {"one row": (1, 8), "ragged": (1000, 1264), "tall": (4099, 776), "even": (2048, 3072)}


@pytest.mark.parametrize("shape", list(KERNEL_SHAPES))
def test_the_pass_kernel_matches_the_reference_and_repeats_itself_bit_for_bit(shape):
    """Every operand kind in 16-bit and fp32, three stores, the three folds (a max, a sum
    per row, a sum per column) over ragged edges and one-block extents, twice."""
    from test_passes import PASS_KERNEL

    m, n = KERNEL_SHAPES[shape]
    gen = torch.Generator().manual_seed(m + n)
    ops = {"x": torch.randn(m, n, generator=gen).bfloat16(), "y": torch.randn(m, n, generator=gen),
           "cv": torch.randn(m, generator=gen).bfloat16(), "r": torch.randn(n, generator=gen), "k": 0.75}
    with lowering("reference"):
        want = tile_pass(PASS_KERNEL.everything, **ops)
    with lowering("cute"), launch_ledger() as ledger:
        got = tile_pass(PASS_KERNEL.everything, **_cuda(ops))
        again = tile_pass(PASS_KERNEL.everything, **_cuda(ops))
    torch.cuda.synchronize()
    assert [launch.config for launch in ledger] == [pass_kernel.CONFIG] * 2
    _compare(f"pass kernel/{shape}", got, want)
    assert all(torch.equal(got[k], again[k]) for k in got), [k for k in got if not torch.equal(got[k], again[k])]


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_every_geometry_the_benchmark_sweeps_matches_the_reference(rows):
    """The geometries of bench/passes.py's sweep (a candidate default must pass this first):
    one to eight rows in flight, over 128 rows a block, at a ragged tall shape."""
    from test_passes import PASS_KERNEL

    m, n = 4099, 776
    gen = torch.Generator().manual_seed(rows)
    ops = {"x": torch.randn(m, n, generator=gen).bfloat16(), "y": torch.randn(m, n, generator=gen),
           "cv": torch.randn(m, generator=gen).bfloat16(), "r": torch.randn(n, generator=gen), "k": -1.5}
    with lowering("reference"):
        want = tile_pass(PASS_KERNEL.everything, **ops)
    g = pass_kernel.Geometry(rows, 8 // rows)
    with lowering("cute"), pass_kernel.geometry(g), launch_ledger() as ledger:
        got = tile_pass(PASS_KERNEL.everything, **_cuda(ops))
    torch.cuda.synchronize()
    assert [launch.config for launch in ledger] == [str(g)]
    _compare(f"pass kernel/{g}", got, want)


def test_the_pass_kernel_writes_over_what_it_reads_and_accumulates():
    """dGELU written over the saved pre-activation (``out=``), and ``accumulate_into``
    adding the result rounded to D's dtype, as quack's reduce-add store does."""
    m, n = 3000, 1032
    ops = _tiles(m, n, 5)
    dgelu = load_program(DGELU_ONLY, "pass_kernel_gpu").dgelu
    with lowering("reference"):
        want = tile_pass(dgelu, dy=ops["dy"], pre=ops["pre"].clone())
        base = torch.randn(m, n, generator=torch.Generator().manual_seed(6)).bfloat16()
        summed = base.clone()
        tile_pass(dgelu, dy=ops["dy"], pre=ops["pre"], accumulate_into=summed)
    dy, pre, acc = ops["dy"].cuda(), ops["pre"].cuda(), base.cuda()
    with lowering("cute"):
        tile_pass(dgelu, dy=dy, pre=pre, accumulate_into=acc)
        got = tile_pass(dgelu, dy=dy, pre=pre, out=pre)
    torch.cuda.synchronize()
    assert got["D"].data_ptr() == pre.data_ptr()
    _compare("pass kernel/out=", got, want)
    _compare("pass kernel/accumulate_into", {"D": acc}, {"D": summed})


DGELU_ONLY = '''
from coda_agent.primitives import *

@epilogue(reductions={"db": row_sum()})
def dgelu(dy: Tile, pre: Tile):
    dpre = dy * (0.5 * (1.0 + erf(pre * 0.7071067811865476)) + pre * exp(-0.5 * pre * pre) * 0.3989422804014327)
    return {"D": dpre, "db": dpre}
'''
