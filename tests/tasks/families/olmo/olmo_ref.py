"""OLMo's non-parametric LayerNorm into the QKV projection, ported from Hugging Face's OLMo code
as a user ports it: the norm in fp32 after ``x.to(torch.float32)``, its row statistics returned
in fp32 for the backward to reuse."""
import torch
import torch.nn.functional as F


def olmo_ln_qkv(x, w_qkv, eps=1e-5):
    """qkv = LayerNorm(x) @ w_qkv^T, a LayerNorm without weight or bias computed in fp32; mean and
    rstd are x's row statistics (fp32)."""
    xf = x.to(torch.float32)
    mean = xf.mean(-1, keepdim=True)
    var = xf.var(-1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    h = ((xf - mean) * rstd).to(x.dtype)
    return {"qkv": F.linear(h, w_qkv), "mean": mean.squeeze(-1), "rstd": rstd.squeeze(-1)}
