"""BERT's post-LN sublayer output: y = LayerNorm(x + h @ w^T + b)."""
import torch.nn.functional as F


def post_ln(h, x, w, b, gamma, beta, eps=1e-12):
    """y = LayerNorm(x + h @ w^T + b; gamma, beta): the dense output projection, dropout off, the residual and the norm; y is the next residual stream."""
    z = x + F.linear(h, w, b)
    return {"y": F.layer_norm(z, (z.shape[-1],), gamma, beta, eps)}
