"""PyTorch references for the GPT-2 suite's per-op tasks (the composed tasks,
LM head, MLP sub-block and whole block, are in references_blocks.py).

A pre-LN GPT-2 layer, every linear with a bias (weights stored
(out_features, in_features) as ``nn.Linear`` keeps them)::

    qkv = LN(x; gamma_attn, beta_attn) @ w_qkv^T + b_qkv         (attention input)
    h   = x + attn @ w_o^T + b_o                                 (out-proj + residual)
    h2  = h + gelu(LN(h; gamma_mlp, beta_mlp) @ w_fc^T + b_fc) @ w_proj^T + b_proj

GELU is the exact one, ``0.5 x (1 + erf(x / sqrt(2)))`` (``nn.GELU()``'s
default; Hugging Face's GPT-2 checkpoint uses the tanh approximation
``gelu_new``, which the catalogue has as ``gelu_tanh``; the mlp_block_tanh task,
references_blocks.py, is the MLP sub-block with it).

Contract (tasks/spec.py): ``fn(**inputs, **params) -> {output: tensor}``,
computed in the dtype of the inputs it is given; the verifier calls it with
the inputs upcast (fp64 on CPU, fp32 on GPU: the truth) and in their own dtype
(bf16: the noise floor of CODA's tolerance rule).  LayerNorm computes its
statistics and the normalisation in at least fp32 and rounds its result to
the input dtype, as ``F.layer_norm`` does for bf16 tensors; every output
declared in the activation dtype is rounded to it at the end.

Tasks whose math *is* a backward (layernorm_bwd, gelu_bwd) are forward-only
tasks with explicit math; tests/test_gpt2_suite.py checks that math against
autograd of the forward it differentiates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def hi(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64): where real kernels keep statistics."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension: statistics and affine map in (at least)
    fp32, the result rounded to x's dtype."""
    return F.layer_norm(hi(x), x.shape[-1:], hi(gamma), hi(beta), eps).to(x.dtype)


