"""Liger kernels side by side with the fused programs, where Liger has the op.

Each baseline is the same computation with Liger's fused op between plain
cuBLAS GEMMs (Liger fuses the elementwise part, not the GEMM), called as
``fn(inputs, params, grads, dims)`` with the task's inputs and shape symbols.  Layout differences are
paid inside the baseline only where Liger needs them (its RoPE wants
(batch, heads, tokens, head_dim)); the shapes and dtypes match the task.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _swiglu_fwd(inp: dict, params: dict, grads: dict, dims: dict) -> Any:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    gu = inp["x"] @ inp["W_gu"]
    i = gu.shape[1] // 2
    return LigerSiLUMulFunction.apply(gu[:, :i], gu[:, i:])


def _gated_mlp(inp: dict, params: dict, grads: dict, dims: dict, gelu: bool = False) -> Any:
    """A gated MLP forward and backward with Liger's fused activation-times-up (SwiGLU's, or GeGLU's
    tanh GELU) between the gate, up and down GEMMs, as Liger's LigerSwiGLUMLP and LigerGEGLUMLP run."""
    if gelu:
        from liger_kernel.ops.geglu import LigerGELUMulFunction as Mul
    else:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Mul

    x = inp["x"].detach().requires_grad_(True)
    w_gu = inp["w_gu"].detach().requires_grad_(True)
    w_down = inp["w_down"].detach().requires_grad_(True)
    y = Mul.apply(x @ w_gu[0::2].t(), x @ w_gu[1::2].t()) @ w_down.t()
    y.backward(grads["dy"])
    return y


def _residual_rmsnorm(inp: dict, params: dict, grads: dict, dims: dict) -> Any:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    pre = inp["x"] @ inp["W0"]
    normed, h = LigerFusedAddRMSNormFunction.apply(pre, inp["z"], inp["gamma"], params["eps"])
    return normed @ inp["W1"], h


def _rope_fwd(inp: dict, params: dict, grads: dict, dims: dict) -> Any:
    from liger_kernel.ops.rope import LigerRopeFunction

    qkv = inp["x"] @ inp["W_qkv"]
    t, d = qkv.shape[0], dims["D"]
    q = qkv.view(1, t, qkv.shape[1] // d, d).transpose(1, 2)
    ang = inp["pos"].float()[:, None] * inp["inv_freq"][: d // 2].float()[None, :]
    emb = torch.cat((ang, ang), dim=-1)[None]
    return LigerRopeFunction.apply(q, q, emb.cos().to(qkv.dtype), emb.sin().to(qkv.dtype))


def _lm_head_xent(inp: dict, params: dict, grads: dict, dims: dict, frozen: bool = False) -> Any:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    x = inp["x"].detach().requires_grad_(True)
    w = inp["w"].detach().requires_grad_(not frozen)  # frozen: Liger computes no weight gradient
    loss = LigerFusedLinearCrossEntropyFunction.apply(x, w, inp["target"], None, None, -100, 0.0, 0.0,
                                                      "sum")
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward(torch.tensor(1.0 / x.shape[0], device=x.device))
    return loss


def _lm_head_xent_fwd(inp: dict, params: dict, grads: dict, dims: dict) -> Any:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    with torch.no_grad():
        return LigerFusedLinearCrossEntropyFunction.apply(inp["x"], inp["w"], inp["target"], None, None,
                                                          -100, 0.0, 0.0, "none")


LIGER: dict[str, Callable[[dict, dict, dict, dict], Any]] = {
    "swiglu_fwd": _swiglu_fwd,
    "swiglu_mlp": _gated_mlp,
    "geglu_mlp": lambda inp, params, grads, dims: _gated_mlp(inp, params, grads, dims, gelu=True),
    "residual_rmsnorm": _residual_rmsnorm,
    "rope_fwd": _rope_fwd,
    "lm_head_xent": _lm_head_xent,
    "lm_head_xent_frozen": lambda inp, params, grads, dims: _lm_head_xent(inp, params, grads, dims, frozen=True),
    "lm_head_xent_fwd": _lm_head_xent_fwd,
}
