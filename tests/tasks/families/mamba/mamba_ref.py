"""Mamba-2's gated RMSNorm around its out projection, ported from Hugging Face's MambaRMSNormGated
(one group): the SSM's output y is gated by silu(z) in fp32, normalized, scaled by the weight in
the input's dtype, then projected."""
import torch
import torch.nn.functional as F


def gated_norm_out(y, z, w, w_out, eps=1e-6):
    """out = (w * RMSNorm(y * silu(z))) @ w_out^T, the gate and the norm in fp32, weights stored as nn.Linear keeps them."""
    h = y.to(torch.float32)
    h = h * F.silu(z.to(torch.float32))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return {"out": F.linear(w * h.to(y.dtype), w_out)}
