"""The drop-ins' ops that no single suite task covers: the attention input and
the fused LM-head cross-entropy (``llama.py`` uses both, ``gpt2.py`` the
cross-entropy).

**Attention input** (:func:`attention_input`): ``qkv = RoPE(RMSNorm(h) @ W_qkv^T)``
as one GEMM.  RMSNorm commutes with the GEMM that consumes it (one scalar per
row): ``rms_prepare`` gives ``h * gamma`` and the inverse RMS ``r``, and the
epilogue multiplies the accumulator by ``r``; RoPE rotates adjacent column
pairs (the q/k rows are laid out in pairs at patch time) in the same epilogue,
by ``pos[t] * freq[n]`` with ``freq`` zero on the v columns (no rotation).
A projection bias (Qwen2's q/k/v) is a RowVec the epilogue adds before the
rotation.  Epilogues come from the suite's experts (``scale_rows`` and
``row_dot`` of llama3_block, ``rope`` of rope_fwd) where one exists.

Backward: RoPE's inverse rotation has no GEMM to host it here (it belongs in
the attention backward's ``dS @ K`` GEMM, the rope_bwd task, and SDPA exposes
none), so it is a tile pass over the gradient attention gave
(``rope_inverse``: the gradient as a PairedTile, one read and one write, on
the pass kernel); ``freq`` is zero past the q/k columns, where the rotation
is the identity, as in the forward's epilogue.  The RMSNorm backward
then rides in the epilogue of ``dx = d @ W_qkv`` (CODA's rule, as in
llama3_block): ``dx = r * (gamma * acc - h * r * s / H)`` with
``s = sum_cols(dqkv * qkv)``, which a rotation leaves unchanged, so it is read
from the rotated tensors attention gave and took (one fused pass, ``row_dot``
as a ``tile_pass``); the same epilogue writes ``h * r * gamma`` for
``dW = d^T @ (h * r * gamma)`` and folds the gamma gradient.  With a bias,
``qkv - R(bias)`` is what the GEMM produced, so the pass subtracts the
bias's share ``sum_cols(d * bias)`` of the unrotated gradient ``d`` and folds
``d`` down the tokens for the bias gradient in the same read
(``row_dot_bias``).

**LM head + cross-entropy** (:func:`linear_cross_entropy`): the lm_head_xent
kernel computes the loss *and* dx, dw in one bounded-memory pass, given the
per-row weights of the loss (``1 / n`` for a mean over the n rows that are not
ignored; ``1 / num_items_in_batch`` for HF's gradient-accumulation sum), so the
logits never exist at full size.  forward keeps dx and dw; backward scales
them by the incoming gradient of the scalar loss (exact for a loss that enters
linearly, which a training loss does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, cos, epilogue, gemm, pack,
                                   rms_prepare, row_sum, sin, tile_pass, unpack)
from coda_agent.tasks.llama3.experts.llama3_block import row_dot, scale_rows
from coda_agent.tasks.llama3.experts.rope_fwd import rope

from .kernel import Kernel, autocast_inputs, autocast_off

IGNORE_INDEX = -100


@epilogue(pairs="acc")
def norm_rope(acc, rstd: ColVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc * rstd)
    f, _ = unpack(freq)
    a = pos * f  # fp32; sin/cos reduce it by 2*pi themselves (angles reach ~1e5 rad)
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


@epilogue(pairs="acc")
def norm_bias_rope(acc, rstd: ColVec, bias: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc * rstd + bias)
    f, _ = unpack(freq)
    a = pos * f
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


@epilogue(pairs="acc")
def bias_rope(acc, bias: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc + bias)
    f, _ = unpack(freq)
    a = pos * f
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


@epilogue()
def scale_rows_bias(acc, rstd: ColVec, bias: RowVec):
    return {"D": acc * rstd + bias}


@epilogue()
def add_bias(acc, bias: RowVec):
    return {"D": acc + bias}


@epilogue(reductions={"s": col_sum(), "dbias": row_sum()})
def row_dot_bias(du: Tile, u: Tile, d: Tile, bias: RowVec):
    # u = R(xn @ W^T + bias), d = R^-1 du (R: RoPE's rotation, or none): the RMSNorm-backward
    # statistic sum_cols(d @ W * xn) is sum_cols(du * u) less the bias's part, sum_cols(d * bias);
    # the bias gradient is d summed over the tokens.
    return {"s": du * u - d * bias, "dbias": d}


@epilogue(outputs={"xn": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_dx(acc, rstd: ColVec, s: ColVec, gamma: RowVec, h: Tile, inv_dim: Scalar):
    hr = h * rstd
    return {"D": rstd * (gamma * acc - hr * s * inv_dim), "xn": hr * gamma, "dgamma": acc * hr}


@epilogue()
def rope_inverse(du: PairedTile, pos: ColVec, freq: RowVec):
    # RoPE's backward: the pairs (2j, 2j+1) of the gradient turned back by pos[t] * freq[j]
    # (freq: one value per pair).
    e, o = unpack(du)
    a = pos * freq
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c + o * s, o * c - e * s)}


# The QKV GEMM's epilogue by (RMSNorm folded in, a bias, RoPE).
_QKV_EPILOGUES = {(True, False, True): norm_rope, (True, False, False): scale_rows, (False, False, True): rope,
                  (False, False, False): None, (True, True, True): norm_bias_rope, (True, True, False): scale_rows_bias,
                  (False, True, True): bias_rope, (False, True, False): add_bias}


class AttentionInput(torch.autograd.Function):
    """apply(h, gamma | None, w_qkv, bias | None, pos | None, freq | None, eps) -> qkv (T, Nqkv)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, gamma: torch.Tensor | None, w: torch.Tensor, bias: torch.Tensor | None,
                pos: torch.Tensor | None, freq: torch.Tensor | None, eps: float) -> torch.Tensor:
        ops: dict[str, Any] = {} if pos is None else {"pos": pos, "freq": freq}
        a, rstd = h, None
        if gamma is not None:
            prep = rms_prepare(h, gamma, eps)
            a, rstd = prep["xg"], prep["rstd"]
            ops["rstd"] = rstd
        if bias is not None:
            ops["bias"] = bias
        epi = _QKV_EPILOGUES[gamma is not None, bias is not None, pos is not None]
        qkv = gemm(a, w.t(), epi, **ops)["D"]
        ctx.save_for_backward(h, gamma, w, bias, pos, freq, rstd, qkv)
        return qkv

    @staticmethod
    def backward(ctx: Any, dqkv: torch.Tensor) -> tuple:
        h, gamma, w, bias, pos, freq, rstd, qkv = ctx.saved_tensors
        # A frozen weight (LoRA's base, a frozen layer) gets no gradient: its GEMM, a third of the
        # projection's backward, is skipped.
        frozen = not ctx.needs_input_grad[2]
        dqkv = dqkv.contiguous()
        d = dqkv if pos is None else tile_pass(rope_inverse, du=dqkv, pos=pos, freq=freq[0::2].contiguous())["D"]
        if gamma is None:
            dbias = None if bias is None else d.sum(0, dtype=torch.float32).to(bias.dtype)
            return gemm(d, w)["D"], None, None if frozen else gemm(d.t(), h)["D"], dbias, None, None, None
        if bias is None:
            s, dbias = tile_pass(row_dot, du=dqkv, u=qkv)["s"], None
        else:
            stats = tile_pass(row_dot_bias, du=dqkv, u=qkv, d=d, bias=bias)
            s, dbias = stats["s"], stats["dbias"].to(bias.dtype)
        dx = gemm(d, w, rmsnorm_dx, rstd=rstd, s=s, gamma=gamma, h=h, inv_dim=1.0 / h.shape[1])
        dw = None if frozen else gemm(d.t(), dx["xn"])["D"]
        return dx["D"], dx["dgamma"], dw, dbias, None, None, None


