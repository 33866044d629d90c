"""Catalogue launches as torch.library custom ops (primitives/gemm.py, aux.py).

``torch.library.opcheck`` tests each op's registrations (schema and declared
mutations, fake against real, autograd registration, AOT dispatch with static
and dynamic shapes) on the reference lowering, the ops' CPU implementation;
``torch.compile(fullgraph=True)`` then proves that programs, Kernels and a
patched transformers model trace with no graph break (AOTAutograd, no code
generation) and compute what they compute eagerly.
"""

from __future__ import annotations

import importlib

import re

import pytest
import torch
from suite_checks import draw, task

from coda_agent.kernels import Kernel
from coda_agent.primitives import (CatalogueError, ColVec, HeadStat, PairedTile, RowVec, Scalar, Tile, aux, col_sum,
                                   epilogue, gemm, head_rstd, launch_ledger, online_lse, pack, row_sum, select_col,
                                   sigmoid, unpack)

G = importlib.import_module("coda_agent.primitives.gemm")


@epilogue(outputs={"hg": "bf16"}, reductions={"sq": col_sum(), "dg": row_sum()})
def norm_stats(acc, residual: Tile, gamma: RowVec, r: ColVec, scale: Scalar):
    h = acc * scale + residual
    return {"D": h * r, "hg": h * gamma, "sq": h * h, "dg": h}


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def swiglu(acc, rstd: ColVec):
    g, u = unpack(acc * rstd)
    return {"D": pack(g, u), "act": g * sigmoid(g) * u}


@epilogue(outputs={"act": "bf16"}, reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile):
    g, u = unpack(pre)
    sg = sigmoid(g)
    dg = acc * u * sg * (1.0 + g * (1.0 - sg))
    du = acc * g * sg
    return {"D": pack(dg, du), "act": g * sg * u, "s": g * dg + u * du}


@epilogue(reductions={"lse": online_lse(), "tl": select_col("target"), "part": col_sum(partials=True)})
def lse_target(acc):
    return {"lse": acc, "tl": acc, "part": acc}


@epilogue(head_stats={"rstd": head_rstd(1e-6, save=True)})
def head_norm(acc, rstd: HeadStat, gamma: RowVec):
    return {"D": acc * rstd * gamma}


