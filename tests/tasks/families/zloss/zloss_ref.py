"""The LM head's cross-entropy with label smoothing and z-loss (PaLM; Liger's fused linear cross entropy), one training step."""
import torch


def zloss_xent(x, w, target, dloss, smoothing=0.1, z_weight=1e-4):
    """loss = (1 - smoothing) * (lse - z[target]) + smoothing * (lse - mean(z)) + z_weight * lse^2 per row, z = x @ w^T; rows whose target is outside [0, V) (the -100 of ignore_index) lose 0; and the gradients of sum(dloss * loss)."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)
        z = (xg @ wg.t()).float()
        v = z.shape[1]
        keep = (target >= 0) & (target < v)
        lse = torch.logsumexp(z, dim=-1)
        z_t = z.gather(1, torch.where(keep, target, 0).view(-1, 1)).view(-1)
        loss = (1 - smoothing) * (lse - z_t) + smoothing * (lse - z.mean(-1)) + z_weight * lse * lse
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        dx, dw = torch.autograd.grad(loss, (xg, wg), dloss)
    return {"loss": loss.detach(), "dx": dx, "dw": dw}
