"""``apply_to_gpt_neox``: the GPT-2 suite's kernels inside a transformers ``GPTNeoXForCausalLM``
(Pythia, GPT-NeoX-20B; or a ``GPTNeoXModel``, the decoder stack alone).

GPT-NeoX's layer is GPT-2's pre-LN block in other clothes: LayerNorms with weight and bias, one
fused QKV projection and an output projection with biases, a GELU MLP with biases; it adds RoPE
(on part of each head) and, by default, a parallel residual.  So it is patched like
:func:`apply_to_gpt2` (``gpt2.py``), with one flag per op, on a model *instance* in place::

    model = GPTNeoXForCausalLM(config).to(torch.bfloat16)   # or from_pretrained("EleutherAI/pythia-160m")
    coda_agent.apply_to_gpt_neox(model)
    loss = model(input_ids, labels=labels).loss              # CODA kernels, forward and backward

What each flag swaps (every layer, ``tasks/gpt2/``; for a patched layer the attention output
projection ``dense`` adds its bias and the residual in its GEMM's epilogue, the
out_proj_residual kernel):

- ``layer_norm``: ``input_layernorm`` and ``attention.query_key_value`` with its bias as the
  ln_qkv kernel (LayerNorm's rank-1 form: the GEMM reads the residual stream itself).  The (T, 3H)
  result is HF's: viewed per head as ``[q | k | v]`` (each head's three slices side by side, not
  GPT-2's ``[Q; K; V]``) and split as HF splits it.  ``layer_norm=False`` keeps HF's LayerNorm and
  projection.
- ``mlp``: ``post_attention_layernorm`` + the MLP (``dense_h_to_4h``, GELU, ``dense_4h_to_h``,
  biases) + a residual add as the mlp_block kernel, ``y = h + mlp(LN(h))``.  It owns that
  LayerNorm, so it needs ``layer_norm``.  The GELU is read from the model as in apply_to_gpt2 (the
  activation module probed against both forms): the exact one (``gelu``, Pythia's) runs the
  ``mlp_block`` task's expert, the tanh approximation (``gelu_new``, ``gelu_fast``, GPT-NeoX-20B's;
  ``gelu_pytorch_tanh``) ``mlp_block_tanh``'s.
- ``fused_linear_cross_entropy``: in training with labels, the LM head (``lm_head``, HF's
  ``embed_out`` before transformers 5; untied unless ``tie_word_embeddings``) + the loss as the
  LLaMA-3 suite's lm_head_xent kernel (no full logits; ``logits`` is None, as with apply_to_gpt2).
  ``final_layer_norm`` stays HF's, inside the stack's own forward.

**The residual.**  ``use_parallel_residual=True`` (Pythia's, GPT-NeoX-20B's) computes
``out = x + attn(ln1(x)) + mlp(ln2(x))``: the MLP kernel runs first on the layer's input,
``r = x + mlp(ln2(x))``, and out_proj_residual adds the attention's projection to ``r``.
``use_parallel_residual=False`` is GPT-2's order: ``h1 = x + attn(ln1(x))`` by out_proj_residual,
then ``out = mlp_block(h1)``.  Each layer follows its own flag.

**Attention stays HF's**: RoPE through the rotation the attention's code calls, on the first
``rotary_ndims`` of each head (``partial_rotary_factor``, the old ``rotary_pct``) with the cos/sin
the stack's rotary embedding gives (any ``rope_type``), the implementation the config selects
(``eager``, ``sdpa``, flash, via ``ALL_ATTENTION_FUNCTIONS``) with the module's scaling,
``attention_dropout`` in training, and the KV cache.

**Weights.**  GPT-NeoX's projections are nn.Linear, (out, in), as the kernels take them: nothing is
re-laid out, so ``state_dict``, ``save_pretrained``, a tied head and an optimizer built before the
patch all see the same Parameters.  ``attention_bias=False`` builds ``query_key_value`` and
``dense`` without biases; the kernels always add one, so those layers pass a zero bias, a plain
tensor made per call (not a Parameter: the state dict gains no key; exact, since adding zero is;
what it costs is the bias gradient the kernels reduce and autograd drops, one pass over the
output gradient).  A projection of the MLP without a bias gets the same.

``kernels={"mlp_block": "runs/...", ...}`` swaps a slot's expert (``ln_qkv``,
``out_proj_residual``, ``mlp_block``, ``lm_head_xent``, ``lm_head_xent_frozen``) as in
apply_to_gpt2 (``dropin.py``); the ``mlp_block`` slot's task follows the model's GELU.

**Refused** (a :class:`KernelError` naming what differs and the fix), before anything changes:

- a model that is not GPT-NeoX's code: GPT-2 (``apply_to_gpt2``), a LLaMA (``apply_to_llama``),
  GPT-NeoX-Japanese or any variant whose layer, attention or MLP computes something else
  (compared as code, ``families.same_code``), a head other than the causal LM's (patch
  ``model.gpt_neox``);
- ``hidden_dropout > 0``: the layer's dropouts on what the attention and the MLP add sit before
  residual adds that happen in GEMM epilogues, with no dropout (``emb_dropout`` stays HF's, and
  ``attention_dropout`` is fine);
- an activation that is neither GELU (``mlp=False`` keeps HF's MLP);
- projections that are not plain nn.Linear (a quantized weight; peft's LoRA runs beside the
  kernels, ``adapters.py``, but not in the MLP block kernel: ``mlp=False``), LayerNorms
  without their affine weight and bias, an LM head with a bias;
- a vocabulary that is not a multiple of 8 with the fused loss (Pythia's 50304 and
  GPT-NeoX-20B's 50432 are);
- parameters that are not bf16, a model wrapped by torch.compile, a model already patched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import (GPTNeoXAttention, GPTNeoXForCausalLM, GPTNeoXLayer,
                                                            GPTNeoXMLP, GPTNeoXModel, apply_rotary_pos_emb,
                                                            eager_attention_forward)
from transformers.utils import can_return_tuple

from .adapters import adapted, peft_base, require_projection
from .dropin import (GPT2_SLOTS, GPT_NEOX_STACK, BlockPlan, PatchedForward, block_plan, check_lm_head, check_slots,
                     gelu_of, has_modules, record_attention, refusal_hint, refuse_patched, refuse_wrapped,
                     require_children, require_code, require_kernel_dtypes, require_layer_norm, xent_kernels)
from .families import same_code
from .kernel import Kernel, KernelError
from .llama_ops import fused_lm_forward

SWAPPABLE = GPT2_SLOTS

_CHILDREN = {"layer": frozenset({"input_layernorm", "post_attention_layernorm", "post_attention_dropout",
                                 "post_mlp_dropout", "attention", "mlp"}),
             "attention": frozenset({"query_key_value", "dense"}),
             "mlp": frozenset({"dense_h_to_4h", "dense_4h_to_h", "act"})}


def apply_to_gpt_neox(model: GPTNeoXForCausalLM | GPTNeoXModel, *, layer_norm: bool = True, mlp: bool = True,
                      fused_linear_cross_entropy: bool = True,
                      kernels: dict[str, Kernel | str | Path] | None = None) -> GPTNeoXForCausalLM | GPTNeoXModel:
    """Patch ``model`` in place (see the module docstring) and return it."""
    given_model, model = model, peft_base(model)  # a PeftModel: its transformers model is patched
    refuse_patched(getattr(model, "gpt_neox", model))
    if mlp and not layer_norm:
        raise KernelError("mlp=True runs post_attention_layernorm, the MLP and the residual add as one kernel "
                          "(mlp_block), so it needs layer_norm=True")
    base, causal_lm = gpt_neox_architecture(model, layer_norm=layer_norm, keep_mlp=not mlp)
    xent = fused_linear_cross_entropy and causal_lm
    gelu = check_gpt_neox(model, base, mlp, xent)  # names the fix
    check_slots(kernels, SWAPPABLE)
    given = kernels or {}
    plan = block_plan(layer_norm, mlp, gelu, given)
    for layer in base.layers:
        layer.coda_plan = plan
        layer.forward = PatchedForward(layer, _layer_forward)
    if xent:
        model.coda_xent, model.coda_xent_frozen = xent_kernels(given)
        model.forward = PatchedForward(model, _lm_forward)
    base.coda_flags = {"layer_norm": layer_norm, "mlp": mlp, "gelu": gelu,
                       "fused_linear_cross_entropy": fused_linear_cross_entropy}
    return given_model


# --------------------------------------------------------------------------- which models


def gpt_neox_architecture(model: nn.Module, layer_norm: bool = True, keep_mlp: bool = False) -> tuple[nn.Module, bool]:
    """(the decoder stack, whether ``model`` is its causal LM) for a model whose every module the
    patch replaces or reads computes what GPT-NeoX's does (compared as code, ``families.same_code``);
    ``layer_norm=False`` leaves ``input_layernorm`` and ``query_key_value`` HF's, ``keep_mlp``
    (``mlp=False``) the MLPs and their LayerNorm, so those may be anything the layer calls by those
    names.  Anything else is refused by what differs."""
    refuse_wrapped(model, "apply_to_gpt_neox")
    name = type(model).__name__
    inner = None if has_modules(model, GPT_NEOX_STACK) else next(
        (n for n, m in model.named_children() if has_modules(m, GPT_NEOX_STACK)), "")
    if inner == "":
        raise KernelError(f"apply_to_gpt_neox patches a transformers GPTNeoXForCausalLM or GPTNeoXModel (Pythia, "
                          f"GPT-NeoX-20B); got {name}{refusal_hint(model, 'apply_to_gpt_neox')}")
    base = model if inner is None else getattr(model, inner)
    for i, layer in enumerate(base.layers):
        for what, module, want in (("layer", layer, GPTNeoXLayer.forward),
                                   ("attention", getattr(layer, "attention", None), GPTNeoXAttention.forward),
                                   *(() if keep_mlp else (("MLP", getattr(layer, "mlp", None), GPTNeoXMLP.forward),))):
            require_code(module, want, what, "GPT-NeoX", name, "apply_to_gpt_neox")
        for part, want in _CHILDREN.items():
            if part == "mlp" and keep_mlp:
                continue
            require_children(layer if part == "layer" else getattr(layer, part), want, f"layers.{i}", "GPT-NeoX",
                             part, "layer")
        projections = (*((("attention", "query_key_value"),) if layer_norm else ()), ("attention", "dense"),
                       *(() if keep_mlp else (("mlp", "dense_h_to_4h"), ("mlp", "dense_4h_to_h"))))
        for part, proj in projections:
            require_projection(getattr(getattr(layer, part), proj), f"layers.{i}.{part}.{proj}", nn.Linear,
                               "nn.Linear", "mlp" if part == "mlp" else "")
        norms = (*(("input_layernorm",) if layer_norm else ()), *(() if keep_mlp else ("post_attention_layernorm",)))
        for norm in norms:
            require_layer_norm(getattr(layer, norm), f"layers.{i}.{norm}")
    if inner is None:
        return base, False
    if inner != "gpt_neox" or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise KernelError(f"{name}'s head is not a causal LM's lm_head: patch its decoder stack, "
                          f"apply_to_gpt_neox(model.{inner}), and the head stays HF's")
    if not same_code(type(model).forward, GPTNeoXForCausalLM.forward):
        raise KernelError(f"{name}.forward is not GPTNeoXForCausalLM's (its head computes something else); patch its "
                          "decoder stack, apply_to_gpt_neox(model.gpt_neox), and the head stays HF's")
    return base, True


def check_gpt_neox(model: nn.Module, base: nn.Module, mlp: bool, xent: bool) -> str | None:
    """Refuse, naming the fix, what a GPT-NeoX model may hold that the kernels the flags choose do
    not take (see the module docstring); return the GELU the MLP kernel must compute (None:
    mlp=False)."""
    require_kernel_dtypes(model, "apply_to_gpt_neox")
    cfg = base.config
    gelu = None
    for i, layer in enumerate(base.layers):
        # With mlp=False the patched layer applies HF's post_mlp_dropout itself (HF's MLP, HF's add).
        drops = [("post_attention_dropout", layer.post_attention_dropout.p),
                 *((("post_mlp_dropout", layer.post_mlp_dropout.p),) if mlp else ())]
        for what, p in drops:
            if p > 0:
                raise KernelError(f"layers.{i}.{what} drops with p = {p} (hidden_dropout): the patched layer adds "
                                  "each residual inside a GEMM epilogue, with no dropout; build the model with "
                                  "hidden_dropout=0.0 (from_pretrained(..., hidden_dropout=0.0))")
        if mlp:
            gelu = gelu_of(layer.mlp.act, f"layers.{i}.mlp.act", f"hidden_act {cfg.hidden_act!r}",
                           "apply_to_gpt_neox", "layers", gelu)
    if xent:
        check_lm_head(model.lm_head)
    return gelu


# --------------------------------------------------------------------------- forwards


def _bias(linear: nn.Linear) -> torch.Tensor:
    """The projection's bias, or a zero one made per call where it has none (attention_bias=False):
    the kernels add a bias, and adding zero is exact.  Per call, since the package keeps no tensor
    between calls (CUDA graphs, tests/test_cuda_graphs.py)."""
    if linear.bias is not None:
        return linear.bias
    return torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)


def _layer_forward(self: GPTNeoXLayer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, use_cache: bool | None = False, layer_past: Any = None,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                   **kwargs: Any) -> torch.Tensor:
    """GPTNeoXLayer.forward with the non-attention work in the GPT-2 suite's kernels."""
    plan: BlockPlan = self.coda_plan
    attn = self.attention
    b, t, dim = hidden_states.shape
    x = hidden_states.reshape(b * t, dim)
    ln1, qkv_proj = self.input_layernorm, attn.query_key_value
    if plan.layer_norm:
        qkv = plan.ln_qkv(x, ln1.weight, ln1.bias, qkv_proj.weight, _bias(qkv_proj), eps=ln1.eps)["qkv"]
        qkv = adapted(qkv, qkv_proj, lambda: ln1(x))  # LoRA's term, on the projection's input
    else:  # HF's LayerNorm and projection (peft's own LoRA forward, where it has one)
        qkv = qkv_proj(ln1(x))
    # HF's layout: per head, [q | k | v] of head_size columns each.
    q, k, v = qkv.view(b, t, -1, 3 * attn.head_size).transpose(1, 2).chunk(3, dim=-1)
    # The rotation GPT-NeoX's attention calls (same_code held the attention's own call to it): on
    # the first rotary_ndims of each head, the width of the stack's cos and sin.
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    if layer_past is not None:
        k, v = layer_past.update(k, v, attn.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    # position_ids and use_cache reach the interface as HF's attention passes them on (flash
    # attention reads position_ids for packed sequences).
    out, weights = interface(attn, q, k, v, attention_mask, scaling=attn.scaling,
                             dropout=attn.attention_dropout if attn.training else 0.0, position_ids=position_ids,
                             use_cache=use_cache, **kwargs)
    record_attention(weights)
    out = out.reshape(b * t, dim)
    dense = attn.dense
    # The residual the output projection's epilogue adds takes its LoRA term.
    if self.use_parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x)): the MLP's residual sum first
        residual = adapted(_mlp(self, plan, x, b, t), dense, lambda: out)
        return plan.out_proj(out, residual, dense.weight, _bias(dense))["h"].view(b, t, dim)
    h1 = plan.out_proj(out, adapted(x, dense, lambda: out), dense.weight, _bias(dense))["h"]
    return _mlp(self, plan, h1, b, t).view(b, t, dim)


def _mlp(self: GPTNeoXLayer, plan: BlockPlan, h: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """``h + mlp(post_attention_layernorm(h))`` on (tokens, hidden) rows."""
    ln2, mlp = self.post_attention_layernorm, self.mlp
    if plan.mlp:
        return plan.mlp_block(h, ln2.weight, ln2.bias, mlp.dense_h_to_4h.weight, _bias(mlp.dense_h_to_4h),
                              mlp.dense_4h_to_h.weight, _bias(mlp.dense_4h_to_h), eps=ln2.eps)["y"]
    # HF's MLP (and its dropout), on (batch, tokens, hidden) as HF calls it
    hs = h.view(b, t, -1)
    return (hs + self.post_mlp_dropout(mlp(ln2(hs)))).view(b * t, -1)


@can_return_tuple
def _lm_forward(self: GPTNeoXForCausalLM, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, past_key_values: Any = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
    """GPTNeoXForCausalLM.forward; in training with labels, the LM head + loss is the fused kernel."""
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
                  past_key_values=past_key_values, use_cache=use_cache)
    return fused_lm_forward(self, self.gpt_neox, CausalLMOutputWithPast, input_ids, inputs, labels, logits_to_keep,
                            kwargs)
