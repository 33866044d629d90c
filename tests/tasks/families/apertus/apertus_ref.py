"""Apertus's MLP: up_proj, the xIELU activation, down_proj (no gate, no biases).  xIELU's two slopes
are trained scalars, each kept as a one-element parameter behind a softplus, as Hugging Face's
XIELUActivation keeps them; beta and eps are fixed buffers."""
import torch
import torch.nn.functional as F


def xielu(x, alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    ap = F.softplus(alpha_p)
    an = beta + F.softplus(alpha_n)
    return torch.where(x > 0, ap * x * x + beta * x, (torch.expm1(torch.clamp(x, max=eps)) - x) * an + beta * x)


def xielu_mlp(x, w_up, w_down, alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    """y = xielu(x @ w_up^T) @ w_down^T, weights stored as nn.Linear keeps them; xielu(u) = softplus(alpha_p) u^2 + beta u for u > 0, else (beta + softplus(alpha_n)) (expm1(min(u, eps)) - u) + beta u."""
    return {"y": F.linear(xielu(F.linear(x, w_up), alpha_p, alpha_n, beta, eps), w_down)}
