"""LoRA adapters (peft) on the projections a drop-in fuses.

peft's LoRA wraps a projection ``base`` as ``base(x) + sum_a B_a(A_a(dropout_a(x))) * s_a`` over
its active adapters, with the base weight usually frozen.  A drop-in keeps that split: the base
weight goes into its kernels as an unadapted projection's does (fused with its siblings, a norm
folded in), and the adapters' low-rank term runs in PyTorch on the projection's input and joins
the kernel's output where the projection's own output would: added to q, k and v (rotated
first where RoPE sits in the kernel's epilogue: RoPE is linear), or to the residual that the
output projection's epilogue adds.  The rank-r GEMMs cost little next to the fused ones; where
the kernel folds the projection's norm, the norm is computed once more for the adapters.

The LoRA module stays where peft put it, with its adapters, dropouts and scalings, so peft's
``save_pretrained`` (the adapter's weights), ``set_adapter``, ``disable_adapter`` and
``print_trainable_parameters`` work on the patched model; only its ``base_layer`` becomes the
fused weight's part (``fused_weights.FusedPart``).  What the split cannot follow is refused with the fix:
adapter variants other than plain LoRA (DoRA, ...), adapters merged into the weights (merge on
an unpatched model: load the base model, then the adapter), adapters on a part whose whole
computation a kernel owns (the SwiGLU MLP block, the fused LM head and loss), and peft's
per-sample adapters (``adapter_names``, which ride on forward hooks of the LoRA layers that the
patched layers do not call).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .kernel import KernelError


def lora_of(m: Any) -> nn.Module | None:
    """``m`` where it is peft's LoRA layer over a linear projection, else None (its base is an
    ``nn.Linear`` before the patch, the fused weight's part after)."""
    if "peft" not in sys.modules:  # no LoRA layer can exist without peft imported
        return None
    from peft.tuners.lora import Linear as LoraLinear

    return m if isinstance(m, LoraLinear) else None


def linear_of(m: Any) -> Any:
    """The ``nn.Linear`` a kernel reads for projection ``m``: ``m``, or its LoRA layer's base."""
    lora = lora_of(m)
    return m if lora is None else lora.get_base_layer()


def base_path(module: nn.Module, name: str) -> str:
    """Where the weight of ``module.<name>`` lives: ``name``, or ``name.base_layer`` under LoRA."""
    return name if lora_of(getattr(module, name, None)) is None else f"{name}.base_layer"


def check_lora(m: Any, where: str, owner: str = "") -> None:
    """Refuse, with the fix, a LoRA layer the drop-in cannot split into kernel + adapters;
    ``owner``: the kernel that runs this projection whole (its flag names the fix)."""
    lora = lora_of(m)
    if lora is None:
        return
    if owner:
        raise KernelError(f"{where} has LoRA adapters ({', '.join(lora.lora_A)}), and {owner}; keep that part "
                          "HF's and peft's with the flag, and the adapters train there")
    variants = sorted(getattr(lora, "lora_variant", {}) or {})
    if variants:
        raise KernelError(f"{where}: adapter(s) {variants} are a LoRA variant (DoRA or another), which the drop-in "
                          "does not split from the fused weight; use plain LoRA (use_dora=False) or patch without "
                          "this adapter")
    if lora.merged:
        raise KernelError(f"{where}: adapters {lora.merged_adapters} are merged into the base weight; unmerge them "
                          "(model.unmerge_adapter()) before patching, or merge_and_unload() and patch the result")


def require_projection(m: Any, where: str, cls: type, what: str, mlp_flag: str = "", bias: bool = False) -> None:
    """Refuse, with the fix, a projection whose weights a kernel reads but cannot: a LoRA layer
    inside the MLP block kernel (``mlp_flag``: the drop-in's flag that keeps the MLP HF's, where
    this projection is the MLP's), or a module that is not ``cls`` (``what``), with a bias where
    ``bias``, under any LoRA layer."""
    check_lora(m, where, f"the MLP block kernel runs the whole MLP ({mlp_flag}=True): pass {mlp_flag}=False"
               if mlp_flag else "")
    if type(linear_of(m)) is not cls or (bias and m.bias is None):
        raise KernelError(f"{where} is {type(m).__name__}, not {what}: the kernels read its weight and bias, which "
                          "would drop what the module adds (a quantized weight, an adapter other than peft's LoRA); "
                          "patch the unwrapped bf16 model, or merge such adapters into the weights first")


