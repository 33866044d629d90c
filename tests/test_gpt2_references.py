"""The GPT-2 suite's references are the right math (fp64, CPU): the layer they
model is torch's own nn.LayerNorm / nn.Linear / nn.GELU; the explicit backward
tasks equal autograd of the forward they differentiate; and the identities the
expert programs are built on hold (LayerNorm's rank-1 form through a GEMM, the
two row statistics of its backward read off the consuming GEMM's output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coda_agent.tasks.gpt2 import references as R
from coda_agent.tasks.gpt2 import references_blocks as RB

EPS = 1e-5


def _rand(*shape, gen, offset=0.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) + offset


def _layer(h_dim, i_dim, gen):
    """An nn.Module GPT-2 MLP sub-block (pre-LN, biases, exact GELU) with random affine parameters."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    ln = torch.nn.LayerNorm(h_dim, eps=EPS, dtype=torch.float64)
    fc = torch.nn.Linear(h_dim, i_dim, dtype=torch.float64)
    proj = torch.nn.Linear(i_dim, h_dim, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * _rand(h_dim, gen=gen))
        ln.bias.copy_(0.5 * _rand(h_dim, gen=gen))
    return ln, fc, proj


def test_mlp_block_is_torchs_pre_ln_mlp():
    gen = torch.Generator().manual_seed(0)
    ln, fc, proj = _layer(24, 96, gen)
    h = _rand(10, 24, gen=gen, offset=1.0)
    want = h + proj(torch.nn.GELU()(fc(ln(h))))
    got = RB.mlp_block(h=h, gamma=ln.weight, beta=ln.bias, w_fc=fc.weight, b_fc=fc.bias, w_proj=proj.weight,
                       b_proj=proj.bias, eps=EPS)["y"]
    torch.testing.assert_close(got, want.detach())


def test_block_composes_the_ops():
    """gpt2_block = out_proj_residual, then mlp_block, then ln_qkv on the new stream."""
    gen = torch.Generator().manual_seed(1)
    t, hd, i = 9, 16, 64
    p = {"attn": _rand(t, hd, gen=gen), "x": _rand(t, hd, gen=gen, offset=1.0), "w_o": _rand(hd, hd, gen=gen),
         "b_o": _rand(hd, gen=gen), "gamma_mlp": _rand(hd, gen=gen), "beta_mlp": _rand(hd, gen=gen),
         "w_fc": _rand(i, hd, gen=gen), "b_fc": _rand(i, gen=gen), "w_proj": _rand(hd, i, gen=gen),
         "b_proj": _rand(hd, gen=gen), "gamma_attn": _rand(hd, gen=gen), "beta_attn": _rand(hd, gen=gen),
         "w_qkv": _rand(3 * hd, hd, gen=gen), "b_qkv": _rand(3 * hd, gen=gen)}
    got = RB.gpt2_block(**p, eps=EPS)
    h = R.out_proj_residual(attn=p["attn"], x=p["x"], w_o=p["w_o"], b_o=p["b_o"])["h"]
    h_out = RB.mlp_block(h=h, gamma=p["gamma_mlp"], beta=p["beta_mlp"], w_fc=p["w_fc"], b_fc=p["b_fc"],
                         w_proj=p["w_proj"], b_proj=p["b_proj"], eps=EPS)["y"]
    qkv = R.ln_qkv(x=h_out, gamma=p["gamma_attn"], beta=p["beta_attn"], w_qkv=p["w_qkv"], b_qkv=p["b_qkv"],
                   eps=EPS)["qkv"]
    torch.testing.assert_close(got["h_out"], h_out)
    torch.testing.assert_close(got["qkv"], qkv)
    y = R.residual_layernorm(attn=p["attn"], x=p["x"], w_o=p["w_o"], b_o=p["b_o"], gamma=p["gamma_mlp"],
                             beta=p["beta_mlp"], w_fc=p["w_fc"], b_fc=p["b_fc"], eps=EPS)
    torch.testing.assert_close(y["h"], h)
    torch.testing.assert_close(y["y"], F.linear(R.layer_norm(h, p["gamma_mlp"], p["beta_mlp"], EPS),
                                                p["w_fc"], p["b_fc"]))


def test_layernorm_rank1_form():
    """LN(x) @ W^T = rstd * (x @ W'^T - mean * gw) + beta @ W^T with W' = W * gamma and
    gw = W' summed over its input dimension: the form every LayerNorm expert uses."""
    gen = torch.Generator().manual_seed(2)
    x, gamma, beta, w = _rand(7, 20, gen=gen, offset=3.0), _rand(20, gen=gen), _rand(20, gen=gen), _rand(30, 20, gen=gen)
    mean, var = x.mean(-1), x.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + EPS)
    folded = w * gamma
    got = rstd[:, None] * (x @ folded.t() - mean[:, None] * folded.sum(1)) + beta @ w.t()
    torch.testing.assert_close(got, R.layer_norm(x, gamma, beta, EPS) @ w.t())