def attention_input(h: torch.Tensor, gamma: torch.Tensor | None, w_qkv: torch.Tensor, bias: torch.Tensor | None,
                    pos: torch.Tensor | None, freq: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``RoPE(RMSNorm(h) @ w_qkv^T + bias)`` (see the module docstring); ``gamma=None``: h is
    already normalized; ``bias=None``: none; ``pos=None``: no rotation; ``freq``: per column,
    the frequency of its pair (both lanes; zero on the columns RoPE leaves alone)."""
    with autocast_off(h):
        return AttentionInput.apply(h, gamma, w_qkv, bias, pos, freq, eps)


class LinearCrossEntropy(torch.autograd.Function):
    """apply(x, w, target, kernel, denominator, cap) -> the scalar loss sum(loss) / denominator;
    ``cap``: the soft-cap of the logits a soft-capping kernel takes (Gemma-2's), else None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, kernel: Kernel,
                denominator: torch.Tensor, cap: float | None = None) -> torch.Tensor:
        dloss = (target != IGNORE_INDEX).float() / denominator
        out = kernel.forward({"x": x, "w": w, "target": target, "dloss": dloss}, {} if cap is None else {"cap": cap})
        ctx.save_for_backward(out["dx"], *((out["dw"],) if "dw" in out else ()))  # a frozen head's kernel: no dw
        return out["loss"].sum() / denominator

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        dx, *dw = ctx.saved_tensors
        return dx * grad, dw[0] * grad if dw else None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, kernel: Kernel,
                         num_items_in_batch: torch.Tensor | int | None = None,
                         frozen: Kernel | None = None, cap: float | None = None) -> torch.Tensor:
    """HF's causal-LM loss (targets already shifted; ``IGNORE_INDEX`` rows ignored) without
    the logits: the mean over the counted rows, or the sum over ``num_items_in_batch``.  A
    frozen head (LoRA's base, a frozen tied embedding) runs ``frozen`` (an lm_head_xent_frozen
    kernel, which skips the weight gradient's GEMM) when given.  ``cap``: the logits' soft-cap,
    for kernels that take one (lm_head_xent_softcap)."""
    if frozen is not None and not w.requires_grad:
        kernel = frozen
    if num_items_in_batch is None:
        denominator = (target != IGNORE_INDEX).sum().float()  # all ignored: nan, as HF
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=x.device)
    # Under CUDA autocast a final nn.LayerNorm (GPT-2's ln_f, GPT-NeoX's final_layer_norm) hands
    # back fp32, as autocast runs layer_norm in fp32: lowered here as autocast lowers a matmul's
    # operands, with the gradient flowing back through the cast.
    lowered = autocast_inputs(kernel.spec, {"x": x, "w": w})
    with autocast_off(x):
        return LinearCrossEntropy.apply(lowered["x"], lowered["w"], target, kernel, denominator, cap)


