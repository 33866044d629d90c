"""Qwen3-Next's gated attention output: the attention's output is gated per element by sigmoid of a
gate that the query projection produces beside the queries, then projected by o_proj and added to
the residual stream."""
import torch


def gated_o_proj(h, o, gate, w_o):
    """y = h + (o * sigmoid(gate)) @ w_o^T, weights stored as nn.Linear keeps them."""
    return {"y": h + (o * torch.sigmoid(gate)) @ w_o.t()}