def _layernorm_linear_grads(gen):
    t, hd, n = 11, 24, 40
    h = _rand(t, hd, gen=gen, offset=1.0).requires_grad_(True)
    gamma = (1 + 0.1 * _rand(hd, gen=gen)).requires_grad_(True)
    beta = _rand(hd, gen=gen).requires_grad_(True)
    w = _rand(n, hd, gen=gen).requires_grad_(True)
    b = _rand(n, gen=gen)
    du, dres = _rand(t, n, gen=gen), _rand(t, hd, gen=gen)
    u = F.linear(R.layer_norm(h, gamma, beta, EPS), w, b)
    grads = torch.autograd.grad(u, (h, gamma, beta, w), du)
    return (h.detach(), gamma.detach(), beta.detach(), w.detach(), b, u.detach(), du, dres), grads


def test_layernorm_bwd_is_autograd_of_the_forward():
    """With consistent statistics, the explicit backward equals autograd of
    u = LN(h) @ w^T + b, and s1, s2 are the row statistics the producing epilogue
    reduces from du and u: s1 = du . (gamma @ w^T), s2 = du . (u - b - beta @ w^T)."""
    (h, gamma, beta, w, b, u, du, dres), (dh, dgamma, dbeta, dw) = _layernorm_linear_grads(
        torch.Generator().manual_seed(3))
    mean = h.mean(-1)
    rstd = torch.rsqrt(h.var(-1, unbiased=False) + EPS)
    g = du @ w
    xhat = R.normalized(h, mean, rstd)
    s1, s2 = (gamma * g).sum(-1), (gamma * g * xhat).sum(-1)
    torch.testing.assert_close(s1, du @ (w @ gamma))
    torch.testing.assert_close(s2, (du * (u - b - w @ beta)).sum(-1))
    ref = R.layernorm_bwd(du=du, w=w, h=h, mean=mean, rstd=rstd, s1=s1, s2=s2, gamma=gamma, beta=beta, dres=dres)
    torch.testing.assert_close(ref["dx"], dh + dres)
    torch.testing.assert_close(ref["dgamma"], dgamma)
    torch.testing.assert_close(ref["dbeta"], dbeta)
    torch.testing.assert_close(ref["dw"], dw)
    torch.testing.assert_close(ref["ln"], R.layer_norm(h, gamma, beta, EPS))


def test_gelu_bwd_is_autograd_of_the_forward():
    gen = torch.Generator().manual_seed(4)
    pre = (2 * _rand(12, 32, gen=gen)).requires_grad_(True)
    b = torch.zeros(32, dtype=torch.float64, requires_grad=True)  # the bias that produced pre
    w_proj, dout = _rand(16, 32, gen=gen), _rand(12, 16, gen=gen)
    out = F.gelu(pre + b) @ w_proj.t()
    dpre, db = torch.autograd.grad(out, (pre, b), dout)
    ref = R.gelu_bwd(dout=dout, w_proj=w_proj, pre=pre.detach())
    torch.testing.assert_close(ref["dpre"], dpre)
    torch.testing.assert_close(ref["db"], db)
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(F.gelu(x).sum(), x)
    torch.testing.assert_close(R.gelu_grad(x.detach()), want)


def test_lm_head_xent_gradients_are_those_of_the_weighted_loss():
    gen = torch.Generator().manual_seed(5)
    t, hd, v = 8, 16, 50
    h, gamma, beta = _rand(t, hd, gen=gen, offset=1.0), 1 + 0.1 * _rand(hd, gen=gen), _rand(hd, gen=gen)
    wte, dloss = _rand(v, hd, gen=gen), _rand(t, gen=gen)
    target = torch.randint(0, v, (t,), generator=gen)
    got = RB.lm_head_xent(h=h, gamma=gamma, beta=beta, wte=wte, target=target, dloss=dloss, eps=EPS)
    leaves = [x.clone().requires_grad_(True) for x in (h, gamma, beta, wte)]
    ln = torch.nn.functional.layer_norm(leaves[0], (hd,), leaves[1], leaves[2], EPS)
    loss = F.cross_entropy(ln @ leaves[3].t(), target, reduction="none")
    want = torch.autograd.grad((loss * dloss).sum(), leaves)
    torch.testing.assert_close(got["loss"], loss.detach())
    for name, w in zip(("dh", "dgamma", "dbeta", "dwte"), want):
        torch.testing.assert_close(got[name], w, msg=name)


def test_outputs_are_rounded_to_the_activation_dtype():
    """In the low-precision run every activation-dtype output is rounded like the
    kernel's stores; fp32 statistics stay fp32."""
    gen = torch.Generator().manual_seed(6)
    t, hd, i = 8, 16, 64
    args = {"du": _rand(t, i, gen=gen), "w": _rand(i, hd, gen=gen), "h": _rand(t, hd, gen=gen), "mean": _rand(t, gen=gen),
            "rstd": _rand(t, gen=gen), "s1": _rand(t, gen=gen), "s2": _rand(t, gen=gen), "gamma": _rand(hd, gen=gen),
            "beta": _rand(hd, gen=gen), "dres": _rand(t, hd, gen=gen)}
    low = {k: (v.float() if k in ("mean", "rstd", "s1", "s2") else v.bfloat16()) for k, v in args.items()}
    out = R.layernorm_bwd(**low)
    assert {k: v.dtype for k, v in out.items()} == {"dx": torch.bfloat16, "ln": torch.bfloat16,
                                                    "dgamma": torch.float32, "dbeta": torch.float32,
                                                    "dw": torch.bfloat16}
