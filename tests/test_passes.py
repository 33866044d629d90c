"""The catalogue additions of the GPT-2 suite on the CPU: passes without a GEMM
(tile_pass, vector_pass), erf / exact gelu / 16-bit rounding, and LayerNorm's
statistics, rank-1 fold and row-scale, each through the reference lowering
against a direct PyTorch formula, misuse rejected with the fix named, and
(slow) compiled for sm_90a with HGMMA and no slow-path CALLs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from coda_agent.primitives import (CatalogueError, TileConfig, compile_only, erf, gelu, gemm, launch_ledger,
                                   layernorm_fold, layernorm_stats, load_program, lowering, normalize_rows,
                                   pass_kernel, round_bf16, round_fp16, row_stats, tile_pass, vector_pass)
from coda_agent.tasks.llama3.experts import swiglu_bwd

PROGRAM = load_program('''
from coda_agent.primitives import *

@epilogue(outputs={"act": "fp32"}, reductions={"db": row_sum(), "s": col_sum(), "part": col_sum(partials=True)})
def dgelu(dy: Tile, pre: Tile, scale: ColVec, shift: RowVec, alpha: Scalar):
    dpre = dy * (0.5 * (1.0 + erf(pre * 0.7071067811865476)) + pre * exp(-0.5 * pre * pre) * 0.3989422804014327)
    return {"D": dpre * scale + shift * alpha, "act": gelu(pre), "db": dpre, "s": dpre * pre, "part": dpre}

@epilogue(reductions={"s": col_sum()})
def dswiglu(dy: Tile, pre: PairedTile):
    g, u = unpack(pre)
    sg = sigmoid(g)
    dg = dy * u * sg * (1.0 + g * (1.0 - sg))
    du = dy * g * sg
    return {"D": pack(dg, du), "s": dg * g + du * u}

@epilogue(outputs={"r0": "fp32", "half": "bf16"})
def coeffs(mean: ColVec, rstd: ColVec, k: Scalar):
    return {"D": rstd * k, "r0": -rstd * mean, "half": mean * 0.5}

@epilogue()
def columns(g: RowVec):
    return {"D": g * g}

@epilogue()
def mixed(a: ColVec, b: RowVec):
    return {"D": a * b}

@epilogue()
def with_acc(acc, x: Tile):
    return {"D": acc + x}

@epilogue()
def vectors_only(v: ColVec):
    return {"D": v}
''', "passes_test")

# ragged on purpose: neither dimension a multiple of the 128 / 192 tiles
M, N = 200, 136


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20)


def _rand(*shape, gen, dtype=torch.bfloat16, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=gen) * scale + offset).to(dtype)


# --------------------------------------------------------------------------- tile_pass


def test_tile_pass_is_the_epilogue_over_its_tiles(gen):
    dy, pre = _rand(M, N, gen=gen), _rand(M, N, gen=gen, scale=2.0)
    scale, shift = torch.rand(M, generator=gen) + 0.5, _rand(N, gen=gen)
    with lowering("reference"), launch_ledger() as ledger:
        out = tile_pass(PROGRAM.dgelu, dy=dy, pre=pre, scale=scale, shift=shift, alpha=0.25,
                        config=TileConfig(tile_n=64, cluster_m=1))
    p = pre.double()
    dpre = dy.double() * (0.5 * (1 + torch.erf(p / math.sqrt(2))) + p * torch.exp(-p * p / 2) / math.sqrt(2 * math.pi))
    assert out["D"].dtype == torch.bfloat16  # the first Tile operand's dtype
    torch.testing.assert_close(out["D"].double(), (dpre * scale[:, None] + 0.25 * shift.double()).bfloat16().double())
    torch.testing.assert_close(out["act"].double(), F.gelu(p), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["db"].double(), dpre.sum(0), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out["s"].double(), (dpre * p).sum(1), atol=1e-4, rtol=1e-5)
    # partials are laid out per N tile of the config, as in a gemm
    want = torch.stack([dpre[:, j:j + 64].sum(1) for j in range(0, N, 64)], dim=1)
    torch.testing.assert_close(out["part"].double(), want, atol=1e-4, rtol=1e-5)
    assert [(entry.kind, entry.name) for entry in ledger] == [("pass", "dgelu")]


def test_tile_pass_traces_whole_under_torch_compile(gen):
    dy, pre = _rand(M, N, gen=gen), _rand(M, N, gen=gen, scale=2.0)
    scale, shift = torch.rand(M, generator=gen) + 0.5, _rand(N, gen=gen)

    def step(dy, pre):
        return tile_pass(PROGRAM.dgelu, dy=dy, pre=pre, scale=scale, shift=shift, alpha=0.25)["s"]

    with lowering("reference"):
        want = step(dy, pre)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(dy, pre)
    torch.testing.assert_close(got, want)


def test_tile_pass_reads_a_paired_tile_and_writes_its_width(gen):
    dy, pre = _rand(M, 72, gen=gen), _rand(M, 144, gen=gen)  # 72 pairs: 16-byte rows both ways
    with lowering("reference"):
        out = tile_pass(PROGRAM.dswiglu, dy=dy, pre=pre)
    g, u, d = pre[:, 0::2].double(), pre[:, 1::2].double(), dy.double()
    sg = torch.sigmoid(g)
    dg, du = d * u * sg * (1 + g * (1 - sg)), d * g * sg
    assert out["D"].shape == (M, 144)
    torch.testing.assert_close(out["D"][:, 0::2].double(), dg.bfloat16().double())
    torch.testing.assert_close(out["D"][:, 1::2].double(), du.bfloat16().double())
    torch.testing.assert_close(out["s"].double(), (dg * g + du * u).sum(1), atol=1e-4, rtol=1e-5)


def test_tile_pass_out_dtype_and_accumulate_into(gen):
    dy, pre = _rand(M, N, gen=gen), _rand(M, N, gen=gen)
    ops = dict(dy=dy, pre=pre, scale=torch.ones(M), shift=torch.zeros(N, dtype=torch.bfloat16), alpha=0.0)
    with lowering("reference"):
        fp32 = tile_pass(PROGRAM.dgelu, out_dtype="fp32", **ops)["D"]
        buf = torch.ones(M, N, dtype=torch.bfloat16)
        same = tile_pass(PROGRAM.dgelu, accumulate_into=buf, **ops)["D"]
    assert fp32.dtype == torch.float32 and same is buf
    torch.testing.assert_close(buf.float(), (1 + fp32.bfloat16().float()).bfloat16().float())


def test_tile_pass_writes_d_over_a_tile_it_reads(gen):
    """out= takes a dead tensor D may be written into, which may be the Tile the fn reads (each
    element is read before it is written): the result is the same as into a new buffer.  The
    reference lowering holds the program to "dead": D is a new tensor and ``out`` is NaN after the
    call, its version moved as an in-place op's would (a saved tensor reused so is caught by
    autograd).  (The cute lowering writes into ``out`` itself: the GPU tier.)"""
    dy, pre = _rand(M, N, gen=gen), _rand(M, N, gen=gen, scale=2.0)
    ops = dict(dy=dy, scale=torch.rand(M, generator=gen) + 0.5, shift=_rand(N, gen=gen), alpha=0.5)
    with lowering("reference"):
        fresh = tile_pass(PROGRAM.dgelu, pre=pre, **ops)
        buf, version = pre.clone(), pre.clone()._version
        over = tile_pass(PROGRAM.dgelu, pre=buf, out=buf, **ops)
    assert over["D"] is not buf and buf.isnan().all() and buf._version > version
    torch.testing.assert_close(over["D"], fresh["D"], rtol=0, atol=0)
    torch.testing.assert_close(over["db"], fresh["db"], rtol=0, atol=0)
    with lowering("reference"), pytest.raises(CatalogueError, match=r"out is torch.float32, and D is torch.bfloat16"):
        tile_pass(PROGRAM.dgelu, pre=pre, out=torch.zeros(M, N), **ops)


def test_accumulating_over_a_paired_tile_is_the_pass_kernels_alone(gen):
    """quack's kernel reads a PairedTile as its C operand and its reduce-add store has none, so
    accumulate_into with a PairedTile is refused, in every lowering, wherever quack's kernel
    would run it: a gemm, and a tile_pass given a config."""
    dy, pre = _rand(M, 72, gen=gen), _rand(M, 144, gen=gen)
    with lowering("reference"):
        tile_pass(PROGRAM.dswiglu, dy=dy, pre=pre, accumulate_into=torch.zeros(M, 144, dtype=torch.bfloat16))
        with pytest.raises(CatalogueError, match="pass kernel only, a tile_pass without config"):
            tile_pass(PROGRAM.dswiglu, dy=dy, pre=pre, config=TileConfig(tile_n=128, cluster_m=1),
                      accumulate_into=torch.zeros(M, 144, dtype=torch.bfloat16))
        with pytest.raises(CatalogueError, match="gemm: accumulate_into with a PairedTile"):
            gemm(_rand(M, 64, gen=gen), _rand(64, 72, gen=gen), swiglu_bwd.dswiglu, pre=pre,
                 accumulate_into=torch.zeros(M, 144, dtype=torch.bfloat16))


BAD_PASSES = [
    (lambda: tile_pass(PROGRAM.with_acc, x=torch.zeros(8, 8, dtype=torch.bfloat16)),
     r"reads `acc`, but a pass runs no GEMM.*drop the `acc` parameter"),
    (lambda: tile_pass(PROGRAM.vectors_only, v=torch.zeros(8)), r"no Tile or PairedTile operand.*vector_pass"),
    (lambda: tile_pass(PROGRAM.dswiglu, dy=torch.zeros(8, 8, dtype=torch.bfloat16),
                       pre=torch.zeros(8, 8, dtype=torch.bfloat16)), r"operand 'pre' is declared PairedTile"),
    (lambda: tile_pass(PROGRAM.dswiglu, dy=torch.zeros(8, 8, dtype=torch.bfloat16)),
     r"tile_pass: epilogue 'dswiglu' needs operand 'pre'; pass tile_pass\(dswiglu, pre=\.\.\.\)"),
    (lambda: tile_pass(lambda x: x, x=1), r"must be an @epilogue function"),
    (lambda: gemm(torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(8, 8, dtype=torch.bfloat16),
                  PROGRAM.vectors_only, v=torch.zeros(8)), r"takes no `acc`, so it is a pass.*tile_pass"),
    (lambda: vector_pass(PROGRAM.mixed, a=torch.zeros(4), b=torch.zeros(4)), r"ColVec .* or RowVec .* not both"),
    (lambda: vector_pass(PROGRAM.dgelu, dy=torch.zeros(4, 4)), r"fold nothing.*tile_pass"),
    (lambda: vector_pass(PROGRAM.coeffs, mean=torch.zeros(4), rstd=torch.zeros(5), k=1.0),
     r"operand 'rstd' is declared ColVec, which needs shape \(4,\)"),
    (lambda: vector_pass(PROGRAM.coeffs, mean=torch.zeros(4, 2), rstd=torch.zeros(4, 2), k=1.0),
     r"operand 'mean' is declared ColVec and needs a 1-D tensor"),
    (lambda: vector_pass(PROGRAM.coeffs, mean=torch.zeros(4), rstd=torch.zeros(4)),
     r"needs operand 'k'; pass vector_pass\(coeffs, k=\.\.\.\)"),
]


@pytest.mark.parametrize("call,match", BAD_PASSES)
def test_bad_pass_calls_name_the_fix(call, match):
    with lowering("reference"), pytest.raises(CatalogueError, match=match):
        call()


# --------------------------------------------------------------------------- vector_pass


def test_vector_pass_is_the_fn_on_vectors(gen):
    mean, rstd = torch.randn(M, generator=gen), torch.rand(M, generator=gen) + 0.5
    with launch_ledger() as ledger:
        out = vector_pass(PROGRAM.coeffs, mean=mean, rstd=rstd, k=3.0)
        cols = vector_pass(PROGRAM.columns, g=torch.arange(6.0))["D"]
    assert {k: (tuple(v.shape), v.dtype) for k, v in out.items()} == {
        "D": ((M,), torch.float32), "r0": ((M,), torch.float32), "half": ((M,), torch.bfloat16)}
    torch.testing.assert_close(out["D"], rstd * 3.0)
    torch.testing.assert_close(out["r0"], -rstd * mean)
    torch.testing.assert_close(out["half"], (mean * 0.5).bfloat16())
    torch.testing.assert_close(cols, torch.arange(6.0) ** 2)
    assert [(entry.kind, entry.name) for entry in ledger] == [("aux", "coeffs"), ("aux", "columns")]


# --------------------------------------------------------------------------- math


def test_erf_gelu_and_rounding_match_torch():
    x = torch.linspace(-6, 6, 2001)
    torch.testing.assert_close(erf(x), torch.erf(x))
    torch.testing.assert_close(gelu(x), F.gelu(x), atol=1e-6, rtol=1e-6)
    assert torch.equal(round_bf16(x * 1.001), (x * 1.001).bfloat16().float())
    assert torch.equal(round_fp16(x * 1.001), (x * 1.001).half().float())
    assert erf(0.5) == pytest.approx(math.erf(0.5)) and round_bf16(1.0 + 2**-10) == 1.0


def test_math_on_numbers_is_not_tensor_compute():
    """A param rounded in an epilogue (``round_bf16(limit)``: the reference lowering hands it as a
    Python float) is the catalogue's arithmetic on numbers: the verifier's audit of the program's
    PyTorch calls (a TorchFunctionMode) sees none of it."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            raise AssertionError(f"PyTorch call {func} on numbers")

    with Seen():
        assert round_bf16(0.593) == 0.59375 and erf(0.0) == 0.0