def lora_delta(m: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The active adapters' term of projection ``m`` on its input ``x`` (None: no LoRA layer, or
    none active), computed as peft's ``lora.Linear.forward`` adds it, in the adapters' dtype
    (fp32 adapters on a bf16 model: add it with :func:`plus`, which rounds the sum once, as peft
    does)."""
    lora = lora_of(m)
    if lora is None or lora.disable_adapters:
        return None
    if lora._forward_pre_hooks:  # peft's per-sample adapters (adapter_names) ride on pre-hooks
        raise KernelError("a forward pre-hook is on a LoRA layer the patched model runs without calling it "
                          "(peft's adapter_names, per-sample adapters, registers one); call the model without "
                          "adapter_names, or use an unpatched model for mixed-adapter batches")
    if lora.merged:  # peft merges into base_layer.weight, a read-only copy of the fused weight's rows
        raise KernelError("a LoRA adapter was merged after apply_to_*: the fused weight does not hold the merge; "
                          "unmerge it (model.unmerge_adapter()), or merge on an unpatched model")
    if getattr(lora, "lora_variant", None):
        check_lora(lora, type(lora).__name__)
    total = None
    for name in lora.active_adapters:
        if name not in lora.lora_A:
            continue
        a, b = lora.lora_A[name], lora.lora_B[name]
        # peft casts the input to the adapter's dtype (where its cast_input_dtype_enabled says so;
        # releases before that flag always cast)
        cast = getattr(lora, "_cast_input_dtype", None)
        xa = cast(x, a.weight.dtype) if cast is not None else x.to(a.weight.dtype)
        term = b(a(lora.lora_dropout[name](xa))) * lora.scaling[name]
        total = term if total is None else total + term
    return total


def plus(y: torch.Tensor, term: torch.Tensor | None) -> torch.Tensor:
    """``y + term`` in ``y``'s dtype, rounded once (``term`` may be wider: fp32 adapters)."""
    if term is None:
        return y
    return y + term if term.dtype == y.dtype else (y.float() + term.float()).to(y.dtype)


def adapted(y: torch.Tensor, m: Any, x: Any) -> torch.Tensor:
    """``y`` (what a kernel computed for projection ``m``, or the residual its epilogue adds) plus
    ``m``'s LoRA term on the input ``x()``, which is computed only where ``m`` has adapters."""
    return y if lora_of(m) is None else plus(y, lora_delta(m, x()))


def adapter_modules(root: nn.Module) -> set[int]:
    """The ids of the modules under ``root`` that hold LoRA adapters' own parameters: no kernel
    reads them, so they keep the dtype peft gave them (fp32 adapters on a bf16 model, by default)."""
    found: set[int] = set()
    for m in root.modules():
        if lora_of(m) is not None:
            for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
                holder = getattr(m, part, None)
                if isinstance(holder, nn.Module):
                    found.update(id(x) for x in holder.modules())
    return found


def wrapped_by_peft(root: nn.Module) -> set[int]:
    """The ids of the modules under ``root`` that a peft tuner layer wraps (its ``base_layer`` and
    everything in it): LoRA on a module's parameters themselves (``target_parameters``) registers
    a parametrization on the wrapped module for each forward, which a kernel reading the weights
    would bypass."""
    if "peft" not in sys.modules:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: set[int] = set()
    for m in root.modules():
        base = getattr(m, "base_layer", None) if isinstance(m, BaseTunerLayer) else None
        if isinstance(base, nn.Module):
            found.update(id(x) for x in base.modules())
    return found


def peft_base(model: Any) -> Any:
    """The transformers model inside a peft ``PeftModel`` (``get_peft_model``), else ``model``."""
    if "peft" in sys.modules:
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.get_base_model()
    return model