def fused_lm_forward(model: Any, stack: Any, output: type, input_ids: torch.Tensor | None, inputs: dict[str, Any],
                     labels: torch.Tensor | None, logits_to_keep: int | torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """A causal LM's forward whose LM head + loss is the fused kernel (``model.coda_xent``, and
    ``model.coda_xent_frozen`` for a frozen head) in
    training with labels: ``stack`` (its decoder stack) on ``inputs``, then :func:`causal_lm_loss`
    over its last hidden state and ``model.lm_head``, returned as ``output`` with no logits and the
    stack's other outputs.  Anything else is HF's own forward (``type(model).forward``)."""
    shift_labels = kwargs.pop("shift_labels", None)
    if not (model.training and (labels is not None or shift_labels is not None)):
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        return type(model).forward(model, input_ids, **inputs, labels=labels, logits_to_keep=logits_to_keep,
                                   **kwargs)
    outputs = stack(input_ids, **inputs, **kwargs)
    loss = causal_lm_loss(outputs.last_hidden_state, model.lm_head.weight, labels, shift_labels, model.coda_xent,
                          kwargs.get("num_items_in_batch"), model.coda_xent_frozen)
    return output(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k != "last_hidden_state"})


def causal_lm_loss(hidden: torch.Tensor, w: torch.Tensor, labels: torch.Tensor | None,
                   shift_labels: torch.Tensor | None, kernel: Kernel,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   frozen: Kernel | None = None, cap: float | None = None) -> torch.Tensor:
    """HF's causal-LM loss (``ForCausalLMLoss``) of the LM head ``w`` over ``hidden`` (batch,
    tokens, H), by the fused kernel: ``labels`` shifted one token left (the last one ignored),
    or ``shift_labels`` as given; ``cap``: the logits' soft-cap (:func:`linear_cross_entropy`)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), w, shift_labels.reshape(-1).to(hidden.device),
                                kernel, num_items_in_batch, frozen, cap)
