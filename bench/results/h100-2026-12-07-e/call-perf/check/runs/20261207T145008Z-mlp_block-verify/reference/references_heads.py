"""PyTorch references of the suite's composed tasks (QK-norm + RoPE, LM head +
cross-entropy, the MLP sub-block, the non-attention LLaMA-3 block).

Each reference is ``fn(**inputs, **params) -> {output: tensor}`` and computes in
the dtype of the tensors it is given: the verifier calls it once with the
inputs upcast (fp64 on CPU, fp32 on GPU: the truth) and once in the inputs' own
dtype (bf16: the noise floor of CODA's tolerance rule).  Math that real
implementations keep in fp32 (RMSNorm statistics, log-sum-exp) is done in
``_hi(x)`` = at least fp32, as LLaMA's and PyTorch's own kernels do.

Layout conventions shared with the expert programs:

- weights are stored (out_features, in_features), as ``nn.Linear`` keeps them;
- RoPE rotates *adjacent* column pairs (2j, 2j+1) of each head (Meta's
  complex-number convention) by the angle ``pos[t] * inv_freq[j]``:
  ``(x0, x1) -> (x0 c - x1 s, x0 s + x1 c)``, as in ``references.rope_fwd``;
- the fused gate/up weight ``w_gu`` (2I, H) interleaves its rows
  ``[g0, u0, g1, u1, ...]`` so that adjacent GEMM output columns form a
  (gate, up) pair (the layout is chosen once, at weight-load time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _hi(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA's RMSNorm: statistics in (at least) fp32, result in x's dtype times gamma."""
    xf = _hi(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * gamma


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of x (T, heads, D) by pos[t] * inv_freq[head, j]
    (the angle in pos's precision, as a cos/sin table would be built)."""
    ang = pos[:, None, None] * inv_freq[None]
    c, s = torch.cos(ang), torch.sin(ang)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------- task 8


def qk_norm_rope(x, wq, wk, wv, q_gamma, k_gamma, pos, inv_freq, eps):
    """q, k, v = x @ W^T; per-head RMSNorm (QK-norm: statistic over each head's D
    columns, gamma per head and column) on q and k, then RoPE on q and k with
    angle pos[t] * inv_freq[head, j] (rows of inv_freq: the q heads, then the k
    heads); v untouched."""
    t = x.shape[0]
    nq, d = q_gamma.shape
    q = _rms_norm((x @ wq.t()).view(t, nq, d), q_gamma, eps)
    k = _rms_norm((x @ wk.t()).view(t, -1, d), k_gamma, eps)
    q = _rope(q, pos, inv_freq[:nq])
    k = _rope(k, pos, inv_freq[nq:])
    return {"q": q.reshape(t, -1), "k": k.reshape(t, -1), "v": x @ wv.t()}


# --------------------------------------------------------------------------- tasks 9, 10


def _xent_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100):
    lf = _hi(logits)
    lse = torch.logsumexp(lf, dim=-1)
    safe = target.clamp(0, logits.shape[1] - 1).long()
    tl = lf.gather(1, safe.view(-1, 1)).view(-1)
    loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - tl)
    return loss, lse


def lm_head_xent_fwd(x, w, target):
    """Per-row cross-entropy of the LM head: logits = x @ w^T (w is (V, H));
    loss = logsumexp(logits) - logits[target]; also the log-sum-exp."""
    loss, lse = _xent_rows(x @ w.t(), target)
    return {"loss": loss, "lse": lse}


def lm_head_xent(x, w, target, dloss):
    """Per-row loss and the gradients of sum(dloss * loss) with respect to x and w
    (one fused training step: dloss, the upstream per-row loss weights, e.g. 1/T
    for a mean, is an input)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)
        loss, _ = _xent_rows(xg @ wg.t(), target)
        dx, dw = torch.autograd.grad(loss, (xg, wg), dloss.to(loss.dtype))
    return {"loss": loss.detach(), "dx": dx, "dw": dw}


def lm_head_xent_frozen(x, w, target, dloss):
    """lm_head_xent with the head frozen (LoRA, a frozen tied embedding): the per-row loss and
    the gradient of sum(dloss * loss) with respect to x alone."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        loss, _ = _xent_rows(xg @ w.detach().t(), target)
        (dx,) = torch.autograd.grad(loss, (xg,), dloss.to(loss.dtype))
    return {"loss": loss.detach(), "dx": dx}


