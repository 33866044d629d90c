"""OPT's MLP sub-block (pre-LN): y = h + fc2(relu(fc1(LayerNorm(h))))."""
import torch.nn.functional as F


def opt_mlp(h, gamma, beta, w1, b1, w2, b2, eps=1e-5):
    """y = h + relu(LN(h) @ w1^T + b1) @ w2^T + b2, weights stored as nn.Linear keeps them."""
    x = F.layer_norm(h, (h.shape[-1],), gamma, beta, eps)
    return {"y": h + F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)}