# --------------------------------------------------------------------------- RMSNorm's entry pass


@pytest.mark.parametrize(("shape", "gamma_dtype"), [((M, N), torch.bfloat16), ((1000, 200), torch.float32)],
                         ids=["even", "ragged-fp32-gamma"])
def test_rms_prepare_as_a_pass_gives_the_bits_of_its_pytorch_body(gen, shape, gamma_dtype):
    """rms_prepare's CUDA body (one tile pass) against its PyTorch body: x * gamma bit for bit,
    the inverse RMS to fp32 rounding (the sum of squares folds in another order)."""
    from coda_agent.primitives.aux import _rms_prepare_torch, rms_prepare_pass

    x = _rand(*shape, gen=gen, scale=3.0)
    gamma = _rand(shape[1], gen=gen, offset=1.0).to(gamma_dtype)
    xg, rstd = rms_prepare_pass(x, gamma, 1e-6)
    want_xg, want_rstd = _rms_prepare_torch(x, gamma, 1e-6)
    assert xg.dtype == x.dtype and torch.equal(xg, want_xg)
    torch.testing.assert_close(rstd, want_rstd, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_rms_prepare_compiles_onto_the_pass_kernel():
    from coda_agent.primitives.aux import rms_prepare_pass

    with compile_only() as kernels:
        rms_prepare_pass(torch.randn(512, 1024).bfloat16(), torch.randn(1024).bfloat16(), 1e-6)
    (k,) = kernels
    assert (k.kind, k.config) == ("pass", pass_kernel.CONFIG)
    assert k.sass.sm90a and k.sass.spill_stores == 0 and k.sass.calls == 0, k.sass


# --------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("width", [N, 40], ids=["wide", "narrower-than-the-shift"])
def test_row_stats_and_layernorm_stats(gen, width):
    """row_stats sums x less a shift per row: a mean 60x the spread costs its variance nothing, where
    E[x^2] - mean^2 (layernorm_stats, from a producing epilogue's sums) errs by ~2^-12 here."""
    x = _rand(M, width, gen=gen, scale=0.5, offset=30.0)
    with launch_ledger() as ledger:
        st = row_stats(x, 1e-5)
    var, mean = torch.var_mean(x.double(), dim=1, correction=0)
    torch.testing.assert_close(st["mean"].double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st["rstd"].double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
    assert [(e.kind, e.name) for e in ledger] == [("aux", "row_stats")]  # the pass inside adds no entry
    # x = a + bias from the sums of a, a^2 and a * bias: what a biased producing epilogue folds
    a, bias = _rand(M, N, gen=gen, scale=0.5, offset=1.0).double(), _rand(N, gen=gen).double()
    var, mean = torch.var_mean(a + bias, dim=1, correction=0)
    st = layernorm_stats(a.sum(1).float(), (a * a).sum(1).float(), N, 1e-5, bias=bias.float(),
                         bias_dot=(a * bias).sum(1).float())
    torch.testing.assert_close(st["mean"].double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st["rstd"].double(), torch.rsqrt(var + 1e-5), rtol=1e-4, atol=0)
    with pytest.raises(CatalogueError, match="give bias and bias_dot together"):
        layernorm_stats(a.sum(1).float(), (a * a).sum(1).float(), N, 1e-5, bias=bias.float())


@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_layernorm_fold_is_the_rank1_form(layout, gen):
    k, n = 72, 136
    w = _rand(n, k, gen=gen, scale=1 / math.sqrt(k))  # nn.Linear (out, in)
    gamma, beta, bias = _rand(k, gen=gen, scale=0.1, offset=1.0), _rand(k, gen=gen), _rand(n, gen=gen)
    B = w.t() if layout == "transposed" else w.t().contiguous()
    with launch_ledger() as ledger:
        fold = layernorm_fold(B, gamma, beta, bias)
    assert [(e.kind, e.name) for e in ledger] == [("aux", "layernorm_fold")]
    assert fold["B"].shape == B.shape and fold["B"].stride() == B.stride() and fold["B"].dtype == B.dtype
    assert torch.equal(fold["B"], (B.float() * gamma.float()[:, None]).bfloat16())
    # gw sums the weight as stored (rounded), so centring through it is exact
    torch.testing.assert_close(fold["gw"].double(), fold["B"].double().sum(0), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(fold["c"].double(), beta.double() @ B.double() + bias.double(), atol=1e-5, rtol=1e-5)
    # the catalogue's rank-1 form through a GEMM equals LayerNorm then the GEMM, at a large mean
    x = _rand(M, k, gen=gen, scale=0.5, offset=20.0)
    st = row_stats(x, 1e-5)
    epi = load_program('''
from coda_agent.primitives import *
@epilogue()
def ln_rank1(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}
''', "rank1").ln_rank1
    with lowering("reference"):
        y = gemm(x, fold["B"], epi, out_dtype="fp32", mean=st["mean"], rstd=st["rstd"], gw=fold["gw"],
                 shift=fold["c"])["D"]
    want = F.linear(F.layer_norm(x.double(), (k,), gamma.double(), beta.double(), 1e-5), w.double(), bias.double())
    # within a few bf16 roundings of the folded weight on a centred x: nothing proportional to the mean
    assert float((y.double() - want).abs().max()) < 2e-2 * float(want.abs().max())


def test_layernorm_fold_rejects_shapes_and_layouts_with_the_fix(gen):
    B = _rand(16, 24, gen=gen)
    with pytest.raises(CatalogueError, match=r"gamma needs shape \(16,\) for B of shape \(16, 24\)"):
        layernorm_fold(B, torch.ones(24), torch.zeros(16))
    with pytest.raises(CatalogueError, match=r"bias needs shape \(24,\)"):
        layernorm_fold(B, torch.ones(16), torch.zeros(16), torch.zeros(16))
    with pytest.raises(CatalogueError, match=r"strides .* row-major \(K, N\), or the transposed view"):
        layernorm_fold(_rand(16, 48, gen=gen)[:, ::2], torch.ones(16), torch.zeros(16))


def test_normalize_rows_materializes_layernorm_and_rmsnorm(gen):
    x = _rand(M, N, gen=gen, offset=2.0)
    gamma, beta = _rand(N, gen=gen, scale=0.1, offset=1.0), _rand(N, gen=gen)
    st = row_stats(x, 1e-5)
    ln = normalize_rows(x, st["rstd"], gamma, mean=st["mean"], beta=beta)
    want = F.layer_norm(x.double(), (N,), gamma.double(), beta.double(), 1e-5)
    assert ln.dtype == torch.bfloat16
    torch.testing.assert_close(ln.double(), want, atol=2e-2, rtol=1e-2)
    rstd = torch.rsqrt(x.float().pow(2).mean(1) + 1e-6)
    rms = normalize_rows(x, rstd, gamma)
    torch.testing.assert_close(rms.double(), (x.double() * rstd.double()[:, None] * gamma.double()), atol=2e-2, rtol=1e-2)
    bare = normalize_rows(x, st["rstd"], None, mean=st["mean"])  # OLMo's LayerNorm: no weight, no bias
    torch.testing.assert_close(bare.double(), F.layer_norm(x.double(), (N,), eps=1e-5), atol=2e-2, rtol=1e-2)


def test_layernorm_fold_of_a_norm_without_weight_or_bias_is_the_weight_itself(gen):
    """OLMo's non-parametric LayerNorm: gamma and beta None fold to B unchanged and c = 0 (+ bias)."""
    B, bias = _rand(72, 136, gen=gen), _rand(136, gen=gen)
    fold = layernorm_fold(B, None, None, bias)
    assert torch.equal(fold["B"], B)
    torch.testing.assert_close(fold["gw"].double(), B.double().sum(0), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(fold["c"], bias.float())


# --------------------------------------------------------------------------- sm_90a compile


@pytest.mark.slow
def test_passes_and_layernorm_kernels_compile_for_sm90a(gen):
    """Every pass kind (Tile, PairedTile, reductions and partials) and the
    LayerNorm kernels (both fold layouts) compile for sm_90a with no slow-path
    CALL (erf included) and no spills: untuned on the pass kernel (no MMA), with
    a tile config on quack's zero mainloop (its HGMMA in the SASS)."""
    dy, pre = _rand(M, N, gen=gen), _rand(M, N, gen=gen)
    narrow = TileConfig(tile_n=128, cluster_m=1)
    w = _rand(N, 72, gen=gen)
    with compile_only() as kernels:
        tile_pass(PROGRAM.dgelu, dy=dy, pre=pre, scale=torch.ones(M), shift=torch.ones(N), alpha=1.0, config=narrow)
        tile_pass(PROGRAM.dswiglu, dy=_rand(M, 72, gen=gen), pre=_rand(M, 144, gen=gen), config=narrow)
        tile_pass(PROGRAM.dswiglu, dy=_rand(M, 72, gen=gen), pre=_rand(M, 144, gen=gen))
        st = row_stats(dy, 1e-5)
        normalize_rows(dy, st["rstd"], torch.ones(N), mean=st["mean"], beta=torch.zeros(N))
        layernorm_fold(w.t(), torch.ones(72), torch.zeros(72))
        layernorm_fold(w, torch.ones(N), torch.zeros(N))
    names = [(k.epilogue, k.config) for k in kernels]
    own = pass_kernel.CONFIG
    assert names == [("dgelu", str(narrow)), ("dswiglu", str(narrow)), ("dswiglu", own), ("row_moments", own),
                     ("normalize", own), ("layernorm_fold", own), ("layernorm_fold", own)], names
    for k in kernels:
        s = k.sass
        assert k.kind == "pass" and s is not None and s.sm90a, (k.epilogue, s)
        assert s.hgmma == 0 if k.config == own else s.hgmma > 0, (k.epilogue, k.config, s)
        assert s.calls == 0 and s.spill_stores == 0 and s.spill_loads == 0, (k.epilogue, k.config, s)


PASS_KERNEL = load_program('''
from coda_agent.primitives import *

@epilogue(outputs={"e": "fp32", "h": "bf16"}, reductions={"mx": col_max(), "s": col_sum(), "cs": row_sum()})
def everything(x: Tile, y: Tile, cv: ColVec, r: RowVec, k: Scalar):
    v = x * k + y * cv + r
    return {"D": v, "e": exp(v * 0.1), "h": v * v, "mx": v, "s": v * x, "cs": v}

@epilogue(outputs={"q": "fp8_e4m3"})
def to_fp8(x: Tile):
    return {"D": x, "q": x}

@epilogue(reductions={"lse": online_lse()})
def lse(x: Tile):
    return {"lse": x}
''', "pass_kernel_test")


def _plan(epi, **operands):
    m, n = next(v.shape for v in operands.values() if isinstance(v, torch.Tensor) and v.dim() == 2)
    bufs = epi.result_buffers(m, n, operands, torch.bfloat16, 1, torch.device("cpu"))
    return pass_kernel.plan_for(epi, operands, bufs, accumulate=False)


def test_the_pass_kernel_takes_the_streaming_passes_and_names_what_it_leaves_to_quack(gen):
    """Tiles, a PairedTile, vectors, scalars, any mix of 16-bit and fp32, extra outputs and
    the three plain folds run on the pass kernel; what it cannot stream (fp8 stores, the
    partials whose layout is a GEMM tile's, LSE, a transposed or misaligned Tile) says why."""
    x, y = _rand(M, N, gen=gen), _rand(M, N, gen=gen, dtype=torch.float32)
    vecs = {"cv": torch.ones(M, dtype=torch.bfloat16), "r": torch.ones(N), "k": 0.5}
    plan, why = _plan(PASS_KERNEL.everything, x=x, y=y, **vecs)
    assert why == "" and plan is not None
    assert [n for n, _ in plan.tiles] == ["x", "y"] and plan.scalars == (("k", 0.5),)
    assert [n for n, _ in plan.stores] == ["D", "e", "h"]
    assert plan.per_row == (("mx", "max"), ("s", "add")) and plan.per_col == ("cs",)
    paired, why = _plan(PROGRAM.dswiglu, dy=_rand(M, 72, gen=gen), pre=_rand(M, 144, gen=gen))
    assert why == "" and paired.tiles == (("dy", torch.bfloat16),) and paired.pair == ("pre", torch.bfloat16)
    assert [n for n, _ in paired.stores] == ["D"] and paired.per_row == (("s", "add"),)
    refused = {
        "pair misaligned": _plan(PROGRAM.dswiglu, dy=_rand(M, 72, gen=gen),
                                 pre=_rand(M, 160, gen=gen)[:, 4:148]),
        "partials": _plan(PROGRAM.dgelu, dy=x, pre=x, scale=torch.ones(M), shift=torch.ones(N), alpha=1.0),
        "fp8": _plan(PASS_KERNEL.to_fp8, x=x),
        "lse": _plan(PASS_KERNEL.lse, x=x),
        "transposed": _plan(PASS_KERNEL.everything, x=_rand(N, M, gen=gen).t(), y=y, **vecs),
        "misaligned": _plan(PASS_KERNEL.everything, x=_rand(M, N + 8, gen=gen)[:, 4:N + 4], y=y, **vecs),
    }
    whys = {case: why for case, (plan, why) in refused.items()}
    assert all(plan is None for plan, _ in refused.values()), whys
    assert "'pre'" in whys["pair misaligned"] and "partials" in whys["partials"] and "'q'" in whys["fp8"], whys
    assert "online_lse" in whys["lse"] and "'x'" in whys["transposed"] and "'x'" in whys["misaligned"], whys


@pytest.mark.slow
def test_every_geometry_compiles_spill_free_and_fewer_rows_in_flight_hold_fewer_registers(gen):
    """What the H200 sweep (bench/passes.py) trades: rows a thread loads before their math
    against the registers that decide how many CTAs share an SM."""
    x = _rand(M, N, gen=gen)
    registers = {}
    for rows in (1, 2, 4, 8):
        g = pass_kernel.Geometry(rows, 8 // rows)
        with compile_only() as kernels, pass_kernel.geometry(g):
            tile_pass(PASS_KERNEL.everything, x=x, y=x, cv=torch.ones(M), r=torch.ones(N), k=2.0)
        (k,) = kernels
        assert k.config == str(g) and k.sass.spill_stores == 0 and k.sass.calls == 0, (k.config, k.sass)
        registers[rows] = k.sass.registers
    assert registers[1] <= registers[2] <= registers[4] <= registers[8], registers


def test_an_untuned_pass_runs_on_the_pass_kernel_and_a_tuned_one_on_quack(gen):
    """A pass given a tile config (the tuner's candidates, a program's choice) keeps quack's
    zero mainloop, where a TileConfig means something; untuned, the same pass compiles onto
    the pass kernel; both for sm_90a, as the compile stage records them."""
    x = _rand(M, N, gen=gen)
    with compile_only() as kernels:
        tile_pass(PASS_KERNEL.everything, x=x, y=x, cv=torch.ones(M), r=torch.ones(N), k=2.0)
        tile_pass(PASS_KERNEL.everything, x=x, y=x, cv=torch.ones(M), r=torch.ones(N), k=2.0,
                  config=TileConfig(tile_n=128, cluster_m=1))
    assert [(k.kind, k.config, k.sass.hgmma > 0) for k in kernels] == [
        ("pass", pass_kernel.CONFIG, False), ("pass", "128x128 c1x1 pingpong", True)]
    assert kernels[0].sass.spill_stores == 0 and kernels[0].sass.calls == 0


# --------------------------------------------------------------------------- padded lanes


def test_padded_lanes_fold_what_the_kernel_folds(gen):
    """In padded_lanes mode a sum over a ragged edge adds what the fn returns in the
    padded lanes (the accumulator and Tiles are 0 there, vectors stale); a max, an
    LSE and the stores see only the real extent.  A fold that multiplies its vector
    by the accumulator is unchanged; one that adds it is not."""
    from coda_agent.primitives.lowering import padded_lanes

    P = load_program('''
from coda_agent.primitives import *

@epilogue(outputs={"o": "bf16"}, reductions={"s": col_sum(), "t": row_sum(), "mx": col_max(), "lse": online_lse()})
def probe(acc, b: RowVec, r: ColVec, x: Tile):
    return {"D": acc + b, "o": x * r, "s": acc * b + x, "t": acc * r, "mx": acc + b, "lse": acc + b}

@epilogue(reductions={"s": col_sum(), "t": row_sum()})
def adds_vectors(acc, b: RowVec, r: ColVec):
    return {"s": acc + b, "t": acc * r + r}
''', "padded_probe")
    A, B = _rand(M, 64, gen=gen), _rand(64, N, gen=gen)
    ops = dict(b=torch.randn(N, generator=gen), r=torch.randn(M, generator=gen), x=_rand(M, N, gen=gen))
    with lowering("reference"):
        plain = gemm(A, B, P.probe, **ops)
        plain_bad = gemm(A, B, P.adds_vectors, b=ops["b"], r=ops["r"])
        with padded_lanes():
            padded = gemm(A, B, P.probe, **ops)
            padded_bad = gemm(A, B, P.adds_vectors, b=ops["b"], r=ops["r"])
    for k in plain:
        torch.testing.assert_close(padded[k], plain[k], atol=1e-4, rtol=1e-5)
    for k in ("s", "t"):  # ragged in both dimensions: every row and column sum is off
        assert (padded_bad[k] - plain_bad[k]).abs().min() > 1.0, k