def _capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma-2's final-logit soft-capping, cap * tanh(logits / cap), in at least fp32."""
    return cap * torch.tanh(_hi(logits) / cap)


def lm_head_xent_softcap(x, w, target, dloss, cap):
    """lm_head_xent with soft-capped logits (Gemma-2, Gemma-3): loss = CE(cap * tanh(x @ w^T / cap),
    target) per row, and the gradients of sum(dloss * loss) with respect to x and w."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)
        loss, _ = _xent_rows(_capped(xg @ wg.t(), cap), target)
        dx, dw = torch.autograd.grad(loss, (xg, wg), dloss.to(loss.dtype))
    return {"loss": loss.detach(), "dx": dx, "dw": dw}


def lm_head_xent_softcap_frozen(x, w, target, dloss, cap):
    """lm_head_xent_softcap with the head frozen: the per-row loss and dx alone."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        loss, _ = _xent_rows(_capped(xg @ w.detach().t(), cap), target)
        (dx,) = torch.autograd.grad(loss, (xg,), dloss.to(loss.dtype))
    return {"loss": loss.detach(), "dx": dx}


# --------------------------------------------------------------------------- task 11


def mlp_block(h, gamma, w_gu, w_down, eps):
    """y = h + W_down(silu(g) * u), (g, u) = RMSNorm(h) @ W_gu^T (rows interleaved)."""
    x = _rms_norm(h, gamma, eps)
    g = x @ w_gu[0::2].t()
    u = x @ w_gu[1::2].t()
    return {"y": h + (F.silu(g) * u) @ w_down.t()}


def swiglu_mlp(x, w_gu, w_down):
    """y = W_down(silu(g) * u), (g, u) = x @ W_gu^T (rows interleaved): a SwiGLU MLP alone, where
    no norm or residual sits at its ends (a post-norm block's, OLMo-2's; a shared expert's)."""
    g = x @ w_gu[0::2].t()
    u = x @ w_gu[1::2].t()
    return {"y": (F.silu(g) * u) @ w_down.t()}


def geglu_mlp(x, w_gu, w_down):
    """y = W_down(gelu_tanh(g) * u), (g, u) = x @ W_gu^T (rows interleaved): Gemma's gated MLP
    (``gelu_pytorch_tanh``)."""
    g = x @ w_gu[0::2].t()
    u = x @ w_gu[1::2].t()
    return {"y": (F.gelu(g, approximate="tanh") * u) @ w_down.t()}


def swiglu_clamp_mlp(x, w_gu, b_gu, w_down, b_down, limit, alpha, offset):
    """y = W_down(g' * sigmoid(alpha * g') * (u' + offset)) + b_down, (g, u) = x @ W_gu^T + b_gu
    (rows interleaved), g' = min(g, limit), u' = clamp(u, -limit, limit): the clamped SwiGLU of
    GPT-OSS's experts (alpha 1.702, offset 1, biases) and of DeepSeek-V4's, GLM-5's and HY-V4's
    (alpha 1, offset 0: SiLU; no biases).  The clamps pass no gradient outside their range."""
    g = F.linear(x, w_gu[0::2], b_gu[0::2]).clamp(max=limit)
    u = F.linear(x, w_gu[1::2], b_gu[1::2]).clamp(min=-limit, max=limit)
    return {"y": F.linear((u + offset) * (g * torch.sigmoid(g * alpha)), w_down, b_down)}


# --------------------------------------------------------------------------- task 12


def llama3_block(attn, h, w_o, gamma_mlp, w_gu, w_down, gamma_attn, w_qkv, eps):
    """The non-attention part of a LLaMA-3 layer, from the attention output
    projection to the next layer's QKV projection:

        h1  = h + attn @ w_o^T                       (out-proj + residual)
        h2  = h1 + W_down(silu(g) * u),  (g, u) = RMSNorm(h1, gamma_mlp) @ W_gu^T
        qkv = RMSNorm(h2, gamma_attn) @ w_qkv^T      (next layer's QKV, pre-RoPE)
    """
    h1 = h + attn @ w_o.t()
    x = _rms_norm(h1, gamma_mlp, eps)
    h2 = h1 + (F.silu(x @ w_gu[0::2].t()) * (x @ w_gu[1::2].t())) @ w_down.t()
    qkv = _rms_norm(h2, gamma_attn, eps) @ w_qkv.t()
    return {"h_out": h2, "qkv": qkv}
