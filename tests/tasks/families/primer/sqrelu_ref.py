"""A squared-ReLU MLP (Primer, Nemotron-4) behind an RMSNorm: y = h + relu(RMSNorm(h) @ w_up^T)^2 @ w_down^T."""
import torch
import torch.nn.functional as F


def sqrelu_mlp(h, gamma, w_up, w_down, eps=1e-5):
    """y = h + relu(RMSNorm(h; gamma) @ w_up^T)^2 @ w_down^T, weights stored as nn.Linear keeps them."""
    hf = h.float()
    x = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * gamma
    return {"y": h + F.relu(x @ w_up.t()).square() @ w_down.t()}