def bf(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


M, K, N = 48, 64, 32
A, B = bf(M, K, seed=1), bf(K, N, seed=2) / 8
CALLS = {
    "tile, vectors, scalar, col and row sums": (norm_stats, dict(residual=bf(M, N, seed=3), gamma=bf(N, seed=4),
                                                                 r=torch.rand(M), scale=0.5)),
    "paired accumulator": (swiglu, dict(rstd=torch.rand(M))),
    "paired tile": (dswiglu, dict(pre=bf(M, 2 * N, seed=5))),
    "online lse, select, partials": (lse_target, dict(target=torch.randint(-1, N, (M,)))),
    "head statistic": (head_norm, dict(rstd=16, gamma=bf(N, seed=6))),
}


def op_args(epi, operands, dest=None, accumulate=False):
    """The coda::gemm arguments gemm() builds for this call."""
    tensors, scalars, ints = G._pack(epi, operands)
    m, n = A.shape[0], B.shape[1]
    dtype = operands[epi.paired_operand].dtype if epi.paired_operand else A.dtype
    results = epi.result_buffers(m, n, operands, dtype, -(-n // 128), A.device, dest)
    return (epi.key, A, B, tensors, scalars, ints, list(results.values()), accumulate, [], False, "gemm")


@pytest.mark.parametrize("name", list(CALLS))
def test_gemm_op_registrations(name):
    epi, operands = CALLS[name]
    torch.library.opcheck(torch.ops.coda.gemm.default, op_args(epi, operands))


def test_gemm_op_accumulates_and_overwrites_in_place():
    epi, operands = CALLS["paired tile"]
    pre = operands["pre"].clone()
    want = gemm(A, B, epi, pre=pre)
    got = gemm(A, B, epi, pre=pre, out=pre)  # D over the PairedTile it reads, dead afterwards
    # (on the reference lowering D is a new tensor and the dead one NaN: test_passes)
    assert torch.equal(got["D"], want["D"]) and torch.equal(got["s"], want["s"]) and pre.isnan().all()
    dead = bf(M, N, seed=8)
    assert torch.equal(gemm(A, B, out=dead)["D"], gemm(A, B)["D"]) and dead.isnan().all()  # the plain GEMM too
    torch.library.opcheck(torch.ops.coda.gemm.default, op_args(epi, {"pre": operands["pre"].clone()},
                                                              dest=operands["pre"].clone()))
    acc = bf(M, N, seed=9)
    torch.library.opcheck(torch.ops.coda.gemm.default, ("plain", A, B, [], [], [], [acc], True, [], False, "gemm"))
    before = acc.clone()
    assert gemm(A, B, accumulate_into=acc)["D"] is acc
    assert torch.allclose(acc.float(), before.float() + (A.float() @ B.float()), atol=0.1)


def test_plain_gemms_choose_the_library_for_the_whole_process_and_restore_it():
    """The switch holds for every thread while its block runs (autograd's CUDA backward runs
    on threads of its own) and is undone after it; an unknown library is refused by name; off
    CUDA nothing changes hands (the reference lowering runs the call)."""
    import threading

    from coda_agent.primitives import plain_gemms
    from coda_agent.primitives.lowering import plain_gemm_library

    seen = []
    with plain_gemms("cublas"):
        t = threading.Thread(target=lambda: seen.append(plain_gemm_library()))
        t.start()
        t.join()
        with launch_ledger() as launched:
            got = gemm(A, B)["D"]
    assert seen == ["cublas"] and plain_gemm_library() == "quack"
    assert [x.name for x in launched] == ["plain"] and launched[0].config != "cublas"  # the reference's tile
    assert torch.equal(got, gemm(A, B)["D"])
    with pytest.raises(ValueError, match="unknown plain-GEMM library 'cutlass'; choose one of"):
        with plain_gemms("cutlass"):
            pass


def test_destination_checks_name_the_fix():
    pre = CALLS["paired tile"][1]["pre"]
    with pytest.raises(CatalogueError, match="not both"):
        gemm(A, B, dswiglu, pre=pre, out=pre, accumulate_into=pre)
    with pytest.raises(CatalogueError, match=r"out is torch.float32, and D is torch.bfloat16"):
        gemm(A, B, out=torch.empty(M, N))
    square = bf(M, M)
    with pytest.raises(CatalogueError, match="out shares memory with A"):
        gemm(square, bf(M, M), out=square)
    # a view of A (the CPU's reference would have computed D apart and been right; the GPU races)
    with pytest.raises(CatalogueError, match="out shares memory with A"):
        gemm(square, bf(M, M), out=square.view(square.shape))
    both = bf(M, 2 * M)  # B is its left half, D its right: no overlap; D over B's columns: one
    gemm(bf(M, M), both[:, :M], accumulate_into=both[:, M:])
    with pytest.raises(CatalogueError, match="accumulate_into shares memory with B"):
        gemm(bf(M, M), both[:, :M], accumulate_into=both[:, M // 2:M // 2 + M])
    # a vector operand under D; a Tile operand that is D itself is read by the tile writing it
    stats, args = CALLS["tile, vectors, scalar, col and row sums"]
    r = torch.rand(M * N)
    with pytest.raises(CatalogueError, match="out shares memory with 'r'"):
        gemm(A, B, stats, **{**args, "r": r[:M]}, out_dtype="fp32", out=r.view(M, N))
    residual = bf(M, N, seed=3)
    gemm(A, B, stats, **{**args, "residual": residual}, out=residual)
    with pytest.raises(CatalogueError, match="run the program's forward and backward through"):
        gemm(A.clone().requires_grad_(True), B, swiglu, rstd=torch.rand(M))


def test_plain_gemm_op_is_differentiable():
    a, b = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.coda.mm.default, (a, b, torch.bfloat16, []))
    gemm(a, b)["D"].float().square().sum().backward()
    ra, rb = A.float().requires_grad_(True), B.float().requires_grad_(True)
    (ra @ rb).square().sum().backward()
    for got, want in ((a.grad, ra.grad), (b.grad, rb.grad)):
        assert (got.float() - want).norm() / want.norm() < 2e-2


AUX = {
    "rms_rstd": (torch.rand(M) * 10, 16, 1e-5),
    "rms_prepare": (bf(M, N), bf(N, seed=3), 1e-5),
    "xent_loss": (torch.randn(M), torch.randn(M), torch.randint(-1, N, (M,)), -1),
    "xent_grad": (bf(M, N), torch.randn(M).abs() + 3, torch.randint(0, N, (M,)), torch.rand(M), -100),
    "column_index": (N, torch.device("cpu")),
    "to_fp32": (bf(M, N),),
    "interleave_columns": (bf(K, N), bf(K, N, seed=7)),
    "deinterleave_columns": (bf(K, 2 * N),),
    "zeros_like": (bf(M, N),),
    "zeros": (5, torch.randn(3)),
    "broadcast": (torch.randn(1), 5, "fp32"),
    "add": (bf(M, N), bf(M, N, seed=8)),
    "concat_rows": ([torch.randn(3), torch.randn(5)],),
    # quantize_rows with an epilogue's amaxes given, quantize_both with a row scale and none
    "quantize_rows": (bf(M, N, seed=9), "fp8_e4m3", None, None, bf(M, N, seed=9).float().abs().amax(1)),
    "quantize_both": (bf(M, N), "fp8_e4m3", torch.rand(M) + 0.5, None, None),
}


DIFFERENTIABLE = {"rms_rstd", "rms_prepare", "xent_loss", "to_fp32", "interleave_columns", "deinterleave_columns",
                  "add", "concat_rows", "broadcast"}


@pytest.mark.parametrize("name", list(AUX))
def test_aux_op_registrations(name):
    args = AUX[name]
    if name in DIFFERENTIABLE:  # inputs that require grad: opcheck checks the autograd registration too
        args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
    torch.library.opcheck(getattr(torch.ops.coda, name).default, args)


@pytest.mark.parametrize("name,args", [("rms_rstd", lambda: (torch.rand(6, dtype=torch.float64) + 1, 4, 1e-3)),
                                       ("add", lambda: (torch.randn(3, 4, dtype=torch.float64),
                                                        torch.randn(3, 4, dtype=torch.float64))),
                                       ("rms_prepare", lambda: (torch.randn(4, 6, dtype=torch.float64),
                                                                torch.randn(6, dtype=torch.float64), 1e-3)),
                                       ("interleave_columns", lambda: (torch.randn(3, 2, dtype=torch.float64),
                                                                       torch.randn(3, 2, dtype=torch.float64))),
                                       ("deinterleave_columns", lambda: (torch.randn(3, 4, dtype=torch.float64),)),
                                       ("broadcast", lambda: (torch.randn((), dtype=torch.float64), 6)),
                                       ("xent_loss", lambda: (torch.randn(5, dtype=torch.float64),
                                                              torch.randn(5, dtype=torch.float64),
                                                              torch.tensor([0, -100, 2, 3, -100]), -100))])
def test_aux_derivatives_are_right(name, args):
    inputs = args()
    leaves = [t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in inputs]
    op = getattr(torch.ops.coda, name).default
    # The statistics are fp32 inside (as on the GPU): a step of 1e-3 keeps the numerical
    # Jacobian above their rounding.
    assert torch.autograd.gradcheck(lambda *xs: op(*xs), leaves, eps=1e-3, atol=2e-3, rtol=2e-3)


def test_zeros_pads_a_vector_in_its_dtype_and_refuses_what_is_no_length():
    f = torch.randn(3, dtype=torch.float32)
    z = aux.zeros(4, f)
    assert z.shape == (4,) and z.dtype == torch.float32 and not z.any()
    assert aux.concat_rows([f, aux.zeros(0, f), aux.zeros(2, f)]).tolist() == [*f.tolist(), 0.0, 0.0]
    assert aux.zeros(2, torch.ones(1, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(CatalogueError, match="zeros: n is -1; a vector's length is 0 or more"):
        aux.zeros(-1, f)
    with pytest.raises(CatalogueError, match="like must be a tensor; got float"):
        aux.zeros(2, 1.0)


def test_broadcast_repeats_a_trained_scalar_and_refuses_a_vector():
    """xIELU's slopes, PReLU's one slope: a one-element parameter read by every element of an epilogue
    as a RowVec; its gradient is the vector's sum, in the parameter's dtype and shape."""
    a = torch.tensor([0.75], dtype=torch.bfloat16)
    v = aux.broadcast(a, 6, "fp32")
    assert v.shape == (6,) and v.dtype == torch.float32 and v.tolist() == [0.75] * 6 and v.is_contiguous()
    assert aux.broadcast(a, 3).dtype == torch.bfloat16
    p = torch.tensor([2.0], requires_grad=True)
    (aux.broadcast(p, 4) * torch.arange(4.0)).sum().backward()
    assert p.grad.tolist() == [6.0]
    with pytest.raises(CatalogueError, match="broadcast: x has shape \\(3,\\); it repeats a one-element tensor"):
        aux.broadcast(torch.randn(3), 4)
    with pytest.raises(CatalogueError, match="broadcast: n is 0"):
        aux.broadcast(a, 0)


def test_zeros_take_a_dtype_and_name_the_ones_there_are():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert aux.zeros(5, x, "fp32").dtype == torch.float32 and aux.zeros(5, x).dtype == torch.bfloat16
    buf = aux.zeros_like(x, "fp32")
    assert buf.shape == x.shape and buf.dtype == torch.float32 and not buf.any()
    with pytest.raises(CatalogueError, match="zeros_like: dtype 'float32' is none of bf16, fp16, fp32"):
        aux.zeros_like(x, "float32")


def test_pad_appends_zeros_and_its_gradient_is_the_first_rows_and_columns():
    w = torch.randn(60, 8, dtype=torch.float64, requires_grad=True)
    p = aux.pad(w, rows=64)
    assert p.shape == (64, 8) and p.is_contiguous() and torch.equal(p[:60], w) and not p[60:].any()
    assert aux.pad(w, cols=16).shape == (60, 16) and aux.pad(w, 64, 16)[:, 8:].abs().sum() == 0
    assert aux.pad(torch.ones(3), rows=8).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert torch.autograd.gradcheck(lambda t: aux.pad(t, rows=61, cols=9), (w,))
    torch.library.opcheck(torch.ops.coda.pad.default, (w, 64, 8))
    for bad, says in [(dict(rows=59), "pad: rows=59; it pads to a whole number at least x's 60"),
                      (dict(cols=8.0 + 1), "pad: cols=9.0"), (dict(rows=True), "pad: rows=True")]:
        with pytest.raises(CatalogueError, match=re.escape(says)):
            aux.pad(w, **bad)
    with pytest.raises(CatalogueError, match="pads a 1-D tensor's rows or a 2-D tensor's rows and columns"):
        aux.pad(torch.ones(3), cols=4)


def test_concat_rows_derivative_is_right():
    parts = [torch.randn(2, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64,
                                                                                   requires_grad=True)]
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.coda.concat_rows([a, b]), parts)


def program(x, w, w2, residual, gamma, r):
    """A miniature program: two GEMMs with epilogues and an aux kernel between them."""
    a = gemm(x, w, norm_stats, residual=residual, gamma=gamma, r=r, scale=0.5)
    rstd = aux.rms_rstd(a["sq"], w.shape[1], 1e-5)
    y = gemm(a["hg"], w2, swiglu, rstd=rstd)
    return y["act"], y["D"], a["dg"]


def test_a_program_compiles_with_no_graph_break_and_launches_the_same():
    args = (A, B, bf(N, 2 * N, seed=11) / 6, bf(M, N, seed=12), bf(N, seed=13), torch.rand(M))
    with launch_ledger() as eager_launches:
        want = program(*args)
    torch._dynamo.reset()
    compiled = torch.compile(program, fullgraph=True, backend="aot_eager")
    compiled(*args)  # the trace (fake tensors: no launch is recorded for it)
    with launch_ledger() as compiled_launches:
        got = compiled(*args)
    assert [(x.kind, x.name) for x in compiled_launches] == [(x.kind, x.name) for x in eager_launches]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_kernel_trains_through_torch_compile():
    t = task("mlp_block")
    kernel = Kernel.from_files(t.expert_path, t.path)
    inputs, grads = draw(t, "small", seed=3)

    def loss(h, gamma, w_gu, w_down):
        return (kernel(h, gamma, w_gu, w_down)["y"].float() * grads["dy"].float()).sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [v.clone().requires_grad_(True) for v in inputs.values()]
        fn(*leaves).backward()
        results.append([leaf.grad for leaf in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Qwen2", "Phi3", "Granite", "Gemma"])
def test_a_patched_transformers_model_compiles_whole(family):
    """No graph break in a patched model, Qwen3's q/k norms, Qwen2's biases, Phi-3's fused
    projections, Granite's multipliers, Gemma's (1 + w) norms and a sliding layer included."""
    pytest.importorskip("transformers")
    import coda_agent
    from test_llama import assert_compiles_like_eager, batch, tiny, tiny_llama, with_biases

    overrides = {"Qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                 "Qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                 "Phi3": dict(sliding_window=8), "Granite": dict(residual_multiplier=0.22, logits_scaling=8.0)}
    base = tiny_llama() if family == "Llama" else tiny(family, **overrides.get(family, {}))
    if family == "Qwen2":
        base = with_biases(base)
    model = coda_agent.apply_to_llama(base.bfloat16(), swiglu=family != "Gemma")
    assert_compiles_like_eager(model, *batch())


def test_a_call_s_buffer_prefills_lie_inside_a_catalogue_range():
    """The verifier's launch audit attributes device work to ``coda::`` profiler ranges: a
    select's zero pre-fill, made before the op runs, must lie inside one too (else an honest
    program is rejected for work the catalogue did)."""
    from torch.profiler import profile

    with profile() as prof:
        gemm(A, B, lse_target, target=torch.randint(-1, N, (M,)))
    events = list(prof.events())
    ranges = [e.time_range for e in events if e.name.startswith("coda::")]
    fills = [e for e in events if e.name in ("aten::zeros", "aten::zero_", "aten::fill_", "aten::full")]
    assert fills, "the select's buffer is pre-filled"
    outside = [e.name for e in fills if not any(r.start <= e.time_range.start <= r.end for r in ranges)]
    assert not outside, outside


class SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_launches_skip_the_dispatcher_and_still_bump_versions():
    """In eager mode a launch runs its op's body directly (primitives/dispatch.py): the same
    results, the written tensors' version counters bumped as the op's would be, and the op
    itself wherever something watches the dispatcher or needs autograd."""
    epi, operands = CALLS["paired tile"]
    pre = operands["pre"].clone()
    want = gemm(A, B, epi, pre=pre)
    version = pre._version
    got = gemm(A, B, epi, pre=pre, out=pre)
    assert pre._version > version and torch.equal(got["D"], want["D"])
    logits = bf(M, N)
    version = logits._version
    aux.xent_grad_(logits, torch.randn(M).abs() + 3, torch.randint(0, N, (M,)), torch.rand(M), -100)
    assert logits._version > version

    with SeenOps() as seen:
        again = gemm(A, B, epi, pre=operands["pre"].clone())
        aux.rms_rstd(torch.rand(M) + 1, 16, 1e-5)
        gemm(A, B)
    assert {"coda.gemm.default", "coda.rms_rstd.default", "coda.mm.default"} <= set(seen.names), seen.names
    assert torch.equal(again["D"], want["D"])
    with pytest.warns(torch.jit.TracerWarning):  # the shape checks read sizes as Python values
        traced = torch.jit.trace(lambda a, b: gemm(a, b)["D"], (A, B))
    assert "coda::mm" in str(traced.graph)  # torch.jit.trace records the op, not its body

    sq = (torch.rand(M) + 1).requires_grad_(True)  # autograd still records the differentiable ops
    aux.rms_rstd(sq, 16, 1e-5).sum().backward()
    a = A.clone().requires_grad_(True)
    gemm(a, B)["D"].float().sum().backward()
    assert sq.grad is not None and a.grad is not None


def test_aux_arguments_are_checked_as_the_op_schema_would():
    with pytest.raises(CatalogueError, match="rms_rstd: dim must be int; got float"):
        aux.rms_rstd(torch.rand(M) + 1, 16.0, 1e-5)
    with pytest.raises(CatalogueError, match="rms_rstd: dim must be int; got Tensor"):
        aux.rms_rstd(torch.rand(M) + 1, torch.tensor(16), 1e-5)
    with pytest.raises(CatalogueError, match="eps must be float; got bool"):
        aux.rms_rstd(torch.rand(M) + 1, 16, True)
    assert aux.rms_rstd(torch.rand(M) + 1, 16, 1).shape == (M,)  # an int where a float goes, as the op admits
