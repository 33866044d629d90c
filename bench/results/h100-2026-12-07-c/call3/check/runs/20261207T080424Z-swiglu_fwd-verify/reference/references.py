"""PyTorch references for LLaMA-3 suite tasks 1-7 (tasks 8-12: references_heads.py).

Contract (tasks/spec.py): ``fn(**inputs, **params) -> {output: tensor}``, computed
in the dtype of the inputs it is given.  The verifier calls each reference twice:
with float inputs upcast (fp64 on CPU, fp32 on GPU: ``ref_hi``) and in the
inputs' own dtype (``ref_lo``, whose rounding noise sets the tolerance).  So the
math is written naturally, and every output the task declares in the activation
dtype is cast to it at the end (``.to(x.dtype)``): in the low-precision run that
rounding is part of the noise floor, exactly as the kernel rounds its stores; in
the upcast run it is a no-op.  fp32-declared outputs (statistics, gamma
gradients) are returned as computed.

Backward of tasks with ``gradients`` is autograd through these functions.
Tasks whose math *is* a backward (swiglu_bwd, rmsnorm_bwd, rope_bwd) are
forward-only tasks with explicit math; tests/test_suite_a.py checks that math
against autograd of the corresponding forward.

Layouts (the ones the expert programs use):
- weights are stored (K, N) = (in, out), so ``y = x @ W``;
- SwiGLU's fused gate/up weight has interleaved columns [g0, u0, g1, u1, ...];
- RoPE rotates adjacent column pairs (2j, 2j+1) (Meta's interleaved/complex
  convention): (e, o) -> (e cos a - o sin a, e sin a + o cos a), a = pos * f_j,
  with one frequency f_j per pair (``inv_freq`` holds N/2 values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, N) and (M, N) -> (M, 2N) with columns [a0, b0, a1, b1, ...]."""
    return torch.stack((a, b), dim=-1).flatten(-2)


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
                ) -> torch.Tensor:
    """Rotate adjacent column pairs of ``x`` (M, 2P) by angle ``pos[m] * inv_freq[p]``
    (``inverse``: by the negative angle, the transpose of the rotation)."""
    ang = pos[:, None] * inv_freq[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    if inverse:
        s = -s
    e, o = x[:, 0::2], x[:, 1::2]
    return _interleave(e * c - o * s, e * s + o * c)


def rms_norm(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA's RMSNorm: the statistic and the scaling in (at least) fp32, the result
    rounded to h's dtype, then times gamma (``self._norm(x.float()).type_as(x) * w``)."""
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    return (hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(h.dtype) * gamma


# --------------------------------------------------------------------------- 1. out_proj_residual

def out_proj_residual(attn, Wo, residual):
    """y = attn @ Wo + residual (attention output projection + residual add)."""
    return {"y": (attn @ Wo + residual).to(attn.dtype)}


# --------------------------------------------------------------------------- 2. residual_rmsnorm

def residual_rmsnorm(x, W0, z, gamma, W1, eps):
    """h = x @ W0 + z (the new residual stream); y = RMSNorm(h, gamma) @ W1."""
    h = x @ W0 + z
    y = rms_norm(h, gamma, eps) @ W1
    return {"h": h.to(x.dtype), "y": y.to(x.dtype)}


# --------------------------------------------------------------------------- 3. swiglu_fwd

def swiglu_fwd(x, W_gu):
    """pre = x @ W_gu (interleaved gate/up columns); y = silu(gate) * up."""
    pre = (x @ W_gu).to(x.dtype)
    g, u = pre[:, 0::2], pre[:, 1::2]
    return {"y": (F.silu(g) * u).to(x.dtype), "pre": pre}


# --------------------------------------------------------------------------- 4. swiglu_bwd

def swiglu_bwd(dout, W_down, pre):
    """Backward of out = (silu(g) * u) @ W_down through the SwiGLU, given dout.

    dact = dout @ W_down^T; dg = dact * u * silu'(g); du = dact * silu(g);
    dpre interleaves (dg, du) like pre; postact = silu(g) * u recomputed (the
    input of the W_down gradient GEMM); s = sum over the 2I columns of
    dpre * pre per row (the RMSNorm-backward statistic of the norm feeding the
    gate/up GEMM)."""
    return dswiglu(dout @ W_down.t(), pre)


def dswiglu(dact, pre):
    """The SwiGLU backward of :func:`swiglu_bwd` given dact (shared with the fp8 suite);
    dpre and postact in pre's dtype."""
    g, u = pre[:, 0::2], pre[:, 1::2]
    sg = torch.sigmoid(g)
    act = g * sg
    dg = dact * u * sg * (1 + g * (1 - sg))
    du = dact * act
    s = (dg * g + du * u).sum(dim=-1)
    return {"dpre": _interleave(dg, du).to(pre.dtype), "postact": (act * u).to(pre.dtype), "s": s}


# --------------------------------------------------------------------------- 5. rmsnorm_bwd

def rmsnorm_bwd(du, W, r, s, gamma, x, dres):
    """RMSNorm backward between two GEMMs (CODA-MATH "RMSNorm backward").

    Forward was u = r * ((x * gamma) @ W) with r = rstd(x) per row.  Given du,
    d = du @ W^T and the row statistic s = sum_cols(du * u):
    dx = dres + r * (gamma * d - (x * r) * s / dim)   (dres: incoming residual grad)
    xrg = x * r * gamma                               (input of the dW GEMM)
    dgamma = sum_rows(d * x * r);  dW = xrg^T @ du."""
    dim = x.shape[-1]
    d = du @ W.t()
    xr = x * r[:, None]
    dx = dres + r[:, None] * (gamma * d - xr * (s[:, None] / dim))
    xrg = (xr * gamma).to(x.dtype)
    dgamma = (d * xr).sum(dim=0)
    dW = xrg.t() @ du
    return {"dx": dx.to(x.dtype), "xrg": xrg, "dgamma": dgamma, "dW": dW.to(x.dtype)}


# --------------------------------------------------------------------------- 6. rope_fwd

def rope_fwd(x, W_qkv, pos, inv_freq):
    """qkv = RoPE(x @ W_qkv): adjacent pairs (2j, 2j+1) rotated by pos[t] * inv_freq[j].

    In production inv_freq[j] = theta^(-2i/head_dim) for pair i of each q/k head
    (theta = 500000) and 0 on the V columns (rotation by 0 = identity)."""
    pre = x @ W_qkv
    return {"qkv": rope_rotate(pre, pos, inv_freq).to(x.dtype)}


# --------------------------------------------------------------------------- 7. rope_bwd

def rope_bwd(dS, q, k, pos, inv_freq):
    """The attention-backward GEMMs that produce d(q_rot) and d(k_rot), with the
    inverse RoPE in their epilogue, giving the gradients w.r.t. the pre-RoPE q/k
    (what the QKV projection's backward consumes).  One (sequence, head) slab:
    dS is the (scaled) softmax gradient, q/k the saved rotated queries/keys.

    dq = R(-a) (dS @ k),  dk = R(-a) (dS^T @ q),  a = pos * inv_freq per pair."""
    dq = rope_rotate(dS @ k, pos, inv_freq, inverse=True)
    dk = rope_rotate(dS.t() @ q, pos, inv_freq, inverse=True)
    return {"dq": dq.to(q.dtype), "dk": dk.to(q.dtype)}
