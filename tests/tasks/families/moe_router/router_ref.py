"""A mixture-of-experts router (Mixtral, Qwen-MoE, Switch): the gate projection and its softmax
over the experts."""
import torch


def moe_router(x, w_r):
    """probs = softmax(x @ w_r^T) over the E experts, in fp32 (w_r stored (E, H) as nn.Linear keeps
    it); the top-k selection that follows reads probs."""
    logits = x @ w_r.t()
    return {"probs": torch.softmax(logits.float(), dim=-1)}
