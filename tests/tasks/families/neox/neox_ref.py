"""The non-attention part of a parallel-residual block (GPT-J, Phi-2; GPT-NeoX / Pythia with use_parallel_residual)."""
import torch.nn.functional as F


def parallel_block(x, attn, gamma, beta, w_o, b_o, w_1, b_1, w_2, b_2, eps=1e-5):
    """ln = LayerNorm(x), shared by both branches (GPT-J, Phi-2): the QKV projection reads it (outside) and the MLP; out = x + attn @ w_o^T + b_o + gelu_tanh(ln @ w_1^T + b_1) @ w_2^T + b_2, weights as nn.Linear keeps them."""
    ln = F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    mlp = F.linear(F.gelu(F.linear(ln, w_1, b_1), approximate="tanh"), w_2, b_2)
    return {"out": x + F.linear(attn, w_o, b_o) + mlp, "ln": ln}