def normalized(h: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """xhat = (h - mean) * rstd with per-row (T,) statistics."""
    return (h - mean[:, None]) * rstd[:, None]


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx = Phi(x) + x * phi(x) for the exact GELU."""
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


# --------------------------------------------------------------------------- ln_qkv


def ln_qkv(x, gamma, beta, w_qkv, b_qkv, eps):
    """qkv = LN(x) @ w_qkv^T + b_qkv: the entry LayerNorm (its input comes from no
    GEMM: the embeddings of the first layer) and the fused QKV projection."""
    return {"qkv": F.linear(layer_norm(x, gamma, beta, eps), w_qkv, b_qkv).to(x.dtype)}


# --------------------------------------------------------------------------- out_proj_residual


def out_proj_residual(attn, x, w_o, b_o):
    """h = x + attn @ w_o^T + b_o (attention output projection, bias, residual)."""
    return {"h": (x + F.linear(attn, w_o, b_o)).to(x.dtype)}


# --------------------------------------------------------------------------- residual_layernorm


def residual_layernorm(attn, x, w_o, b_o, gamma, beta, w_fc, b_fc, eps):
    """h = x + attn @ w_o^T + b_o (the new residual stream, rounded to x's dtype as
    the block stores it); y = LN(h) @ w_fc^T + b_fc (the MLP's first GEMM, before
    its activation)."""
    h = (x + F.linear(attn, w_o, b_o)).to(x.dtype)
    y = F.linear(layer_norm(h, gamma, beta, eps), w_fc, b_fc)
    return {"h": h, "y": y.to(x.dtype)}


# --------------------------------------------------------------------------- layernorm_bwd


def layernorm_bwd(du, w, h, mean, rstd, s1, s2, gamma, beta, dres):
    """LayerNorm backward between two GEMMs.

    The forward was u = LN(h) @ w^T (+ a bias) with LN(h) = xhat * gamma + beta,
    xhat = (h - mean) * rstd, and w (N, H) the consuming linear's weight.  Given du
    (T, N), g = du @ w is the gradient of LN(h), and with the row statistics
    s1 = sum_cols(gamma * g) and s2 = sum_cols(gamma * g * xhat), which the epilogue
    that produced du reduces (s1 = du . (gamma @ w^T), s2 = du . (u - bias -
    beta @ w^T)):

        dx     = dres + rstd * (gamma * g - (s1 + xhat * s2) / H)
        ln     = xhat * gamma + beta            (LN(h) itself: the dw GEMM's input)
        dgamma = sum_rows(g * xhat),  dbeta = sum_rows(g),  dw = du^T @ ln

    The statistics are drawn independently here; the formulas do not need them
    consistent."""
    dim = h.shape[-1]
    g = du @ w
    xhat = normalized(h, mean, rstd)
    dx = dres + rstd[:, None] * (gamma * g - (s1[:, None] + xhat * s2[:, None]) / dim)
    ln = (xhat * gamma + beta).to(h.dtype)
    return {"dx": dx.to(h.dtype), "ln": ln, "dgamma": (g * xhat).sum(0), "dbeta": hi(g).sum(0),
            "dw": (du.t() @ ln).to(h.dtype)}


# --------------------------------------------------------------------------- gelu_fwd


def gelu_fwd(x, w_fc, b_fc):
    """pre = x @ w_fc^T + b_fc (saved for the backward), y = gelu(pre) (exact GELU)."""
    pre = F.linear(x, w_fc, b_fc).to(x.dtype)
    return {"y": F.gelu(pre).to(x.dtype), "pre": pre}


# --------------------------------------------------------------------------- gelu_bwd


def gelu_bwd(dout, w_proj, pre):
    """Backward of out = gelu(pre) @ w_proj^T through the GELU, given dout:
    da = dout @ w_proj, dpre = da * gelu'(pre), and the bias gradient of the
    linear that produced pre, db = sum_rows(dpre) (fp32)."""
    dpre = (dout @ w_proj) * gelu_grad(hi(pre))
    return {"dpre": dpre.to(pre.dtype), "db": hi(dpre).sum(0)}


# --------------------------------------------------------------------------- linear_gelu, linear_gelu_tanh, linear_relu


def linear_gelu(x, w, b):
    """y = gelu(x @ w^T + b): the MLP's first linear with its activation, forward
    and backward on their own (the gradient dy arrives for the activation)."""
    return {"y": F.gelu(F.linear(x, w, b)).to(x.dtype)}


def linear_gelu_tanh(x, w, b):
    """linear_gelu with GELU's tanh form (BigBird's intermediate: gelu_new)."""
    return {"y": F.gelu(F.linear(x, w, b), approximate="tanh").to(x.dtype)}


def linear_relu(x, w, b):
    """linear_gelu with ReLU in the GELU's place (OPT's and M2M100's fc1 and its activation)."""
    return {"y": F.relu(F.linear(x, w, b)).to(x.dtype)}


# --------------------------------------------------------------------------- gelu_mlp, gelu_tanh_mlp


def gelu_mlp(x, w_fc, b_fc, w_proj, b_proj):
    """y = gelu(x @ w_fc^T + b_fc) @ w_proj^T + b_proj: an MLP with no gate, norm or residual at
    its ends (Falcon's; GPT-Neo's and the like with the exact GELU)."""
    return {"y": F.linear(F.gelu(F.linear(x, w_fc, b_fc)), w_proj, b_proj).to(x.dtype)}


def gelu_tanh_mlp(x, w_fc, b_fc, w_proj, b_proj):
    """gelu_mlp with GELU's tanh approximation (GPT-Neo's, GPT-J's, Phi's: gelu_new)."""
    return {"y": F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj).to(x.dtype)}


def relu_mlp(x, w_fc, b_fc, w_proj, b_proj):
    """gelu_mlp with ReLU in the GELU's place (CTRL's feed-forward network; OPT's MLP)."""
    return {"y": F.linear(F.relu(F.linear(x, w_fc, b_fc)), w_proj, b_proj).to(x.dtype)}


def relu2_mlp(x, w_fc, b_fc, w_proj, b_proj):
    """gelu_mlp with the squared ReLU (Persimmon's, Nemotron's: relu2) in the GELU's place."""
    return {"y": F.linear(torch.square(F.relu(F.linear(x, w_fc, b_fc))), w_proj, b_proj).to(x.dtype)}
