"""PyTorch references of the GPT-2 suite's composed tasks: the final LayerNorm
with the tied LM head and cross-entropy, the MLP sub-block, and the
non-attention part of a layer.  Conventions as in references.py (weights
(out, in), exact GELU, LayerNorm statistics in at least fp32); mlp_block_tanh is the
MLP sub-block with GELU's tanh approximation, the activation of Hugging Face's GPT-2
(``gelu_new``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coda_agent.tasks.gpt2.references import hi, layer_norm

# --------------------------------------------------------------------------- lm_head_xent


def lm_head_xent(h, gamma, beta, wte, target, dloss, eps):
    """Final LayerNorm + tied LM head + cross-entropy, one training step: per-row
    loss = logsumexp(logits) - logits[target] with logits = LN(h) @ wte^T (wte
    (V, H), the token embedding the head shares), and the gradients of
    sum(dloss * loss) for h, gamma, beta and wte (the head's share of the tied
    embedding's gradient)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (h, gamma, beta, wte)]
        hg, gg, bg, wg = leaves
        logits = layer_norm(hg, gg, bg, eps) @ wg.t()
        loss = F.cross_entropy(hi(logits), target.long(), reduction="none")
        dh, dgamma, dbeta, dwte = torch.autograd.grad(loss, leaves, dloss.to(loss.dtype))
    return {"loss": loss.detach(), "dh": dh, "dgamma": dgamma, "dbeta": dbeta, "dwte": dwte}


# --------------------------------------------------------------------------- mlp_block


def mlp(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps, approximate="none"):
    """gelu(LN(h) @ w_fc^T + b_fc) @ w_proj^T + b_proj, in h's dtype (``approximate``:
    F.gelu's, "none" for the exact GELU, "tanh" for its tanh approximation)."""
    pre = F.linear(layer_norm(h, gamma, beta, eps), w_fc, b_fc)
    return F.linear(F.gelu(pre, approximate=approximate), w_proj, b_proj)


def mlp_block(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps):
    """y = h + MLP(LN(h)): GPT-2's MLP sub-block with its residual."""
    return {"y": (h + mlp(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps)).to(h.dtype)}


# --------------------------------------------------------------------------- mlp_block_tanh


def mlp_block_tanh(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps):
    """y = h + MLP(LN(h)) with GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3))): Hugging Face's GPT-2 (``gelu_new``, ``gelu_pytorch_tanh``)."""
    return {"y": (h + mlp(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps, approximate="tanh")).to(h.dtype)}


# --------------------------------------------------------------------------- gpt2_block


def gpt2_block(attn, x, w_o, b_o, gamma_mlp, beta_mlp, w_fc, b_fc, w_proj, b_proj,
               gamma_attn, beta_attn, w_qkv, b_qkv, eps):
    """The non-attention part of a pre-LN GPT-2 layer, from the attention output
    projection to the next layer's QKV projection:

        h     = x + attn @ w_o^T + b_o                      (out-proj + residual)
        h_out = h + MLP(LN(h; gamma_mlp, beta_mlp))         (MLP + residual)
        qkv   = LN(h_out; gamma_attn, beta_attn) @ w_qkv^T + b_qkv   (next layer)
    """
    h = (x + F.linear(attn, w_o, b_o)).to(x.dtype)
    h_out = (h + mlp(h, gamma_mlp, beta_mlp, w_fc, b_fc, w_proj, b_proj, eps)).to(x.dtype)
    qkv = F.linear(layer_norm(h_out, gamma_attn, beta_attn, eps), w_qkv, b_qkv)
    return {"h_out": h_out, "qkv": qkv.to(x.dtype)}
