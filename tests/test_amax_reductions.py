"""The amax reductions, ``col_amax()`` and ``row_amax()`` (family 4): the largest absolute value
along each row and down each column, the current scales of an fp8 cast reduced by the epilogue
that writes the tensor.  The reference lowering against direct PyTorch math in every epilogue
mode, and the cute lowering compiled for sm_90a on the CPU; the GPU tier's cases are in
test_primitives_gpu.py (``amax``, ``paired_amax``, ``beside_amax``, ``amax_pass``)."""

from __future__ import annotations

import pytest
import torch

from coda_agent.primitives import TileConfig, compile_only, gemm, load_program, tile_pass
from test_primitives import SHAPES, operands_for, rand
from test_primitives_gpu import EXTRA, HEADER

# The epilogues are the GPU tier's cases, so the CPU checks and the H200's check one program.
AMAXES = HEADER + "".join(EXTRA[case] for case in ("amax", "paired_amax", "beside_amax", "amax_pass"))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_amax_reductions_fold_absolute_values_each_way_and_per_pair(M, N, K, gen):
    """col_amax/row_amax: the largest |value| along each row / down each column; in a pairs="acc"
    epilogue one value per pair (or a Pair, whose lanes fold into it), beside a PairedTile one per
    accumulator column, as row_sum is."""
    P = load_program(AMAXES, "amaxes")
    A, B, acc = operands_for(M, 2 * N, K, torch.bfloat16, gen)
    s = rand(M, gen=gen)  # negative factors too: the fold takes absolute values
    out = gemm(A, B, P.amax, s=s)
    v = acc * s[:, None]
    assert torch.equal(out["ra"], v.abs().amax(1)) and torch.equal(out["ca"], v.abs().amax(0))
    out = gemm(A, B, P.paired_amax)
    g, u = acc[:, 0::2], acc[:, 1::2]
    assert out["ca"].shape == (N,) and torch.equal(out["ca"], (g * u).abs().amax(0))
    assert torch.equal(out["ra"], (g * u).abs().amax(1))
    assert torch.equal(out["pa"], torch.maximum(g.abs(), u.abs()).amax(0))  # a Pair's lanes fold into its value
    pre = rand(M, 4 * N, gen=gen).to(torch.bfloat16)
    out = gemm(A, B, P.beside_amax, pre=pre)
    pg, pu = pre.float()[:, 0::2], pre.float()[:, 1::2]
    assert out["cg"].shape == out["cu"].shape == (2 * N,)
    assert torch.equal(out["cg"], (acc * pg).abs().amax(0)) and torch.equal(out["cu"], (acc * pu).abs().amax(0))
    assert torch.equal(out["ra"], torch.maximum((acc * pg).abs(), (acc * pu).abs()).amax(1))


@pytest.mark.slow
def test_amax_reductions_compile_in_paired_epilogues_spill_free():
    """col_amax/row_amax (quack's max.abs folds) in a pairs="acc" epilogue and beside a
    PairedTile: the two epilogues of an fp8 SwiGLU that reduce their casts' amaxes, the second
    on the cooperative tile a promoting fp8 GEMM gives it (on the pingpong 128x128 of a bf16
    GEMM it spills about 20 registers each way)."""
    P = load_program(AMAXES, "amaxes")
    A, B = rand(256, 128, dtype=torch.bfloat16), rand(128, 384, dtype=torch.bfloat16)
    with compile_only() as kernels:
        gemm(A, B, P.paired_amax)
        gemm(A, B, P.beside_amax, pre=rand(256, 768, dtype=torch.bfloat16),
             config=TileConfig(tile_n=128, cluster_m=1, cluster_n=2, pingpong=False))
    assert len(kernels) == 2
    for k in kernels:
        assert k.sass.hgmma > 0 and k.sass.spill_stores == 0 and k.sass.spill_loads == 0, (k.config, k.sass)


@pytest.mark.slow
def test_a_tile_pass_reduces_amaxes_over_quack_s_zero_mainloop(gen):
    """The catalogue's own pass kernel folds sums and col_max only; a pass with an amax runs as the
    epilogue of quack's GEMM over a zero mainloop, which compiles, and the reference folds it."""
    P = load_program(AMAXES, "amaxes")
    x, s = rand(300, 200, dtype=torch.bfloat16, gen=gen), rand(300, gen=gen)
    out = tile_pass(P.amax_pass, x=x, s=s)
    v = x.float() * s[:, None]
    assert torch.equal(out["ra"], v.abs().amax(1)) and torch.equal(out["ca"], v.abs().amax(0))
    with compile_only() as kernels:
        tile_pass(P.amax_pass, x=x, s=s)
    (k,) = kernels
    assert k.kind == "pass" and k.sass.sm90a and k.sass.spill_stores == 0
