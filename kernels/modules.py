"""``apply_to_model``: the suite's kernels in whichever modules of a transformers model compute what
a kernel computes, for models that no drop-in of whole layers takes.

``apply_to_llama``, ``apply_to_gpt2`` and ``apply_to_gpt_neox`` replace whole decoder layers, so
they fold the norms, RoPE and the residual adds into the GEMMs too; they refuse a model whose
layers differ from their family's anywhere (OLMo-2's post-norms, Cohere's parallel block and
LayerNorm, StableLM's partial LayerNorms, a hybrid's linear-attention layers).  Such a model's
MLPs and LM head are often LLaMA's code all the same.  ``apply_to_model`` recognises those modules
one by one, by their code (``families.same_code``) as the layer drop-ins recognise layers:

- **Gated MLPs** (``down(act(gate(x)) * up(x))``: LLaMA's code, Phi-3's, or any forward of that
  shape, Llama 4's) run as the kernel of their activation, ``swiglu_mlp`` (SiLU) or ``geglu_mlp``
  (GELU's tanh form), gate and up fused once (``gated_mlps``).  Where the module sits does not
  matter: a post-norm block's MLP, a mixture of experts' shared expert, every layer of a hybrid.
- **A mixture of experts' experts**, kept as 3-D weights with Mixtral's forward (some fifty
  families copy it: OLMoE, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, Granite-MoE, Jamba, MiniMax ...),
  run each expert as the same kernels on its slice of the weights (``moe_experts``); the router
  stays HF's.
- **A linear and the activation applied to it at once** in a module's code (``act(fc(x))``: the
  first half of BERT's MLP and of the encoders that copy it, OPT's, BioGPT's, XGLM's and BART's
  layers, which run their MLP inline) run as the GPT-2 suite's ``linear_gelu``,
  ``linear_gelu_tanh`` or ``linear_relu`` (``linear_acts``, which finds the site in the code); the
  second linear, with its residual add and norm, stays HF's.
- **MLPs without a gate** (``proj(act(fc(x)))`` with biases: GPT-Neo's, GPT-J's, Phi's, Falcon's,
  GPT-BigCode's, StarCoder-2's, GPT-NeoX's, Nemotron's, BLOOM's and MPT's code, the last two adding
  the residual they are given after the kernel; any forward of that shape, nanoGPT's; an
  ``nn.Sequential`` of Linear, activation, Linear, CTRL's) run as the GPT-2 suite's ``gelu_mlp``,
  ``gelu_tanh_mlp``, ``relu_mlp`` or ``relu2_mlp``, the activation probed by value
  (``plain_mlps``).  A whole MLP goes before the linear-and-activation rule, which would run its
  first half alone.
- **The LM head and loss**: where the causal LM's forward is LLaMA's, Granite's or Mixtral's code
  (``families.CAUSAL_LMS``) and its loss is HF's causal-LM loss, training with labels runs the
  fused LM head + cross-entropy (``lm_head_xent``; no full logits, ``logits`` is None, as with
  Liger), as ``apply_to_llama``'s does.  Gemma-2's code (Gemma-3's, Gemma-3n's, VaultGemma's,
  NanoChat's) and Gemma-4's soft-cap the logits by ``final_logit_softcapping``, which
  ``lm_head_xent_softcap`` takes as its ``cap`` (``lm_head_xent`` where the config sets none).  A
  causal LM's forward of other code (OPT's, Falcon's, Cohere's, Mamba's: 37 more model types in the
  coverage sweep) keeps running as it is where the head probe (``causal_heads``) finds that it hands
  the head's logits to HF's loss with only a cast or a scale between: the head then passes its input
  on, and the loss runs the fused kernel over it.  A forward that bends the logits otherwise keeps HF's head.

Everything else stays HF's (attention, norms, embeddings), and torch.compile compiles it around the
kernels' custom ops.  What was patched is ``model.coda_flags`` (the MLPs by name, under their
kernel's task); each patched MLP holds ``coda_flags`` too, so no drop-in patches it again.  A
module of a recognised kind that holds what its kernel does not take (biases, LoRA adapters, gate
and up frozen apart) is refused with the flag that keeps it HF's; a model with nothing to patch is
refused, naming what was looked for and what its modules are instead.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.gemma2.modeling_gemma2 import Gemma2ForCausalLM
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedForCausalLM

from coda_agent.tasks import SUITE_DIR

from . import causal_heads, gated_mlps, linear_acts, moe_experts, plain_mlps
from .adapters import peft_base, wrapped_by_peft
from .dropin import (GPT2_SUITE, NO_KERNEL, STACKS, check_lm_head, check_slots, refusal_by, refuse_patched,
                     refuse_wrapped, require_kernel_dtypes, slot_kernel, suite_kernel)
from .families import CAUSAL_LMS, same_code
from .kernel import Kernel, KernelError

MLP_TASKS = (*gated_mlps.TASKS, *moe_experts.TASKS, *plain_mlps.TASKS.values(), *linear_acts.TASKS.values())
GPT2_TASKS = (*plain_mlps.TASKS.values(), *linear_acts.TASKS.values())  # the slots the GPT-2 suite's kernels fill
SLOTS = (*MLP_TASKS, "lm_head_xent", "lm_head_xent_frozen", "lm_head_xent_softcap", "lm_head_xent_softcap_frozen")
# Causal LMs whose forward soft-caps the logits (config.final_logit_softcapping, where set) before
# HF's loss.  Gemma-4's forwards also pass the model its per-layer inputs and return the shared KV
# states, in their own output class (``llama.patch_causal_lm`` keeps both).
SOFTCAP_LMS = {"Gemma-2's": Gemma2ForCausalLM.forward, "Gemma-4's": Gemma4ForCausalLM.forward,
               "Gemma-4 Unified's": Gemma4UnifiedForCausalLM.forward}
PROBED = "a probed"  # a causal LM of other code whose head and loss ``causal_heads.probe`` found


def apply_to_model(model: nn.Module, *, mlp: bool = True, fused_linear_cross_entropy: bool = True,
                   kernels: dict[str, Kernel | str | Path] | None = None) -> nn.Module:
    """Patch ``model`` in place (see the module docstring) and return it.  ``mlp``: the MLPs,
    gated or not; ``fused_linear_cross_entropy``: the LM head and loss; ``kernels``: an accepted
    program for a slot (:data:`SLOTS`) instead of the suite's."""
    given_model, model = model, peft_base(model)
    refuse_wrapped(model, "apply_to_model")
    refuse_patched(model)
    require_kernel_dtypes(model, "apply_to_model")
    check_slots(kernels, SLOTS)
    mlps, passed = _mlps(model) if mlp else ({}, [])
    head, head_why = _causal_lm(model) if fused_linear_cross_entropy else (None, "")
    if not mlps and head is None:
        looked = [what for what, on in (("MLPs", mlp), ("the LM head and loss", fused_linear_cross_entropy))
                  if on]
        why = "; ".join(passed + ([head_why] if head_why else []))
        raise KernelError(f"apply_to_model found none of {' or '.join(looked) or 'nothing (every flag is off)'} in "
                          f"{type(model).__name__} that the suite's kernels compute{f' ({why})' if why else ''}"
                          f"{NO_KERNEL}")
    whole = next((patch for _, _, _, patch in STACKS if refusal_by(patch, model) is None), None)
    if whole is not None:
        warnings.warn(f"coda_agent.{whole}(model) takes this model and also folds its norms, RoPE and residual "
                      "adds into the GEMMs; apply_to_model patches its MLPs and LM head only", stacklevel=2)
    cap = getattr(model.config, "final_logit_softcapping", None) if head in SOFTCAP_LMS else None
    xent = "lm_head_xent" if cap is None else "lm_head_xent_softcap"
    used = {task for _, _, task, _ in mlps.values()} | ({xent, f"{xent}_frozen"} if head is not None else set())
    # The suite's kernel of each slot this model uses (a program parsed per slot); a given one is
    # checked against its slot's task whether or not the model uses it.
    chosen = {name: slot_kernel(name, (kernels or {}).get(name), suite_kernel(
        name, GPT2_SUITE if name in GPT2_TASKS else SUITE_DIR))
        for name in SLOTS if name in used or name in (kernels or {})}
    for name, (module, site, task, family) in mlps.items():
        family.patch(module, site, task, chosen[task])
    if head == PROBED:
        causal_heads.patch(model, chosen[xent], chosen[f"{xent}_frozen"])
    elif head is not None:
        from .llama import patch_causal_lm  # the LLaMA drop-in's patched causal LM, whose code this one is

        patch_causal_lm(model, head, chosen[xent], chosen[f"{xent}_frozen"], None if cap is None else float(cap))
    model.coda_flags = {**{task: sorted(n for n, (_, _, t, _) in mlps.items() if t == task) for task in MLP_TASKS},
                        "fused_linear_cross_entropy": head is not None}
    return given_model


