"""LLaMA-3 suite, tasks 1-7 (their specs and static checks: tests/test_suite_specs.py):
references are the right math, and the expert programs match their references (CPU,
reference lowering); their sm_90a compile is in tests/test_expert_compiles.py.

The reference check is the verifier's own (tests/suite_checks.py): its inputs
(make_inputs / make_grads), its references (run_reference in fp64 for ref_hi and in
the inputs' dtype for ref_lo) and its compare with the task's tolerance:
max|out - ref_hi| <= factor * max|ref_lo - ref_hi| + floor and
||out - ref_hi|| / ||ref_hi|| <= rel_norm.
"""

from __future__ import annotations

import math

import pytest
import torch
from suite_checks import draw, load_expert, mutant_problems, problems, run_program
from suite_checks import task as _task

from coda_agent.primitives import lowering
from coda_agent.tasks.llama3 import references as R

TASKS = ["out_proj_residual", "residual_rmsnorm", "swiglu_fwd", "swiglu_bwd", "rmsnorm_bwd",
         "rope_fwd", "rope_bwd"]


# --------------------------------------------------------------------------- experts vs references


@pytest.mark.parametrize("shape_set", ["small", "ragged"])
@pytest.mark.parametrize("name", TASKS)
def test_expert_matches_reference(name, shape_set):
    """Every output and gradient passes the verifier's compare; inputs stay unmodified."""
    bad = problems(_task(name), shape_set, seed=1234 + TASKS.index(name))
    assert not bad, f"{name}/{shape_set}:\n" + "\n".join(bad)


MUTANTS = [
    ("out_proj_residual", '"dresidual": dy}', '"dresidual": gemm(dy, saved["Wo"].t())["D"]}'),
    ("residual_rmsnorm", '"sqsum": h * h', '"sqsum": h * h * gamma'),
    ("residual_rmsnorm", "rms_rstd(first[\"sqsum\"], W0.shape[1], eps)", "rms_rstd(first[\"sqsum\"], 2 * W0.shape[1], eps)"),
    ("swiglu_fwd", "silu(g) * u", "silu(u) * g"),
    ("swiglu_bwd", '"s": dg * g + du * u', '"s": dg * g'),
    ("swiglu_bwd", "pack(dg, du)", "pack(du, dg)"),
    ("rmsnorm_bwd", "dx = dres + r *", "dx = r *"),
    ("rmsnorm_bwd", "xr * (s * inv_dim)", "x * (s * inv_dim)"),
    ("rmsnorm_bwd", '"dgamma": acc * xr', '"dgamma": acc * x'),
    ("rope_fwd", "e * c - o * s, e * s + o * c", "e * c + o * s, o * c - e * s"),
    ("rope_bwd", "e * c + o * s, o * c - e * s", "e * c - o * s, e * s + o * c"),
]


@pytest.mark.parametrize("name,old,new", MUTANTS)
def test_check_catches_broken_experts(name, old, new):
    """The verifier's check is sharp enough to reject a one-token bug in each expert."""
    assert mutant_problems(_task(name), old, new, "ragged", seed=11), f"mutant {new!r} of {name} passed"


def test_gradient_tasks_have_backward():
    assert _task("out_proj_residual").spec.gradients == ["attn", "Wo", "residual"]
    for name in TASKS[1:]:
        assert not _task(name).spec.has_backward


def test_out_proj_residual_dresidual_is_dy():
    task = _task("out_proj_residual")
    inputs, grads = draw(task, "small", seed=7)
    with lowering("reference"):
        got = run_program(task, load_expert(task), inputs, grads)
    assert got["dresidual"] is grads["dy"]


# --------------------------------------------------------------------------- the references' math


