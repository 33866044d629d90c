"""The catalogue on the CPU: every primitive's reference lowering against a
direct PyTorch formula, and every kind of misuse rejected with a message that
names the fix (the sm_90a compile of every documented example:
test_primitives_compile.py)."""

from __future__ import annotations

import math

import pytest
import torch

from coda_agent.primitives import (CatalogueError, TileConfig, gemm, launch_ledger, layernorm_fold,
                                   load_program, lowering, normalize_rows, pad, render_catalogue, row_stats, tile_pass)
from coda_agent.primitives import aux
from coda_agent.primitives.catalogue import EXAMPLES

HEADER = "from coda_agent.primitives import *\n"
# (M, N, K); the last two are not tile multiples (rows stay 16-byte aligned, as TMA needs)
SHAPES = [(64, 96, 128), (200, 136, 64), (37, 248, 48)]
DTYPES = [torch.bfloat16, torch.float16]


def prog(src: str):
    return load_program(HEADER + src, "test")


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def operands_for(M, N, K, dtype, gen):
    A = rand(M, K, dtype=dtype, gen=gen)
    B = (rand(K, N, gen=gen) / math.sqrt(K)).to(dtype)
    return A, B, A.float() @ B.float()


def close(got, want, dtype):
    # Outputs are rounded once from fp32: allow one rounding step of the dtype.
    eps = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got.float(), want.float().to(dtype).float(),
                               atol=eps * 4, rtol=eps * 2)


# --------------------------------------------------------------------------- family 1


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_math_vocabulary_matches_torch(M, N, K, dtype, gen):
    P = prog('''
@epilogue(outputs={"a": "fp32", "b": "fp32", "c": "fp32", "d": "fp32", "e": "fp32", "f": "fp32",
                   "g": "fp32", "h": "fp32", "i": "fp32"})
def vocab(acc):
    x = acc * 0.5
    return {"D": exp(x) + exp2(x), "a": log(x * x + 1.0), "b": rsqrt(x * x + 1.0) + sqrt(x * x),
            "c": tanh(x) + sigmoid(x), "d": silu(x), "e": gelu_tanh(x),
            "f": maximum(x, 0.25) + minimum(x, -0.25), "g": where(x > 0.0, x, 0.1 * x),
            "h": fma(x, x, 1.0), "i": sin(x) + cos(x) + reciprocal(x * x + 1.0)}
'''.replace('"c": "fp32", ', '"c2": "fp32", ').replace('"c": tanh', '"c2": tanh'))
    A, B, acc = operands_for(M, N, K, dtype, gen)
    out = gemm(A, B, P.vocab, out_dtype="fp32")
    x = acc * 0.5
    want = {
        "D": torch.exp(x) + torch.exp2(x), "a": torch.log(x * x + 1), "b": torch.rsqrt(x * x + 1) + x.abs(),
        "c2": torch.tanh(x) + torch.sigmoid(x), "d": torch.nn.functional.silu(x),
        "e": torch.nn.functional.gelu(x, approximate="tanh"),
        "f": x.clamp_min(0.25) + x.clamp_max(-0.25), "g": torch.where(x > 0, x, 0.1 * x),
        "h": x * x + 1, "i": torch.sin(x) + torch.cos(x) + 1 / (x * x + 1)}
    for k, v in want.items():
        close(out[k], v, torch.float32)