# --------------------------------------------------------------------------- what qualifies


def _mlps(model: nn.Module) -> tuple[dict[str, tuple[nn.Module, Any, str, Any]], list[str]]:
    """({name: (module, its site, its kernel's task, its family's module)} for every MLP (or
    experts, or linear and activation) a kernel computes, the site as its family's patch reads it
    (a gated MLP's layout, a plain MLP's, a linear's and its activation's attributes), [why those
    of the kernels' codes that are not are passed by]); refuses, naming the fix, one that a kernel
    computes but that holds what the kernel does not take."""
    found: dict[str, tuple[nn.Module, Any, str, Any]] = {}
    passed: list[str] = []  # each reason once, three at most
    shared = linear_acts.shared_modules(model)
    adapted = wrapped_by_peft(model)
    for name, module in model.named_modules():
        where = name or type(module).__name__
        experts, task, why = moe_experts.recognised(module)
        if experts:  # a mixture's experts, 3-D weights
            if task is not None:
                moe_experts.check(module, where, task, adapted=adapted)
                found[name] = (module, None, task, moe_experts)
        elif (gated := gated_mlps.recognised(module))[0] is not None:  # a gated MLP
            kind, layout, task = gated
            if task is None:
                why = gated_mlps.why_not(module, kind, layout)
            else:
                gated_mlps.check(module, where, layout, task)
                found[name] = (module, layout, task, gated_mlps)
        else:  # an MLP without a gate, or a linear and its activation
            site, task, why = plain_mlps.recognised(module)
            if task is not None:
                plain_mlps.check(module, where, site, task)
                found[name] = (module, site, task, plain_mlps)
            elif site is None:
                sites, why = linear_acts.recognised(module, shared)
                for pair, task in sites:  # each goes by its linear's name: what runs as the kernel
                    linear_acts.check(module, where, pair, task)
                    found[".".join(filter(None, (name, pair[0])))] = (module, pair, task, linear_acts)
        if why and why not in passed and len(passed) < 3:
            passed.append(why)
    return found, passed