def _rand(*shape, gen, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def test_swiglu_bwd_reference_is_autograd_of_forward():
    """dpre, postact and s of the explicit reference equal autograd of
    out = (silu(g) * u) @ W_down, and s = sum(du_pre * pre) is the RMSNorm
    statistic sum_cols(d(pre) * pre)."""
    gen = torch.Generator().manual_seed(0)
    T, H, I = 16, 12, 10
    pre = _rand(T, 2 * I, gen=gen).requires_grad_(True)
    W_down = _rand(I, H, gen=gen)
    dout = _rand(T, H, gen=gen)
    g, u = pre[:, 0::2], pre[:, 1::2]
    out = (torch.nn.functional.silu(g) * u) @ W_down
    (dpre,) = torch.autograd.grad(out, pre, dout)
    ref = R.swiglu_bwd(dout=dout, W_down=W_down, pre=pre.detach())
    torch.testing.assert_close(ref["dpre"], dpre)
    torch.testing.assert_close(ref["postact"], (torch.nn.functional.silu(g) * u).detach())
    torch.testing.assert_close(ref["s"], (dpre * pre.detach()).sum(-1))
    # de-interleaving: the swiglu_fwd reference uses the same layout
    x, W_gu = _rand(T, H, gen=gen), _rand(H, 2 * I, gen=gen)
    fwd = R.swiglu_fwd(x=x, W_gu=W_gu)
    gate, up = x @ W_gu[:, 0::2], x @ W_gu[:, 1::2]
    torch.testing.assert_close(fwd["y"], torch.nn.functional.silu(gate) * up)


def test_rmsnorm_bwd_reference_is_autograd_of_forward():
    """With consistent r = rstd(x) and s = sum_cols(du * u), the explicit
    formulas equal autograd of u = RMSNorm(x, gamma) @ W (and dres passes through)."""
    gen = torch.Generator().manual_seed(1)
    T, H, N, eps = 16, 24, 20, 1e-5
    x = _rand(T, H, gen=gen).requires_grad_(True)
    gamma = (1 + 0.1 * _rand(H, gen=gen)).requires_grad_(True)
    W = _rand(H, N, gen=gen).requires_grad_(True)
    du, dres = _rand(T, N, gen=gen), _rand(T, H, gen=gen)
    u = R.rms_norm(x, gamma, eps) @ W
    dx, dgamma, dW = torch.autograd.grad(u, (x, gamma, W), du)
    r = torch.rsqrt(x.detach().pow(2).mean(-1) + eps)
    s = (du * u.detach()).sum(-1)
    ref = R.rmsnorm_bwd(du=du, W=W.detach(), r=r, s=s, gamma=gamma.detach(), x=x.detach(), dres=dres)
    torch.testing.assert_close(ref["dx"], dx + dres)
    torch.testing.assert_close(ref["dgamma"], dgamma)
    torch.testing.assert_close(ref["dW"], dW)
    torch.testing.assert_close(ref["xrg"], x.detach() * r[:, None] * gamma.detach())
    # and the forward reparameterization: RMSNorm(h) @ W1 == r * ((h * gamma) @ W1)
    torch.testing.assert_close(u.detach(), r[:, None] * ((x * gamma) @ W).detach())


def _llama3_inv_freq(n_heads, n_kv, d, theta=500000.0):
    """Per-pair frequencies of a whole QKV row: theta^(-2i/d) for pair i of each q and k
    head, 0 on the v columns."""
    per_head = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.cat([per_head.repeat(n_heads + n_kv), torch.zeros(n_kv * d // 2, dtype=torch.float64)])


def _meta_rope(xq, pos, d, theta=500000.0):
    """Meta's LLaMA reference RoPE (complex multiply of adjacent pairs), on (T, n, d)."""
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    freqs_cis = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), torch.outer(pos, freqs))
    xc = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2)


def test_rope_reference_matches_meta_llama_convention():
    gen = torch.Generator().manual_seed(2)
    T, nh, nkv, d = 9, 4, 2, 16
    pre = _rand(T, (nh + 2 * nkv) * d, gen=gen)
    pos = torch.randint(0, 131072, (T,), generator=gen).double()
    got = R.rope_rotate(pre, pos, _llama3_inv_freq(nh, nkv, d))
    q, k, v = pre.split([nh * d, nkv * d, nkv * d], dim=1)
    want = torch.cat([_meta_rope(q.view(T, nh, d), pos, d).reshape(T, -1),
                      _meta_rope(k.view(T, nkv, d), pos, d).reshape(T, -1), v], dim=1)
    torch.testing.assert_close(got, want)


def test_rope_inverse_is_the_backward_of_rope():
    """Both directions: the inverse rotation is the VJP of the forward rotation, and
    rotating forward then inverse is the identity."""
    gen = torch.Generator().manual_seed(3)
    T, P = 11, 8
    x = _rand(T, 2 * P, gen=gen).requires_grad_(True)
    pos = torch.randint(0, 131072, (T,), generator=gen).double()
    f = torch.rand(P, generator=gen, dtype=torch.float64) * 2 - 1
    dy = _rand(T, 2 * P, gen=gen)
    (dx,) = torch.autograd.grad(R.rope_rotate(x, pos, f), x, dy)
    torch.testing.assert_close(R.rope_rotate(dy, pos, f, inverse=True), dx)
    torch.testing.assert_close(R.rope_rotate(R.rope_rotate(x, pos, f), pos, f, inverse=True), x.detach())
    # the rope_bwd task is the chain rule through q_rot = R(a) q_pre for the dq/dk GEMMs
    q_pre = _rand(T, 2 * P, gen=gen).requires_grad_(True)
    k_pre = _rand(T, 2 * P, gen=gen).requires_grad_(True)
    q, k = R.rope_rotate(q_pre, pos, f), R.rope_rotate(k_pre, pos, f)
    dS = _rand(T, T, gen=gen)
    scores = q @ k.t()  # dL/dscores = dS
    dq_pre, dk_pre = torch.autograd.grad(scores, (q_pre, k_pre), dS)
    ref = R.rope_bwd(dS=dS, q=q.detach(), k=k.detach(), pos=pos, inv_freq=f)
    torch.testing.assert_close(ref["dq"], dq_pre)
    torch.testing.assert_close(ref["dk"], dk_pre)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_rope_experts_with_llama3_frequencies(direction):
    """The experts with the real LLaMA-3 table (theta 500000, v columns unrotated) and
    long-context positions, against Meta's convention in fp64."""
    from coda_agent.primitives import load_program

    gen = torch.Generator().manual_seed(4)
    T, H, nh, nkv, d = 200, 64, 2, 1, 64
    pos = torch.randint(0, 131072, (T,), generator=gen).float()
    with lowering("reference"):
        if direction == "fwd":
            mod = load_program(_task("rope_fwd").expert_path.read_text(), "rope_fwd_llama3")
            x = torch.randn(T, H, generator=gen).bfloat16()
            W = (torch.randn(H, (nh + 2 * nkv) * d, generator=gen) / math.sqrt(H)).bfloat16()
            inv_freq = _llama3_inv_freq(nh, nkv, d).float()
            got = mod.forward(x=x, W_qkv=W, pos=pos, inv_freq=inv_freq)["qkv"]
            pre = x.double() @ W.double()
            q, k, v = pre.split([nh * d, nkv * d, nkv * d], dim=1)
            want = torch.cat([_meta_rope(q.view(T, nh, d), pos.double(), d).reshape(T, -1),
                              _meta_rope(k.view(T, nkv, d), pos.double(), d).reshape(T, -1), v], dim=1)
            # the v columns are bit-exact passthrough of the rounded accumulator
            assert torch.equal(got[:, -nkv * d:], v.bfloat16())
        else:
            mod = load_program(_task("rope_bwd").expert_path.read_text(), "rope_bwd_llama3")
            dS = (torch.randn(T, T, generator=gen) / math.sqrt(T)).bfloat16()
            q, k = torch.randn(T, d, generator=gen).bfloat16(), torch.randn(T, d, generator=gen).bfloat16()
            inv_freq = _llama3_inv_freq(1, 0, d).float()
            got = mod.forward(dS=dS, q=q, k=k, pos=pos, inv_freq=inv_freq)["dq"]
            g = dS.double() @ k.double()
            # inverse rotation = multiply by the conjugate
            want = _meta_rope(g.view(T, 1, d), -pos.double(), d).reshape(T, -1)
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 8e-3, rel
    # fp32 angles at positions up to 128K are off by <= ulp(1.3e5)/2 rad: bf16-level error
    assert float((got.double() - want).abs().max()) < 0.05 * float(want.abs().max())
