"""``apply_to_llama``: the suite's kernels inside a transformers ``LlamaForCausalLM``, or a
model of a family built from LLaMA's modules:

- Mistral: the same decoder layer, RMSNorm and MLP; an attention that adds a sliding window,
  which the patched layer passes on; Ministral 3 also scales q per position after RoPE (LLaMA-4's
  attention scaling), which the patched layer does as its attention does;
- Qwen2 and Qwen2.5: biases on q, k and v, and a sliding window on some layers;
- Qwen3: per-head RMSNorms of q and k before RoPE, which stay HF's, and so does RoPE; Hunyuan's
  dense models: the same norms after RoPE;
- Phi-3, Phi-3.5 and Phi-4: q, k and v in one projection and gate and up in another, which the
  patch re-lays out; residual dropouts, which must be off; RoPE on part of each head (Phi-4-mini),
  which stays HF's;
- Gemma: RMSNorms that scale by 1 + w, folded into the QKV GEMM as such; the MLP block kernel's
  norm scales by w, so its GeGLU MLP runs alone, as the ``geglu_mlp`` kernel, between HF's
  post-attention norm and residual add (``swiglu=False`` keeps HF's MLP);
- SmolLM3: the same, with some layers that skip RoPE;
- Seed-OSS: LLaMA's modules with q, k and v biases and a dropout on what the attention and the
  MLP add to the residual stream, which must be off (``residual_dropout=0.0``);
- Granite: multipliers on what each sublayer adds to the residual stream (folded into the output
  and down projections' weights) and on the logits (the LM head's input divided instead);
- Ernie 4.5 and Helium: RoPE on interleaved pairs (GPT-J's and GLM's layout) instead of halves,
  which the QKV epilogue rotates as they are (LLaMA's halves are permuted into pairs), and
  Helium's RMSNorm scales in fp32, as the kernels do;
- mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert): with
  ``swiglu=False`` the sparse MoE block stays HF's, its router and shared expert included, while
  its experts, kept as 3-D weights, run each expert as the gated MLP kernel (``moe_experts``;
  ``experts=False`` keeps them HF's); the attention side and the LM head are patched, and the loss
  adds the router's load-balancing loss as HF's does (``output_router_logits``).

Which models qualify is read from their code, not their class names (``families.py``).

Projection biases (``attention_bias``, Qwen2's q/k/v): the fused QKV GEMM's epilogue adds the
fused bias before RoPE, and its backward folds the bias gradient into the pass that reads the
RMSNorm-backward statistic (``llama_ops.py``); an output-projection bias joins the residual that
the out_proj_residual epilogue adds.  MLP biases (``mlp_bias``) are not in the SwiGLU kernels.
Heads may be wider than the model (``heads * head_dim > hidden_size``, Qwen3-0.6B and -4B): the
output projection's task declares its (K, H) weight.

Like Liger's ``apply_liger_kernel_to_llama``, with one flag per op, but it
patches a model *instance* (the weight re-layout needs the weights)::

    model = LlamaForCausalLM(config).to(torch.bfloat16)      # or from_pretrained(...)
    coda_agent.apply_to_llama(model)                          # before building the optimizer
    loss = model(input_ids, labels=labels).loss               # CODA kernels, forward and backward

What each flag swaps (every decoder layer, for a patched layer the QKV
projection is one fused GEMM and the output projection adds the residual in
its epilogue, the out_proj_residual kernel):

- ``rms_norm``: the input RMSNorm folds into the fused QKV GEMM (CODA: the
  GEMM's epilogue multiplies by the inverse RMS; see ``llama_ops.py``); the
  post-attention RMSNorm folds into the gate/up GEMM together with the MLP
  (``swiglu``).  The final norm stays PyTorch's: the LM head's kernel takes the
  normalized hidden state.
- ``rope``: RoPE rotates q and k in the QKV GEMM's epilogue (forward; its
  backward is a tile pass over the gradient, see ``llama_ops.py``).  HF rotates halves of each head
  (``rotate_half``), the catalogue adjacent pairs, so the q/k rows of the fused
  weight (and bias) are permuted per head into pairs: q.k per head is unchanged, so
  attention is too.  Only RoPE with a static frequency table and no scaling of
  cos/sin (rope_type default, linear, llama3), and only where nothing sits
  between the projection and RoPE (with Qwen3's q/k norms RoPE stays HF's, and
  ``coda_flags["rope"]`` says False).
- ``swiglu``: post-attention RMSNorm + SwiGLU MLP + residual as the mlp_block
  kernel, with gate/up fused into one weight whose rows interleave
  ``[g0, u0, g1, u1, ...]`` (adjacent GEMM columns are one pair).  It owns that
  RMSNorm, so it needs ``rms_norm``; where that norm is Gemma's, the MLP alone
  runs as the gated MLP kernel of its activation (``coda_flags["mlp_alone"]``).
- ``fused_linear_cross_entropy``: in training with labels, LM head + loss as the
  lm_head_xent kernel (no full logits; ``logits`` is None, as with Liger); a frozen head
  (LoRA's base, a frozen tied embedding) runs lm_head_xent_frozen, which computes no dw.

``kernels={"mlp_block": "runs/...", ...}`` swaps the suite's expert program of
``out_proj_residual``, ``mlp_block``, ``lm_head_xent`` or ``lm_head_xent_frozen`` for an
accepted one (a run directory or a :class:`Kernel`) of that task or of one with its contract:
the same inputs, params, outputs and gradients.  ``fp8_mlp=True`` is such a
swap: every MLP block runs the ``mlp_block_fp8`` expert (tasks/llama3_fp8: its
six GEMMs in fp8 e4m3 with current row-wise scales, torchao's rowwise
numerics; the master weights, activations and gradients stay bf16), the rest
of the layer bf16.

The re-layout happens once, here; the fused weights are new Parameters
(``self_attn.qkv_proj.weight``, ``mlp.gate_up_proj.weight``), so build the
optimizer afterwards.  ``state_dict()`` still has exactly the HF keys and
values (hooks split and un-permute on save; ``load_state_dict`` fuses HF
weights back, into sharded parameters too; the parts' names stay as parameterless
:class:`~.fused_weights.FusedPart` modules, as FSDP2's checkpointing needs), so checkpoints stay
interchangeable with unpatched models
(``save_pretrained`` writes HF's checkpoint; ``torch.save`` of the whole
patched model loads back patched).
The kernels are verified for bf16: the model is bf16, or keeps fp32 master weights and trains
under bf16 autocast (``dropin.PatchedForward`` runs it as its bf16 copy).

LoRA (``adapters.py``): patch the peft model (``apply_to_llama(get_peft_model(model, config))``).
A projection under LoRA keeps its LoRA layer; its ``base_layer`` is what the fused weight takes
(the state dict's ``q_proj.base_layer.weight``), and the adapters' terms are added to q, k and v
(:func:`_qkv_adapters`) and to the output projection's residual.  Adapters on the MLP need
``swiglu=False``, on the LM head ``fused_linear_cross_entropy=False``.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, eager_attention_forward
from transformers.utils import can_return_tuple

from coda_agent.tasks import SUITE_DIR

from . import moe_experts
from .adapters import base_path, lora_delta, lora_of, peft_base, plus
from .dropin import PatchedForward, check_slots, record_attention, refuse_patched, slot_kernel, suite_kernel
from .families import (AttentionPlan, check_model, head_dim, llama_architecture, rotation_layout,
                       tables_are_llamas)
from .fused_weights import halves_from_interleaved, interleave_halves, interleave_rows, relayout, split_interleaved
from .kernel import Kernel, KernelError
from .llama_ops import attention_input, causal_lm_loss
from .gated_mlps import check_gated_mlp, patch_gated_mlp

SWAPPABLE = ("out_proj_residual", "mlp_block", "lm_head_xent", "lm_head_xent_frozen")


FP8_SUITE = SUITE_DIR.parent / "llama3_fp8"


@dataclass(frozen=True)
class LayerPlan:
    rms_norm: bool
    rope: bool
    swiglu: bool
    out_proj: Kernel
    mlp: Kernel
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by 1 + w
    rope_layout: str = "halves"  # the columns the rotation pairs (families.ROTATIONS): halves are permuted to pairs
    mlp_alone: bool = False  # swiglu: the MLP module runs its gated MLP kernel, the norm and residual HF's

    @property
    def block(self) -> bool:
        """Whether the post-attention norm, the MLP and the residual add run as the MLP block kernel."""
        return self.swiglu and not self.mlp_alone

    @property
    def permutes(self) -> bool:
        """Whether q's and k's rows are permuted in the fused weight: LLaMA's halves, rotated in the
        epilogue, which turns adjacent pairs."""
        return self.rope and self.rope_layout == "halves"


def apply_to_llama(model: LlamaForCausalLM | LlamaModel, *, rope: bool = True, rms_norm: bool = True,
                   swiglu: bool = True, fused_linear_cross_entropy: bool = True, fp8_mlp: bool = False,
                   experts: bool = True, kernels: dict[str, Kernel | str | Path] | None = None
                   ) -> LlamaForCausalLM | LlamaModel:
    """Patch ``model`` in place (see the module docstring) and return it."""
    given_model, model = model, peft_base(model)  # a PeftModel: its transformers model is patched
    refuse_patched(getattr(model, "model", model))
    base, lm_kind, attentions, norm_offset = llama_architecture(model, keep_mlp=not swiglu)
    # RoPE rides in the QKV GEMM's epilogue only where nothing sits between the projection and
    # the rotation and the rotation is one the epilogue computes (LLaMA's halves or interleaved
    # pairs): after Qwen3's q/k norms, or where it turns part of each head (Phi-3's
    # partial_rotary_factor), it stays HF's.
    layout = rotation_layout(base, attentions) if rope and not any(a.qk_norm for a in attentions) else None
    rope = layout is not None
    # Gemma's RMSNorms scale by 1 + w, which the MLP block kernel does not take: its MLP alone runs
    # as the kernel of its activation, the norm and the residual add stay HF's.
    mlp_alone = swiglu and bool(norm_offset)
    if mlp_alone and (fp8_mlp or "mlp_block" in (kernels or {})):
        raise KernelError("this model's RMSNorms scale by (1 + weight) (Gemma's), which the MLP block kernels "
                          "(mlp_block, mlp_block_fp8) do not take: its MLP runs alone as the gated MLP kernel "
                          "of its activation; drop fp8_mlp and kernels['mlp_block'], or pass swiglu=False to "
                          "keep HF's MLP")
    if swiglu and not rms_norm and not mlp_alone:
        raise KernelError("swiglu=True runs the post-attention RMSNorm, the SwiGLU MLP and the residual add as "
                          "one kernel (mlp_block), so it needs rms_norm=True")
    if fp8_mlp and not swiglu:
        raise KernelError("fp8_mlp=True runs the MLP block (mlp_block_fp8), so it needs swiglu=True")
    if fp8_mlp and "mlp_block" in (kernels or {}):
        raise KernelError("fp8_mlp=True and kernels['mlp_block'] both choose the MLP block's kernel; give one")
    cfg = base.config
    # names the fix; an MLP that runs alone is checked as one (gated_mlps.check_gated_mlp)
    check_model(model, base, cfg, rope, swiglu and not mlp_alone, xent=fused_linear_cross_entropy and bool(lm_kind))
    mlps = [check_gated_mlp(layer.mlp, f"layers.{i}.mlp", "swiglu=False") for i, layer in enumerate(base.layers)
            ] if mlp_alone else [None] * len(base.layers)
    moes = moe_experts.find(base.layers, "layers", "experts=False") if experts and not swiglu else {}
    rope = rope and tables_are_llamas(base)
    check_slots(kernels, SWAPPABLE)
    given = {**(kernels or {}), **({"mlp_block": suite_kernel("mlp_block_fp8", FP8_SUITE)} if fp8_mlp else {})}
    chosen = {name: slot_kernel(name, given.get(name), suite_kernel(name)) for name in SWAPPABLE}
    if rms_norm or rope or swiglu:
        plan = LayerPlan(rms_norm, rope, swiglu, chosen["out_proj_residual"], chosen["mlp_block"],
                         cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg),
                         norm_offset, layout or "halves", mlp_alone)
        freq = _rope_lanes(base, plan) if rope else None
        for layer, attention, mlp in zip(base.layers, attentions, mlps):
            _patch_layer(layer, plan, attention, freq, mlp)
    for module, task in moes.values():
        moe_experts.patch(module, None, task, suite_kernel(task))
    if fused_linear_cross_entropy and lm_kind:  # "" for a decoder stack without an LM head
        patch_causal_lm(model, lm_kind, chosen["lm_head_xent"], chosen["lm_head_xent_frozen"])
    base.coda_flags = {"rope": rope, "rms_norm": rms_norm, "swiglu": swiglu, "mlp_alone": mlp_alone,
                       "fused_linear_cross_entropy": fused_linear_cross_entropy, "fp8_mlp": fp8_mlp,
                       "experts": sorted(moes)}
    return given_model


def patch_causal_lm(model: nn.Module, kind: str, xent: Kernel, xent_frozen: Kernel, softcap: float | None = None
                    ) -> None:
    """In training with labels, ``model``'s LM head and loss run as the fused kernels; ``kind``:
    whose causal LM code its forward is (``families.CAUSAL_LMS``, or ``modules.SOFTCAP_LMS``, which
    soft-cap the logits by ``softcap``: the kernels then take it as their ``cap``).  The patched
    forward returns the output class the model's own forward names (:func:`_output_class`)."""
    model.coda_xent, model.coda_xent_frozen, model.coda_softcap = xent, xent_frozen, softcap
    model.coda_logits_scale = float(model.config.logits_scaling) if kind == "Granite's" else 1.0
    model.coda_router_loss = kind == "Mixtral's"
    # read once here: torch.compile cannot trace dataclasses.fields inside the forward
    model.coda_output, model.coda_output_extra = _output_class(model)
    model.forward = PatchedForward(model, _causal_lm_forward)


