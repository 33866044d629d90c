"""Gemma-2's LM head with final-logit soft-capping and the cross-entropy, one training step."""
import torch
import torch.nn.functional as F


def softcap_xent(x, w, target, dloss, cap=30.0):
    """loss = CE(cap * tanh(x @ w^T / cap), target) per row, and the gradients of sum(dloss * loss)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)
        logits = cap * torch.tanh((xg @ wg.t()).float() / cap)
        loss = F.cross_entropy(logits, target, reduction="none")
        dx, dw = torch.autograd.grad(loss, (xg, wg), dloss)
    return {"loss": loss.detach(), "dx": dx, "dw": dw}
