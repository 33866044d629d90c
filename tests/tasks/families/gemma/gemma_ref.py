"""Gemma's MLP sub-block: y = h + W_down(gelu_tanh(g) * u), (g, u) = GemmaRMSNorm(h) @ W_gu^T."""
import torch
import torch.nn.functional as F


def gemma_mlp(h, w_norm, w_gu, w_down, eps=1e-6):
    """GemmaRMSNorm scales by (1 + w_norm) and normalizes in fp32; w_gu (2I, H) interleaves gate and up rows."""
    hf = h.float()
    xn = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    xn = (xn * (1.0 + w_norm.float())).to(h.dtype)
    pre = xn @ w_gu.t()
    g, u = pre[:, 0::2], pre[:, 1::2]
    act = F.gelu(g, approximate="tanh") * u
    return {"y": h + act @ w_down.t()}
