"""MiniCPM's LM head under muP: the last hidden state is divided by hidden_size / dim_model_base before
the head (HF's MiniCPMForCausalLM), so the logits shrink with the model's width; the per-token
cross-entropy and its gradients, one training step."""
import torch
import torch.nn.functional as F


def scaled_head_xent(x, w, target, dloss, dim_model_base=256):
    """loss = cross_entropy((x / (H / dim_model_base)) @ w^T, target) per row (0 where target is -100), and the gradients of sum(dloss * loss)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)
        logits = F.linear(xg / (xg.shape[-1] / dim_model_base), wg).float()
        loss = F.cross_entropy(logits, target, reduction="none")
        dx, dw = torch.autograd.grad(loss, (xg, wg), dloss)
    return {"loss": loss.detach(), "dx": dx, "dw": dw}
