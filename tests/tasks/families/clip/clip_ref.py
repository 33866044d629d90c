"""CLIP's MLP sub-block (pre-LN, as in HF's CLIPEncoderLayer): fc1, quick_gelu (OpenAI's sigmoid
approximation of GELU, x * sigmoid(1.702 x)), fc2, the residual."""
import torch
import torch.nn.functional as F


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def clip_mlp(h, gamma, beta, w1, b1, w2, b2, eps=1e-5):
    """y = h + quick_gelu(LN(h) @ w1^T + b1) @ w2^T + b2, weights stored as nn.Linear keeps them."""
    x = F.layer_norm(h, (h.shape[-1],), gamma, beta, eps)
    return {"y": h + F.linear(quick_gelu(F.linear(x, w1, b1)), w2, b2)}