def _output_class(model: nn.Module) -> tuple[type, tuple[str, ...]]:
    """The output class ``model``'s own forward returns (Gemma-4's carries the shared KV states),
    where it names one with a causal LM output's fields, else CausalLMOutputWithPast; and the
    fields it adds to those, which the decoder's output fills."""
    try:  # a modeling file with postponed annotations names the class as a string
        out = inspect.signature(type(model).forward, eval_str=True).return_annotation
    except (NameError, SyntaxError, TypeError):
        out = None
    names = [f.name for f in dataclasses.fields(out)] if isinstance(out, type) and dataclasses.is_dataclass(out) else []
    if not _LM_OUTPUT_FIELDS <= set(names):
        return CausalLMOutputWithPast, ()
    return out, tuple(n for n in names if n not in _LM_OUTPUT_FIELDS)


# What the patched forward fills itself; any other field of the output class comes from the decoder's
_LM_OUTPUT_FIELDS = {"loss", "logits", "past_key_values", "hidden_states", "attentions"}


# --------------------------------------------------------------------------- weights


def pairs_from_halves(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """Per head, rows [x0..x(d/2-1), y0..] -> [x0, y0, x1, y1, ...]: HF's rotate_half layout to pairs."""
    return w.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(heads * d, -1)


def halves_from_pairs(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return w.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(heads * d, -1)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    if plan.permutes:
        q, k = pairs_from_halves(q, plan.heads, plan.head_dim), pairs_from_halves(k, plan.kv_heads, plan.head_dim)
    return torch.cat((q, k, v)).contiguous()


def _hf_qkv_rows(w: torch.Tensor, plan: LayerPlan) -> tuple[torch.Tensor, ...]:
    """Rows [q; k; v] as the three parts: Phi-3's qkv_proj in HF's layout, or the fused weight."""
    d = plan.head_dim
    return w.split([plan.heads * d, plan.kv_heads * d, plan.kv_heads * d])


def _split_qkv(w: torch.Tensor, plan: LayerPlan) -> tuple[torch.Tensor, ...]:
    d = plan.head_dim
    q, k, v = _hf_qkv_rows(w, plan)
    if plan.permutes:
        q, k = halves_from_pairs(q, plan.heads, d), halves_from_pairs(k, plan.kv_heads, d)
    return q.contiguous(), k.contiguous(), v.contiguous()


# The fused QKV projection's row maps (``relayout``'s fuse and split), Phi-3's from its own fused
# layout [q; k; v] (gate and up: ``fused_weights``).
def _fuse_hf_qkv(w: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    return _fuse_qkv(*_hf_qkv_rows(w, plan), plan)


def _split_hf_qkv(w: torch.Tensor, plan: LayerPlan) -> tuple[torch.Tensor]:
    return (torch.cat(_split_qkv(w, plan)),)


def _rope_lanes(base: LlamaModel, plan: LayerPlan) -> torch.Tensor:
    """Per fused-QKV column, the frequency of its pair (both lanes; 0 on v: no rotation)."""
    lanes = base.rotary_emb.inv_freq.float().repeat_interleave(2)
    v = torch.zeros(plan.kv_heads * plan.head_dim, device=lanes.device)
    return torch.cat((lanes.repeat(plan.heads), lanes.repeat(plan.kv_heads), v))


def _patch_layer(layer: nn.Module, plan: LayerPlan, attention: AttentionPlan, freq: torch.Tensor | None,
                 mlp: tuple[str, str] | None) -> None:
    attn = layer.self_attn
    # Under LoRA a projection's weight is its base layer's (adapters.py): that part is fused, and the
    # LoRA layer stays, its adapters beside the kernel; Phi-3's fused weight takes the base's place.
    if attention.fused:  # Phi-3: one projection each, in HF's rows ([q; k; v], [gate; up])
        qkv = base_path(attn, "qkv_proj")
        relayout(attn, qkv, (qkv,), partial(_fuse_hf_qkv, plan=plan), partial(_split_hf_qkv, plan=plan))
    else:
        relayout(attn, "qkv_proj", tuple(base_path(attn, p) for p in ("q_proj", "k_proj", "v_proj")),
                  partial(_fuse_qkv, plan=plan), partial(_split_qkv, plan=plan))
    if freq is not None and attention.rotates:
        attn.register_buffer("coda_rope_freq", freq, persistent=False)
    if mlp is not None:  # (its layout, its kernel's task): the MLP alone, as that kernel
        patch_gated_mlp(layer.mlp, *mlp)
    elif plan.swiglu and attention.fused:
        relayout(layer.mlp, "gate_up_proj", ("gate_up_proj",), interleave_halves, halves_from_interleaved)
    elif plan.swiglu:
        relayout(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"), interleave_rows, split_interleaved)
    layer.coda_plan, layer.coda_attention = plan, attention
    layer.forward = PatchedForward(layer, _layer_forward)


# --------------------------------------------------------------------------- forwards


def _layer_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                   use_cache: bool | None = False, position_embeddings: tuple | None = None,
                   **kwargs: Any) -> torch.Tensor:
    """LlamaDecoderLayer.forward with the non-attention work in the suite's kernels."""
    plan: LayerPlan = self.coda_plan
    attn = self.self_attn
    b, t, dim = hidden_states.shape
    h = hidden_states.reshape(b * t, dim)
    x = h if plan.rms_norm else self.input_layernorm(hidden_states).reshape(b * t, dim)
    extra: AttentionPlan = self.coda_attention
    rope = plan.rope and extra.rotates  # in this layer's QKV epilogue
    pos = None
    if rope:
        ids = position_ids if position_ids is not None else torch.arange(t, device=h.device)[None]
        pos = ids.expand(b, t).reshape(-1).float()
    d, nq, nkv = plan.head_dim, plan.heads, plan.kv_heads
    gamma = self.input_layernorm.weight
    if plan.norm_offset:  # Gemma's scale, 1 + w, in fp32 as HF computes it (autograd carries dw)
        gamma = gamma.float() + plan.norm_offset
    qkv = attention_input(x, gamma if plan.rms_norm else None, attn.qkv_proj.weight,
                          attn.qkv_proj.bias, pos, attn.coda_rope_freq if rope else None, plan.eps)
    q, k, v = (part.view(b, t, -1, d).transpose(1, 2) for part in qkv.split([nq * d, nkv * d, nkv * d], dim=1))
    terms = _qkv_adapters(self, hidden_states if plan.rms_norm else x.view(b, t, dim), position_embeddings, rope)
    if terms is not None:  # LoRA's terms join q, k and v where the projections' outputs are
        q, k, v = (plus(part, term) for part, term in zip((q, k, v), terms))
    q_norm, k_norm = (getattr(attn, n) for n in extra.qk_norms) if extra.qk_norm else (None, None)
    if q_norm is not None and not extra.norm_after_rope:  # over each head's D columns
        q, k = q_norm(q), k_norm(k)
    if not plan.rope and extra.rotates:
        q, k = extra.rotary(q, k, *position_embeddings)
    if q_norm is not None and extra.norm_after_rope:
        q, k = q_norm(q), k_norm(k)
    if extra.query_scale is not None:  # one number per token: the epilogue's pair layout does not matter
        q = q * extra.query_scale(position_ids).to(q.dtype)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    if extra.window is not None:
        kwargs["sliding_window"] = extra.window
    out, weights = interface(attn, q, k, v, attention_mask, dropout=attn.attention_dropout if attn.training else 0.0,
                             scaling=attn.scaling, **kwargs)
    record_attention(weights)
    # An output-projection bias joins the residual the epilogue adds (autograd sums its gradient);
    # a residual scale (Granite's) multiplies the weights whose products the epilogues add, once a
    # call (a weight-sized product; autograd carries the scale to their gradients).
    scale = extra.residual_scale
    w_o, w_down = attn.o_proj.weight.t(), self.mlp.down_proj.weight if plan.block else None
    if scale != 1.0:
        w_o, w_down = w_o * scale, None if w_down is None else w_down * scale
    residual = h if attn.o_proj.bias is None else h + attn.o_proj.bias * scale
    out = out.reshape(b * t, nq * d)
    term = lora_delta(attn.o_proj, out)  # LoRA's term joins the residual the epilogue adds
    residual = plus(residual, None if term is None else term * scale)
    h1 = plan.out_proj(out, w_o, residual)["y"]
    if plan.block:
        h2 = plan.mlp(h1, self.post_attention_layernorm.weight, self.mlp.gate_up_proj.weight, w_down,
                      eps=plan.eps)["y"]
    else:  # HF's MLP module (or Gemma's, patched as its kernel), on (batch, tokens, hidden) as HF calls it
        h1 = h1.view(b, t, dim)
        h2 = h1 + self.mlp(self.post_attention_layernorm(h1)) * scale
    return h2.view(b, t, dim)


def _qkv_adapters(self: nn.Module, hidden: torch.Tensor, position_embeddings: tuple | None,
                  rope: bool) -> tuple[torch.Tensor | None, ...] | None:
    """The LoRA terms of q, k and v (batch, heads, tokens, head_dim; None where a projection has
    none) on the projections' input: ``hidden``, normalized here by HF's input norm where the
    kernel folds it (``rms_norm``).  Where the kernel's epilogue rotates (``rope``), a term is
    rotated as HF rotates (RoPE is linear: rotating the sum adds the rotated term) and laid out in
    the kernel's pairs, as the fused rows are (LLaMA's halves permuted; interleaved pairs as they are)."""
    attn, plan = self.self_attn, self.coda_plan
    names = ("qkv_proj",) if self.coda_attention.fused else ("q_proj", "k_proj", "v_proj")
    if not any(lora_of(getattr(attn, n)) is not None for n in names):
        return None
    b, t, _ = hidden.shape
    x = self.input_layernorm(hidden) if plan.rms_norm else hidden
    d = plan.head_dim
    widths = (plan.heads * d, plan.kv_heads * d, plan.kv_heads * d)
    deltas = [lora_delta(getattr(attn, n), x) for n in names]
    if self.coda_attention.fused:
        deltas = [None] * 3 if deltas[0] is None else list(deltas[0].split(widths, dim=-1))
    if all(delta is None for delta in deltas):
        return None
    q, k, v = (None if delta is None else delta.view(b, t, -1, d).transpose(1, 2) for delta in deltas)
    if rope and (q is not None or k is not None):  # HF's rotation takes both: a missing one as zeros
        like = q if q is not None else k
        rq, rk = self.coda_attention.rotary(like.new_zeros(b, plan.heads, t, d) if q is None else q,
                                            like.new_zeros(b, plan.kv_heads, t, d) if k is None else k,
                                            *position_embeddings)
        if plan.permutes:
            rq, rk = pairs_of_halves(rq), pairs_of_halves(rk)
        q, k = (None if part is None else rotated for part, rotated in ((q, rq), (k, rk)))
    return q, k, v


def pairs_of_halves(x: torch.Tensor) -> torch.Tensor:
    """The last dimension (one head) from HF's rotate_half layout to the kernel's pairs
    (:func:`pairs_from_halves` on activations)."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


@can_return_tuple
def _causal_lm_forward(self: LlamaForCausalLM, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       past_key_values: Any = None, inputs_embeds: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None, use_cache: bool | None = None,
                       logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
    """LlamaForCausalLM.forward (or Granite's, Mixtral's, Gemma-2's or Gemma-4's, whose code it follows
    by the flags ``patch_causal_lm`` sets; Gemma-4's per-layer inputs reach its decoder in
    ``kwargs``); in training with labels, LM head + loss is the fused kernel."""
    shift_labels = kwargs.pop("shift_labels", None)
    if not (self.training and (labels is not None or shift_labels is not None)):
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
    router = self.coda_router_loss  # a mixture of experts: HF's loss adds the load-balancing loss
    if router:
        asked = kwargs.get("output_router_logits")
        kwargs["output_router_logits"] = self.config.output_router_logits if asked is None else asked
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
    hidden = outputs.last_hidden_state
    if self.coda_logits_scale != 1.0:  # Granite divides the logits: the same as dividing h
        hidden = hidden / self.coda_logits_scale
    loss = causal_lm_loss(hidden, self.lm_head.weight, labels, shift_labels, self.coda_xent,
                          kwargs.get("num_items_in_batch"), self.coda_xent_frozen, self.coda_softcap)
    if not router:
        cls = self.coda_output
        extra = {name: getattr(outputs, name, None) for name in self.coda_output_extra}
        return cls(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                   hidden_states=outputs.hidden_states, attentions=outputs.attentions, **extra)
    aux = None
    if kwargs["output_router_logits"]:  # as MixtralForCausalLM.forward, whose code this model's is
        aux = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                       attention_mask)
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=None, past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                     router_logits=outputs.router_logits)
