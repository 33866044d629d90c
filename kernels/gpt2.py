"""``apply_to_gpt2``: the GPT-2 suite's kernels inside a transformers ``GPT2LMHeadModel`` (or a
``GPT2Model``, the decoder stack alone).

Like :func:`apply_to_llama` (``llama.py``), with one flag per op, it patches a model *instance*
in place::

    model = GPT2LMHeadModel(config).to(torch.bfloat16)        # or from_pretrained("gpt2", resid_pdrop=0.0)
    coda_agent.apply_to_gpt2(model)
    loss = model(input_ids, labels=labels).loss                # CODA kernels, forward and backward

What each flag swaps (every block, ``tasks/gpt2/``; for a patched block the attention output
projection adds its bias and the residual in its GEMM's epilogue, the out_proj_residual kernel):

- ``layer_norm``: ln_1 and the fused QKV projection with its bias (``attn.c_attn``) as the
  ln_qkv kernel: LayerNorm commutes with the GEMM that consumes it in its rank-1 form, so the
  GEMM reads the residual stream itself.  ``layer_norm=False`` keeps HF's ln_1 and c_attn.
- ``mlp``: ln_2 + the MLP (c_fc, GELU, c_proj, biases) + the residual add as the mlp_block
  kernel.  It owns ln_2, so it needs ``layer_norm``.  The GELU is read from the model: its
  activation module is probed against both forms, and the kernel follows it: GELU's tanh
  approximation (``gelu_new``, GPT-2's; ``gelu_pytorch_tanh``, ``gelu_fast``) runs the
  ``mlp_block_tanh`` task's expert, the exact one (``gelu``) ``mlp_block``'s.
- ``fused_linear_cross_entropy``: in training with labels, the tied LM head + loss as the
  LLaMA-3 suite's lm_head_xent kernel (no full logits; ``logits`` is None, as with
  apply_to_llama).  ln_f stays PyTorch's: HF's ``GPT2Model`` applies it inside its own forward,
  which the patch keeps, so the kernel takes the normalized hidden state.  (The GPT-2 suite's
  lm_head_xent also folds the final LayerNorm; it needs the stream before ln_f, which the
  stack's forward does not give.)  The head's weight *is* ``transformer.wte.weight`` (HF ties
  them), so the kernel's dW lands on the embedding's parameter and adds to the embedding's own
  gradient, as in HF.
- Attention stays HF's: the implementation the config selects (``eager``, ``sdpa``, flash) with
  the module's own scaling (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), the
  eager path's ``reorder_and_upcast_attn``, ``attn_pdrop`` in training, and the KV cache.

**Weights.**  GPT-2's projections are ``Conv1D``s, which keep the weight (in, out); the kernels
take nn.Linear's (out, in).  The patched forwards pass ``weight.t()``, a transposed *view* of the
same Parameter, and the patch stores each weight the kernels read column-major (``.data`` becomes
an (in, out) tensor whose columns are contiguous: the same shape, values and Parameter object).
The kernels write a weight's gradient as nn.Linear's (out, in) rows, which autograd carries back
through the view as an (in, out) tensor with the Parameter's own strides, so it lands in ``.grad``
as it is.  Over a row-major weight, autograd would copy every weight gradient of every step into
the Parameter's layout (24 copy kernels, 1.3 ms of a 6-layer GPT-2 XL step on the H200:
BENCHMARKS run 23).
``state_dict``, ``save_pretrained`` (values and shapes), the head's tie to the embedding and an
optimizer built before the patch all see the same Parameters; patch before the optimizer's first
step, whose moments take the weights' layout then.  FSDP2 (``fully_shard``) shards contiguous
parameters only: for a model it will shard, patch with ``column_major_weights=False``, which
keeps the weights row-major (an all-gathered weight is row-major anyway) and pays the gradient
copy.

``kernels={"mlp_block": "runs/...", ...}`` swaps a slot's expert (``ln_qkv``,
``out_proj_residual``, ``mlp_block``, ``lm_head_xent``, ``lm_head_xent_frozen``) for an
accepted program of that task or of one with its contract (``dropin.py``).  The ``mlp_block``
slot's task is ``mlp_block_tanh`` for a tanh-GELU model; a kernel of the other GELU's task is
refused by name, and one of another task with the same contract must compute this model's GELU
(its contract cannot say).

**Refused** (a :class:`KernelError` naming what differs and the fix), since the patched block
would otherwise train something other than the model:

- a model that is not GPT-2's code: GPT-Neo, GPT-J, OPT, BLOOM, a LLaMA (``apply_to_llama``), a
  GPT-NeoX (``apply_to_gpt_neox``), a GPT-2 variant whose block, attention or MLP computes
  something else (compared as code, ``families.same_code``), a head other than the causal LM's
  (patch ``model.transformer``);
- GPTBigCode (SantaCoder, StarCoder): its multi-query ``c_attn`` is (H + 2 * head_dim, H), while
  the ln_qkv task declares (3H, H);
- cross-attention (``add_cross_attention``), which the patched block does not run;
- residual dropout (``resid_pdrop > 0``, GPT-2's config defaults to 0.1): the residual adds sit
  in GEMM epilogues, with no dropout (``embd_pdrop`` and ``attn_pdrop`` stay HF's and are fine);
- an activation that is neither GELU (``mlp=False`` keeps HF's MLP);
- projections that are not plain ``Conv1D`` (a quantized weight; peft's LoRA runs beside the
  kernels, ``adapters.py``, but not in the MLP block kernel: ``mlp=False``), LayerNorms
  without their affine weight and bias, an LM head with a bias;
- a vocabulary that is not a multiple of 8 (GPT-2's 50257) with the fused loss: the logits
  chunk's rows must be 16 bytes apart (pad it as nanoGPT does, to 50304);
- parameters that are not bf16, a model wrapped by torch.compile, a model already patched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import (GPT2MLP, GPT2Attention, GPT2Block, GPT2LMHeadModel, GPT2Model,
                                                    eager_attention_forward)
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeBlock
from transformers.pytorch_utils import Conv1D
from transformers.utils import can_return_tuple

from .adapters import adapted, peft_base, require_projection
from .dropin import (GPT2_SLOTS, GPT2_STACK, NO_DROP_IN, BlockPlan, PatchedForward, block_plan, check_lm_head,
                     check_slots, gelu_of, record_attention, refusal_hint, refuse_patched, refuse_wrapped,
                     require_children, require_code, require_kernel_dtypes, require_layer_norm, xent_kernels)
from .families import same_code
from .fused_weights import column_major
from .kernel import Kernel, KernelError
from .llama_ops import fused_lm_forward

SWAPPABLE = GPT2_SLOTS

_CHILDREN = {"block": frozenset({"ln_1", "attn", "ln_2", "mlp"}),
             "attn": frozenset({"c_attn", "c_proj", "attn_dropout", "resid_dropout"}),
             "mlp": frozenset({"c_fc", "c_proj", "act", "dropout"})}


def apply_to_gpt2(model: GPT2LMHeadModel | GPT2Model, *, layer_norm: bool = True, mlp: bool = True,
                  fused_linear_cross_entropy: bool = True, column_major_weights: bool = True,
                  kernels: dict[str, Kernel | str | Path] | None = None) -> GPT2LMHeadModel | GPT2Model:
    """Patch ``model`` in place (see the module docstring) and return it.  ``column_major_weights``:
    store the projections' weights column-major (no gradient copy a step); False for a model
    that FSDP2 will shard."""
    given_model, model = model, peft_base(model)  # a PeftModel: its transformers model is patched
    refuse_patched(getattr(model, "transformer", model))
    if mlp and not layer_norm:
        raise KernelError("mlp=True runs ln_2, the MLP and the residual add as one kernel (mlp_block), so it "
                          "needs layer_norm=True")
    base, causal_lm = gpt2_architecture(model, keep_mlp=not mlp)
    xent = fused_linear_cross_entropy and causal_lm
    gelu = check_gpt2(model, base, mlp, xent)  # names the fix
    check_slots(kernels, SWAPPABLE)
    given = kernels or {}
    plan = block_plan(layer_norm, mlp, gelu, given)
    for block in base.h:
        block.coda_plan = plan
        block.forward = PatchedForward(block, _block_forward)
        convs = (*((block.attn.c_attn,) if layer_norm else ()), block.attn.c_proj,
                 *((block.mlp.c_fc, block.mlp.c_proj) if mlp else ()))
        for conv in convs if column_major_weights else ():
            column_major(conv.weight)
    if xent:
        model.coda_xent, model.coda_xent_frozen = xent_kernels(given)
        model.forward = PatchedForward(model, _lm_forward)
    base.coda_flags = {"layer_norm": layer_norm, "mlp": mlp, "gelu": gelu,
                       "fused_linear_cross_entropy": fused_linear_cross_entropy}
    return given_model


# --------------------------------------------------------------------------- which models


def gpt2_architecture(model: nn.Module, keep_mlp: bool = False) -> tuple[nn.Module, bool]:
    """(the decoder stack, whether ``model`` is its causal LM) for a model whose every module the
    patch replaces computes what GPT-2's does (compared as code, ``families.same_code``);
    ``keep_mlp`` (``mlp=False``): the MLPs stay HF's, so they may be anything a block calls as
    ``mlp``.  Anything else is refused by what differs."""
    refuse_wrapped(model, "apply_to_gpt2")
    causal_lm = isinstance(getattr(model, "transformer", None), nn.Module) and hasattr(model, "lm_head")
    base = model.transformer if causal_lm else model

    def missing(m: Any) -> list[str]:
        return [a for a in GPT2_STACK if not isinstance(getattr(m, a, None), nn.Module)]

    if missing(base):
        inner = getattr(model, "transformer", None)
        head = ("; its head is not a causal LM's lm_head: patch its decoder stack, apply_to_gpt2(model.transformer), "
                "and the head stays HF's") if isinstance(inner, nn.Module) and not missing(inner) else ""
        hint = refusal_hint(model, "apply_to_gpt2", head, f"; its decoder stack has no {', '.join(missing(base))} "
                            f"(GPT-2's {', '.join(GPT2_STACK)}){NO_DROP_IN}")
        raise KernelError(f"apply_to_gpt2 patches a transformers GPT2LMHeadModel or GPT2Model; got "
                          f"{type(model).__name__}{hint}")
    name = type(model).__name__
    for i, block in enumerate(base.h):
        if same_code(type(block).forward, GPTBigCodeBlock.forward):
            if getattr(block.attn, "multi_query", True):
                raise KernelError(f"{name} is GPTBigCode (SantaCoder, StarCoder): its multi-query c_attn is "
                                  "(H + 2 * head_dim, H), and the ln_qkv kernel's task declares (3H, H) for GPT-2's "
                                  f"q, k and v of equal widths{NO_DROP_IN}")
            raise KernelError(f"{name} is GPTBigCode with multi_query=False: GPT-2's widths, but its own attention "
                              f"and nn.Linear projections, which apply_to_gpt2 does not read{NO_DROP_IN}")
        if hasattr(block, "crossattention"):
            raise KernelError(f"h.{i} has cross-attention (add_cross_attention=True), which the patched block does "
                              "not run; build the model without it")
        for what, module, want in (("block", block, GPT2Block.forward),
                                   ("attention", getattr(block, "attn", None), GPT2Attention.forward),
                                   *(() if keep_mlp else (("MLP", getattr(block, "mlp", None), GPT2MLP.forward),))):
            require_code(module, want, what, "GPT-2", name, "apply_to_gpt2")
        for part, want in _CHILDREN.items():
            if part == "mlp" and keep_mlp:
                continue
            require_children(block if part == "block" else getattr(block, part), want, f"h.{i}", "GPT-2", part,
                             "block")
        mlps = () if keep_mlp else (("mlp", "c_fc"), ("mlp", "c_proj"))
        for part, proj in (("attn", "c_attn"), ("attn", "c_proj"), *mlps):
            require_projection(getattr(getattr(block, part), proj), f"h.{i}.{part}.{proj}", Conv1D,
                               "GPT-2's Conv1D with a bias", "mlp" if part == "mlp" else "", bias=True)
        for norm in ("ln_1", *(() if keep_mlp else ("ln_2",))):
            require_layer_norm(getattr(block, norm), f"h.{i}.{norm}")
    if causal_lm and not same_code(type(model).forward, GPT2LMHeadModel.forward):
        raise KernelError(f"{name}.forward is not GPT2LMHeadModel's (its head computes something else); patch its "
                          "decoder stack, apply_to_gpt2(model.transformer), and the head stays HF's")
    return base, causal_lm


def check_gpt2(model: nn.Module, base: nn.Module, mlp: bool, xent: bool) -> str | None:
    """Refuse, naming the fix, what a GPT-2 model may hold that the kernels the flags choose do not
    take (see the module docstring); return the GELU the MLP kernel must compute (None: mlp=False)."""
    require_kernel_dtypes(model, "apply_to_gpt2")
    cfg = base.config
    gelu = None
    for i, block in enumerate(base.h):
        drops = [("attn.resid_dropout", block.attn.resid_dropout.p), *((("mlp.dropout", block.mlp.dropout.p),)
                                                                        if mlp else ())]
        for what, p in drops:
            if p > 0:
                raise KernelError(f"h.{i}.{what} drops with p = {p} (resid_pdrop; GPT-2's config defaults to 0.1): "
                                  "the patched block adds each residual inside a GEMM epilogue, with no dropout; "
                                  "build the model with resid_pdrop=0.0 (from_pretrained(..., resid_pdrop=0.0))")
        if mlp:
            gelu = gelu_of(block.mlp.act, f"h.{i}.mlp.act", f"activation_function {cfg.activation_function!r}",
                           "apply_to_gpt2", "blocks", gelu)
    head = getattr(model, "lm_head", None) if xent else None
    if head is not None:
        check_lm_head(head)
    return gelu


# --------------------------------------------------------------------------- forwards


def _block_forward(self: GPT2Block, hidden_states: torch.Tensor, past_key_values: Any = None,
                   attention_mask: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                   encoder_attention_mask: torch.Tensor | None = None, use_cache: bool | None = False,
                   **kwargs: Any) -> torch.Tensor:
    """GPT2Block.forward with the non-attention work in the suite's kernels."""
    if encoder_hidden_states is not None:
        raise KernelError("encoder_hidden_states: the patched GPT-2 block has no cross-attention")
    plan: BlockPlan = self.coda_plan
    attn = self.attn
    b, t, dim = hidden_states.shape
    h = hidden_states.reshape(b * t, dim)
    # Conv1D keeps its weight (in, out): .t() is the (out, in) view the kernels take, of the same Parameter.
    if plan.layer_norm:
        qkv = plan.ln_qkv(h, self.ln_1.weight, self.ln_1.bias, attn.c_attn.weight.t(), attn.c_attn.bias,
                          eps=self.ln_1.eps)["qkv"]
        qkv = adapted(qkv, attn.c_attn, lambda: self.ln_1(h))  # LoRA's term, on the projection's input
    else:  # HF's LayerNorm and projection (peft's own LoRA forward, where it has one)
        qkv = attn.c_attn(self.ln_1(h))
    q, k, v = (part.view(b, t, -1, attn.head_dim).transpose(1, 2) for part in qkv.split(dim, dim=1))
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx)
    implementation = attn.config._attn_implementation
    if implementation == "eager" and attn.reorder_and_upcast_attn:
        out, weights = attn._upcast_and_reordered_attn(q, k, v, attention_mask)
    else:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        out, weights = interface(attn, q, k, v, attention_mask,
                                 dropout=attn.attn_dropout.p if attn.training else 0.0, scaling=attn.scaling, **kwargs)
    record_attention(weights)
    out = out.reshape(b * t, dim)
    h1 = plan.out_proj(out, adapted(h, attn.c_proj, lambda: out), attn.c_proj.weight.t(), attn.c_proj.bias)["h"]
    if plan.mlp:
        mlp = self.mlp
        h2 = plan.mlp_block(h1, self.ln_2.weight, self.ln_2.bias, mlp.c_fc.weight.t(), mlp.c_fc.bias,
                            mlp.c_proj.weight.t(), mlp.c_proj.bias, eps=self.ln_2.eps)["y"]
    else:  # HF's MLP, on (batch, tokens, hidden) as HF calls it
        h1 = h1.view(b, t, dim)
        h2 = h1 + self.mlp(self.ln_2(h1))
    return h2.view(b, t, dim)


@can_return_tuple
def _lm_forward(self: GPT2LMHeadModel, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs: Any) -> CausalLMOutputWithCrossAttentions:
    """GPT2LMHeadModel.forward; in training with labels, the tied LM head + loss is the fused kernel."""
    inputs = dict(past_key_values=past_key_values, attention_mask=attention_mask, token_type_ids=token_type_ids,
                  position_ids=position_ids, inputs_embeds=inputs_embeds, encoder_hidden_states=encoder_hidden_states,
                  encoder_attention_mask=encoder_attention_mask, use_cache=use_cache)
    return fused_lm_forward(self, self.transformer, CausalLMOutputWithCrossAttentions, input_ids, inputs, labels,
                            logits_to_keep, kwargs)