def _causal_lm(model: nn.Module) -> tuple[str | None, str]:
    """(whose causal LM ``model`` is: a key of ``CAUSAL_LMS`` or :data:`SOFTCAP_LMS`, or
    :data:`PROBED` for a forward of other code that passed ``causal_heads.probe``; None where its LM
    head and loss cannot run fused, and then why not)."""
    kind = next((k for k, fn in {**CAUSAL_LMS, **SOFTCAP_LMS}.items() if same_code(type(model).forward, fn)), None)
    if kind is None:  # a forward of other code: its head runs fused where the probe finds it, and the
        # kernel takes it (BERT's decoder has a bias: opportunistic here, so not refused, kept HF's)
        why = causal_heads.probe(model)
        if why is None:
            try:
                check_lm_head(model.get_output_embeddings())
                return PROBED, ""
            except KernelError as e:
                why = str(e).split(";")[0]
        return None, f"{type(model).__name__}.forward is not LLaMA's, Granite's, Mixtral's, Gemma-2's or " \
                     f"Gemma-4's causal LM code, and {why}"
    if not isinstance(getattr(model, "model", None), nn.Module):
        return None, f"{type(model).__name__} has no decoder stack as model.model"
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return None, f"its loss is {getattr(model, 'loss_type', None)!r}, not HF's causal-LM loss"
    check_lm_head(model.lm_head)  # names the fix for a head the fused kernel does not take
    return kind, ""