@pytest.mark.parametrize("M,N,K", [(64, 96, 128), (200, 144, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_of_adjacent_columns(M, N, K, dtype, gen):
    P = prog('''
@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu(acc, gamma: RowVec):
    g, u = unpack(acc)
    gg, gu = unpack(gamma)
    return {"D": pack(g * gg, u * gu), "y": silu(g) * u}
''')
    A, B, acc = operands_for(M, N, K, dtype, gen)
    gamma = rand(N, gen=gen)
    out = gemm(A, B, P.swiglu, gamma=gamma)
    g, u = acc[:, 0::2], acc[:, 1::2]
    assert out["y"].shape == (M, N // 2) and out["D"].shape == (M, N)
    close(out["y"], torch.nn.functional.silu(g) * u, torch.bfloat16)
    close(out["D"], acc * gamma, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paired_tile_is_read_as_interleaved_pairs(dtype, gen):
    P = prog(EXAMPLES["paired tile"])
    M, N, K = 120, 72, 64
    A, B, acc = operands_for(M, N, K, dtype, gen)
    pre = rand(M, 2 * N, dtype=dtype, gen=gen)
    out = gemm(A, B, P.dswiglu, pre=pre)
    g, u = pre.float()[:, 0::2], pre.float()[:, 1::2]
    sig = torch.sigmoid(g)
    du, dg = acc * g * sig, acc * u * sig * (1 + g * (1 - sig))
    assert out["D"].dtype == dtype and out["D"].shape == (M, 2 * N)
    close(out["D"][:, 0::2], dg, dtype)
    close(out["D"][:, 1::2], du, dtype)
    close(out["postact"], g * sig * u, torch.bfloat16)
    torch.testing.assert_close(out["s"], (dg * g + du * u).sum(1), rtol=1e-5, atol=1e-4)


def test_beside_a_paired_tile_row_sums_fold_each_lane_per_pair(gen):
    """A gated backward's bias gradients in its own epilogue: beside a PairedTile the accumulator
    holds one value per pair, and a row_sum of a lane's value gives that lane's (N,) sums."""
    P = prog("""
@epilogue(reductions={"db_g": row_sum(), "db_u": row_sum()})
def dgate(acc, pre: PairedTile):
    g, u = unpack(pre)
    dg, du = acc * u * g, acc * g
    return {"D": pack(dg, du), "db_g": dg, "db_u": du}
""")
    M, N, K = 120, 72, 64
    A, B, acc = operands_for(M, N, K, torch.bfloat16, gen)
    pre = rand(M, 2 * N, dtype=torch.bfloat16, gen=gen)
    out = gemm(A, B, P.dgate, pre=pre)
    g, u = pre.float()[:, 0::2], pre.float()[:, 1::2]
    assert out["db_g"].shape == out["db_u"].shape == (N,)
    torch.testing.assert_close(out["db_g"], (acc * u * g).sum(0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out["db_u"], (acc * g).sum(0), rtol=1e-5, atol=1e-4)


def test_beside_a_paired_tile_a_row_vector_is_per_pair(gen):
    """A PairedTile (M, 2N) pass covers N outputs, pairs: a RowVec holds N values, one per pair,
    used on both lanes (its docstring says so); a per-column vector (2N) is refused by its shape."""
    P = prog("""
@epilogue()
def scale_pairs(pre: PairedTile, s: RowVec):
    g, u = unpack(pre)
    return {"D": pack(g * s, u * s)}
""")
    M, N = 64, 40
    pre = rand(M, 2 * N, dtype=torch.bfloat16, gen=gen)
    s = torch.rand(N, generator=gen)
    out = tile_pass(P.scale_pairs, pre=pre, s=s)["D"]
    assert out.shape == (M, 2 * N)
    close(out[:, 0::2], pre.float()[:, 0::2] * s, torch.bfloat16)
    close(out[:, 1::2], pre.float()[:, 1::2] * s, torch.bfloat16)
    with pytest.raises(CatalogueError, match=r"RowVec"):
        tile_pass(P.scale_pairs, pre=pre, s=torch.rand(2 * N, generator=gen))
    from coda_agent.primitives import PairedTile
    assert "one value per pair" in " ".join(PairedTile.__doc__.split())


# --------------------------------------------------------------------------- families 2-3


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vectors_tiles_and_output_dtypes(M, N, K, dtype, gen):
    P = prog('''
@epilogue(outputs={"h32": "fp32", "h16": "fp16"})
def vt(acc, residual: Tile, rstd: ColVec, gamma: RowVec, alpha: Scalar):
    h = (acc + residual) * rstd * gamma * alpha
    return {"D": h, "h32": h, "h16": h}
''')
    A, B, acc = operands_for(M, N, K, dtype, gen)
    res, rstd, gamma = rand(M, N, dtype=dtype, gen=gen), rand(M, gen=gen), rand(N, dtype=dtype, gen=gen)
    out = gemm(A, B, P.vt, residual=res, rstd=rstd, gamma=gamma, alpha=0.75)
    want = (acc + res.float()) * rstd[:, None] * gamma.float()[None, :] * 0.75
    assert out["D"].dtype == dtype and out["h32"].dtype == torch.float32
    assert out["h16"].dtype == torch.float16
    close(out["D"], want, dtype)
    close(out["h32"], want, torch.float32)
    close(out["h16"], want, torch.float16)


def test_accumulate_into_adds_in_place(gen):
    A, B, acc = operands_for(64, 96, 128, torch.bfloat16, gen)
    buf = rand(64, 96, dtype=torch.bfloat16, gen=gen)
    before = buf.clone()
    out = gemm(A, B, accumulate_into=buf)
    assert out["D"] is buf
    close(buf, before.float() + acc.to(torch.bfloat16).float(), torch.bfloat16)


def test_no_d_when_the_epilogue_returns_none(gen):
    P = prog(EXAMPLES["stateful"])
    A, B, _ = operands_for(64, 96, 128, torch.bfloat16, gen)
    out = gemm(A, B, P.lse_target, target=torch.randint(0, 96, (64,), generator=gen))
    assert set(out) == {"lse", "target_logit"}


# --------------------------------------------------------------------------- families 4-5


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("tile_n", [128, 192, 256])
def test_reductions_and_partials_layout(M, N, K, tile_n, gen):
    P = prog('''
@epilogue(reductions={"ss": col_sum(), "mx": col_max(), "cs": row_sum(), "part": col_sum(partials=True)})
def red(acc):
    return {"D": acc, "ss": acc * acc, "mx": acc, "cs": acc, "part": acc * acc}
''')
    A, B, acc = operands_for(M, N, K, torch.bfloat16, gen)
    out = gemm(A, B, P.red, config=TileConfig(tile_n=tile_n, cluster_m=1))
    torch.testing.assert_close(out["ss"], (acc * acc).sum(1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out["mx"], acc.amax(1))
    torch.testing.assert_close(out["cs"], acc.sum(0), rtol=1e-5, atol=1e-4)
    tiles = -(-N // tile_n)
    assert out["part"].shape == (M, tiles)
    for j in range(tiles):
        torch.testing.assert_close(out["part"][:, j], (acc[:, j * tile_n:(j + 1) * tile_n] ** 2).sum(1),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_online_lse_and_target_select(M, N, K, gen):
    P = prog(EXAMPLES["stateful"])
    A, B, acc = operands_for(M, N, K, torch.bfloat16, gen)
    target = torch.randint(0, N, (M,), generator=gen)
    target[0] = -100  # ignored rows are left at 0.0
    out = gemm(A, B, P.lse_target, target=target)
    torch.testing.assert_close(out["lse"], torch.logsumexp(acc, 1), rtol=1e-6, atol=1e-5)
    want = acc.gather(1, target.clamp_min(0).view(-1, 1)).view(-1)
    want[0] = 0.0
    torch.testing.assert_close(out["target_logit"], want)


@pytest.mark.parametrize("head_dim,pairs", [(64, False), (128, True)])
def test_head_rstd_is_per_row_and_head_of_the_raw_product(head_dim, pairs, gen):
    P = prog(f'''
@epilogue(head_stats={{"rstd": head_rstd(eps=1e-5, save=True)}}{', pairs="acc"' if pairs else ''})
def qkn(acc, rstd: HeadStat, gamma: RowVec):
    return {{"D": acc * rstd * gamma}}
''')
    M, N, K = 200, 3 * head_dim, 64
    A, B, acc = operands_for(M, N, K, torch.bfloat16, gen)
    gamma = rand(N, gen=gen)
    out = gemm(A, B, P.qkn, gamma=gamma, rstd=head_dim)
    heads = acc.view(M, N // head_dim, head_dim)
    rstd = torch.rsqrt(heads.pow(2).mean(-1) + 1e-5)
    torch.testing.assert_close(out["rstd"], rstd)
    close(out["D"], (heads * rstd[..., None]).view(M, N) * gamma, torch.bfloat16)
    with pytest.raises(CatalogueError, match=rf"tile_n 192 is not a multiple of head_dim {head_dim}"
                       if head_dim == 128 else r"N must be a multiple of 64"):
        if head_dim == 128:
            gemm(A, B, P.qkn, gamma=gamma, rstd=head_dim, config=TileConfig(tile_n=192))
        else:
            gemm(A, B[:, :96], P.qkn, gamma=gamma[:96], rstd=head_dim)


def test_head_rstd_without_eps_takes_it_at_the_call(gen):
    """head_rstd() leaves eps to the call, rstd=(head_dim, eps): each eps is an epilogue of its own
    (its own key, so its own kernel), made once, and a new eps under torch.compile(fullgraph=True)
    is no graph break (the launch op makes it); a declaration and a call that both give eps, or
    neither, are refused with the fix."""
    P = prog('''
@epilogue(head_stats={"rstd": head_rstd()})
def qkn(acc, rstd: HeadStat):
    return {"D": acc * rstd}

@epilogue(head_stats={"rstd": head_rstd(eps=1e-5)})
def fixed(acc, rstd: HeadStat):
    return {"D": acc * rstd}
''')
    M, N, K = 64, 128, 32
    A, B, acc = operands_for(M, N, K, torch.bfloat16, gen)
    A, B, acc = A * 1e-3, B, acc * 1e-3  # heads of tiny norm, where eps decides the result
    heads = acc.view(M, 2, 64)
    for eps in (1e-6, 1e-3):
        want = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)).view(M, N)
        close(gemm(A, B, P.qkn, rstd=(64, eps))["D"], want, torch.bfloat16)
    ops, eps = P.qkn.call_eps({"rstd": (64, 1e-6)})
    first, again, other = P.qkn.with_head_eps(eps), P.qkn.with_head_eps(1e-6), P.qkn.with_head_eps(1e-3)
    assert ops == {"rstd": 64} and first is again and first.head_stats["rstd"].eps == 1e-6
    assert len({P.qkn.key, first.key, other.key}) == 3 and P.fixed.call_eps({"rstd": 64}) == ({"rstd": 64}, None)
    compiled = torch.compile(lambda a, b, eps: gemm(a, b, P.qkn, rstd=(64, eps))["D"], fullgraph=True,
                             backend="aot_eager")
    for eps in (1e-6, 3e-4):  # one eps the eager calls made, one new
        assert torch.equal(compiled(A, B, eps), gemm(A, B, P.qkn, rstd=(64, eps))["D"])
    with pytest.raises(CatalogueError, match=r"declared head_rstd\(\) without eps, so the call gives it .*"
                                             r"rstd=\(head_dim, eps\)"):
        gemm(A, B, P.qkn, rstd=64)
    with pytest.raises(CatalogueError, match=r"fixes eps=1e-05 in its declaration; pass the head width alone"):
        gemm(A, B, P.fixed, rstd=(64, 1e-6))
    with pytest.raises(CatalogueError, match=r"eps must be a positive number; got 0"):
        gemm(A, B, P.qkn, rstd=(64, 0))


def test_head_stats_tile_whole_heads_up_to_the_widest_tile(gen):
    """Head widths a pingpong tile cannot hold run cooperative (Gemma's 256); wider ones are
    refused by name rather than by quack's tile check."""
    from coda_agent.primitives.tile_config import default_config

    P = prog('''
@epilogue(head_stats={"rstd": head_rstd(eps=1e-5)})
def qkn(acc, rstd: HeadStat):
    return {"D": acc * rstd}
''')
    assert default_config(P.qkn, {"rstd": 64}) == TileConfig(128, 128, 2, 1, True)
    assert default_config(P.qkn, {"rstd": 192}) == TileConfig(128, 192, 2, 1, True)
    assert default_config(P.qkn, {"rstd": 256}) == TileConfig(128, 256, 2, 1, False)
    A, B, _ = operands_for(64, 384, 64, torch.bfloat16, gen)
    with pytest.raises(CatalogueError, match=r"head_dim 384 is wider \(head statistics support head_dim up to 256"):
        gemm(A, B, P.qkn, rstd=384)


def test_head_stats_need_a_parameter():
    with pytest.raises(CatalogueError, match=r"needs a `name: HeadStat` parameter"):
        prog("@epilogue(head_stats={'r': head_rstd()})\ndef f(acc):\n    return {'D': acc}\n")


def test_aux_kernels(gen):
    sq = torch.rand(10, generator=gen) * 50
    torch.testing.assert_close(aux.rms_rstd(sq, 16, 1e-5), (sq / 16 + 1e-5) ** -0.5)
    x, g = rand(8, 32, dtype=torch.bfloat16, gen=gen), rand(32, dtype=torch.bfloat16, gen=gen)
    prep = aux.rms_prepare(x, g, 1e-6)
    torch.testing.assert_close(prep["rstd"], torch.rsqrt(x.float().pow(2).mean(1) + 1e-6))
    logits = rand(6, 50, dtype=torch.bfloat16, gen=gen)
    target = torch.tensor([1, 2, -100, 49, 0, 7])
    lse = torch.logsumexp(logits.float(), 1)
    dloss = torch.full((6,), 0.5)
    want = (torch.softmax(logits.float(), 1) - torch.nn.functional.one_hot(target.clamp_min(0), 50)) * 0.5
    want[2] = 0
    got = aux.xent_grad_(logits.clone(), lse, target, dloss)
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=1e-2)
    a, b = rand(4, 6, gen=gen), rand(4, 6, gen=gen)
    inter = aux.interleave_columns(a, b)
    torch.testing.assert_close(inter[:, 0::2], a)
    torch.testing.assert_close(aux.deinterleave_columns(inter)[1], b)


def test_ledger_records_every_launch(gen):
    P = prog(EXAMPLES["reduction"])
    A, B, _ = operands_for(64, 96, 128, torch.bfloat16, gen)
    with launch_ledger() as ledger:
        out = gemm(A, B, P.residual_rms, residual=rand(64, 96, dtype=torch.bfloat16, gen=gen),
                   gamma=rand(96, dtype=torch.bfloat16, gen=gen))
        aux.rms_rstd(out["sqsum"], 96, 1e-6)
    assert [(l.kind, l.name) for l in ledger] == [("gemm", "residual_rms"), ("aux", "rms_rstd")]


def test_catalogue_renders_every_export():
    text = render_catalogue()
    from coda_agent.primitives import PROGRAM_API

    for name in PROGRAM_API:
        assert name in text, name
    assert text.count("```python") >= len(EXAMPLES) + 1


# --------------------------------------------------------------------------- bad input


BAD_EPILOGUES = [
    ("@epilogue()\ndef f(acc, r):\n    return {'D': acc + r}\n", r"operand 'r' must declare its kind"),
    ("@epilogue()\ndef f(acc, r: Matrix):\n    return {'D': acc}\n", r"must declare its kind"),
    ("@epilogue()\ndef f(x):\n    return {'D': x}\n", r"operand 'x' must declare its kind"),
    ("@epilogue()\ndef f(x: Tile, acc):\n    return {'D': x}\n", r"`acc` .* must be the first parameter"),
    ("@epilogue()\ndef f():\n    return {}\n", r"takes no parameters"),
    ("@epilogue(pairs='acc')\ndef f(x: Tile):\n    return {'D': x}\n", r"no `acc`, so it is a pass.*pairs='acc'"),
    ("@epilogue()\ndef f(acc):\n    if acc > 0:\n        return {'D': acc}\n    return {'D': -acc}\n",
     r"an `if` statement is not allowed.*where\(cond, a, b\)"),
    ("@epilogue()\ndef f(acc):\n    return {'D': acc if acc > 0 else -acc}\n", r"conditional expression"),
    ("@epilogue()\ndef f(acc):\n    return {'D': acc, 'h': acc}\n", r"returns \['h'\], which are not declared"),
    ("@epilogue(outputs={'h': 'bf16'})\ndef f(acc):\n    return {'D': acc}\n", r"declares \['h'\] but does not"),
    ("@epilogue(outputs={'h': 'int8'})\ndef f(acc):\n    return {'D': acc, 'h': acc}\n", r"dtype 'int8'"),
    ("@epilogue(reductions={'s': 'sum'})\ndef f(acc):\n    return {'s': acc}\n", r"must be declared with col_sum"),
    ("@epilogue(reductions={'s': col_max(identity=0.0)})\ndef f(acc):\n    return {'s': acc}\n",
     r"ragged edge with identity -inf"),
    ("@epilogue()\ndef f(acc):\n    return {'D': acc * undefined_bias}\n", r"NameError.*undefined_bias"),
    ("@epilogue(pairs='acc')\ndef f(acc):\n    g, u = unpack(acc)\n    return {'D': g * u}\n",
     r"paired: return D as pack"),
    ("@epilogue()\ndef f(acc):\n    g, u = unpack(acc)\n    return {'D': g}\n", r"not a Pair"),
    # beside a PairedTile a RowVec is per pair, not per column as under pairs='acc': the error says so
    ("@epilogue()\ndef f(pre: PairedTile, freq: RowVec):\n    g, u = unpack(pre)\n    f, _ = unpack(freq)\n"
     "    return {'D': pack(g * f, u * f)}\n",
     r"not a Pair.*beside a PairedTile the other operands hold one value per pair.*without unpack"),
    ("@epilogue(pairs='acc', reductions={'r': row_sum()})\ndef f(acc):\n    return {'D': acc, 'r': acc}\n",
     r"not available in a paired epilogue.*row_sum\(\), one value per pair, beside a PairedTile"),
    ("@epilogue(reductions={'r': col_sum(partials=True)})\ndef f(acc, pre: PairedTile):\n"
     "    g, u = unpack(pre)\n    return {'D': pack(g, u), 'r': acc}\n", r"not available in a paired epilogue"),
    # c (logits, a cosine) is a name people give an operand; the error says it is reserved, why, and the rename
    ("@epilogue()\ndef f(c: Tile, lse: ColVec):\n    return {'D': c - lse}\n",
     r"'c' is a reserved name \(.*quack's name for its C operand.*\); rename it, e.g. 'c_'"),
    # out (a projection's output) is a name people give an operand; gemm and tile_pass take out= as the
    # destination, so the operand could never be passed: refused where it is declared, with the rename
    ("@epilogue()\ndef f(dy: Tile, out: Tile):\n    return {'D': dy * out}\n",
     r"operand 'out' has the name of gemm's and tile_pass's own parameter out=.*rename it, e.g. 'out_'"),
    ("@epilogue(outputs={'s': 'bf16'}, reductions={'s': col_sum()})\ndef f(acc):\n    return {'D': acc, 's': acc}\n",
     r"'s' used twice; operands, outputs and reductions need distinct names"),
]


@pytest.mark.parametrize("src,match", BAD_EPILOGUES)
def test_bad_epilogues_fail_at_load_with_the_fix(src, match):
    with pytest.raises(CatalogueError, match=match) as info:
        prog(src)
    assert info.value.line is not None


def test_bad_gemm_calls(gen):
    P = prog(EXAMPLES["tile"] + EXAMPLES["vector"])
    A, B, _ = operands_for(64, 64, 32, torch.bfloat16, gen)  # M == N on purpose
    r = rand(64, 64, dtype=torch.bfloat16, gen=gen)
    with pytest.raises(CatalogueError, match=r"operand 'residul' is not declared.*did you mean 'residual'"):
        gemm(A, B, P.residual_add, residul=r)
    with pytest.raises(CatalogueError, match=r"needs operand 'residual'"):
        gemm(A, B, P.residual_add)
    with pytest.raises(CatalogueError, match=r"declared Tile, which needs shape \(64, 64\)"):
        gemm(A, B, P.residual_add, residual=r[:, :10])
    with pytest.raises(CatalogueError, match=r"declared ColVec.*per-column values are a RowVec"):
        gemm(A, B, P.scale_rows, rstd=rand(64, 64, gen=gen), gamma=rand(64, gen=gen))
    saved = rand(64, 2, gen=gen)  # head_rstd's (M, heads): a head's column is strided, its copy's row is not
    with pytest.raises(CatalogueError, match=r"strided view.*must be contiguous.*`pad\(rstd.t\(\)\)`"):
        gemm(A, B, P.scale_rows, rstd=saved[:, 0], gamma=rand(64, gen=gen))
    gemm(A, B, P.scale_rows, rstd=pad(saved.t())[0], gamma=rand(64, gen=gen))
    with pytest.raises(CatalogueError, match=r"bf16, fp16 or fp8"):
        gemm(A.float(), B.float())
    with pytest.raises(CatalogueError, match=r"B must be \(K, N\)"):
        gemm(A, B.t())
    with pytest.raises(CatalogueError, match=r"Python number"):
        prog("@epilogue()\ndef f(acc, a: Scalar):\n    return {'D': acc * a}\n")  # loads fine
        gemm(A, B, load_program(HEADER + "@epilogue()\ndef f(acc, a: Scalar):\n    return {'D': acc * a}\n").f,
             a=torch.ones(1))
    with pytest.raises(CatalogueError, match=r"not called directly"):
        P.residual_add(1.0)
    with pytest.raises(CatalogueError, match=r"third argument must be an @epilogue"):
        gemm(A, B, lambda acc: acc)


def test_rows_must_be_16_byte_aligned_for_tma(gen):
    P = prog(EXAMPLES["pairwise"])
    A, B, _ = operands_for(64, 136, 64, torch.bfloat16, gen)  # y would be 68 bf16 columns
    with pytest.raises(CatalogueError, match=r"output 'y' \(68 columns\) has rows of 136 bytes.*multiple of 16"):
        gemm(A, B, P.swiglu)
    A, B, _ = operands_for(64, 100, 64, torch.bfloat16, gen)
    with pytest.raises(CatalogueError, match=r"B has rows of 200 bytes"):
        gemm(A, B)


def test_syntax_error_has_a_line():
    with pytest.raises(CatalogueError, match="syntax error") as info:
        load_program("def forward(:\n  pass\n")
    assert info.value.line == 1


def test_reference_lowering_is_selectable_on_cpu(gen):
    A, B, acc = operands_for(64, 96, 128, torch.bfloat16, gen)
    with lowering("reference"):
        close(gemm(A, B)["D"], acc, torch.bfloat16)
    with pytest.raises(CatalogueError, match="CUDA tensors"):
        with lowering("cute"):
            gemm(A, B)


def test_a_weight_applied_as_one_plus_w_is_a_gamma_offset(gen):
    """Gemma's RMSNorm and LayerNorm1P scale by 1 + w in fp32: ``gamma_offset=1.0`` gives what the
    same call gives on that fp32 weight, with no pass of the program's own to add the 1; a
    gamma_offset that is no number is refused."""
    bf = torch.bfloat16
    x, w, beta, B = (rand(64, 136, dtype=bf, gen=gen), rand(136, dtype=bf, gen=gen) * 0.1,
                     rand(136, dtype=bf, gen=gen), rand(136, 72, dtype=bf, gen=gen))
    one_plus = w.float() + 1.0
    a, b = aux.rms_prepare(x, w, 1e-6, gamma_offset=1.0), aux.rms_prepare(x, one_plus, 1e-6)
    assert torch.equal(a["xg"], b["xg"]) and torch.equal(a["rstd"], b["rstd"])
    want = x.float() * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6) * one_plus
    torch.testing.assert_close((a["xg"].float() * a["rstd"][:, None]), want, atol=2e-2, rtol=1e-2)
    f, g = layernorm_fold(B, w, beta, gamma_offset=1.0), layernorm_fold(B, one_plus, beta)
    assert all(torch.equal(f[k], g[k]) for k in f)
    st = row_stats(x, 1e-5)
    assert torch.equal(normalize_rows(x, st["rstd"], w, mean=st["mean"], beta=beta, gamma_offset=1.0),
                       normalize_rows(x, st["rstd"], one_plus, mean=st["mean"], beta=beta))
    with pytest.raises(CatalogueError, match=r"rms_prepare: gamma_offset is a number \(1.0 for a weight applied"):
        aux.rms_prepare(x, w, 1e-6, gamma_offset="1")


def test_operand_names_the_calls_take_as_their_own_are_refused():
    """Every named parameter of gemm, tile_pass and vector_pass is refused as an operand's name, so
    the list cannot fall behind a keyword the calls gain."""
    import inspect

    from coda_agent.primitives.epilogue import CALL_KEYWORDS
    from coda_agent.primitives.passes import tile_pass, vector_pass

    own = {name for call in (gemm, tile_pass, vector_pass) for name, p in inspect.signature(call).parameters.items()
           if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert own == CALL_KEYWORDS
