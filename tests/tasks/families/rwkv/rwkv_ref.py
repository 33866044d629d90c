"""RWKV's channel mix (the feed-forward of RWKV-4 to -6): a receptance gate times the value of a
squared-ReLU key.  The token shift (x mixed with the previous token's x by learned weights) runs
before it, so the two mixed inputs come in as they are."""
import torch


def channel_mix(xk, xr, w_k, w_v, w_r):
    """y = sigmoid(xr @ w_r^T) * (relu(xk @ w_k^T)^2 @ w_v^T), weights stored as nn.Linear keeps them."""
    k = torch.relu(xk @ w_k.t()) ** 2
    return {"y": torch.sigmoid(xr @ w_r.t()) * (k @ w_v.t())}
