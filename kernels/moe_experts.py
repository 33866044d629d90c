"""A mixture of experts' experts, kept as 3-D weights, each expert run as the gated MLP kernel of
its activation (``swiglu_mlp``, ``geglu_mlp``), in ``apply_to_model`` and, with ``swiglu=False``,
in ``apply_to_llama``.

transformers keeps the experts of Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE,
Granite-MoE, Jamba, MiniMax, Phi-MoE and some forty more in one module: ``gate_up_proj`` (E, 2I, H)
with each expert's gate rows then its up rows, ``down_proj`` (E, H, I), and a forward that, for
every expert some token was routed to, gathers those tokens, runs ``down(act(gate(x)) * up(x))``,
scales each row by its routing weight and adds it back into the output (``index_add_``).  A module
qualifies by that forward's code: Mixtral's, which the others copy (``families.same_code`` on the
function that ``use_experts_implementation`` wraps), with a gate, without biases and untransposed
(the flags that decorator keeps), and a SiLU or GELU's tanh form (probed by value).  The router and
a shared expert stay where they are (a shared expert of LLaMA's MLP code is ``gated_mlps``').

The patch interleaves each expert's gate and up rows once, in place, as the kernels read them
(``fused_weights.reorder``: the state dict keeps HF's layout and key, loading included), and the
forward then computes what HF's does with the kernel in place of the three linears and the
activation: the same experts in the same order, the same rows gathered in the same order (so the
``index_add_`` sums in HF's order), and the routing weight applied after, in bf16 as HF does.  Each
expert's call is one autograd node over that expert's slice of the two weights, whose gradients
accumulate into the 3-D Parameters as HF's slices do.  The loop over experts is HF's too, so
``torch.compile`` breaks the graph where it breaks HF's (the experts that were hit are data).
"""

from __future__ import annotations

from typing import Collection

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from .adapters import wrapped_by_peft
from .dropin import PatchedForward, check_mlp_widths, gelu_form
from .families import same_code
from .fused_weights import expert_halves, interleave_expert_halves, reorder
from .gated_mlps import SILU
from .kernel import Kernel, KernelError

CODE = MixtralExperts.forward.__wrapped__  # the forward use_experts_implementation wraps


def recognised(module: nn.Module) -> tuple[bool, str | None, str]:
    """(whether ``module`` is experts of Mixtral's code, the task of the kernel that runs each
    expert, why there is none)."""
    fn = getattr(getattr(type(module), "forward", None), "__wrapped__", None)
    if fn is None or not same_code(fn, CODE):
        return False, None, ""
    name = type(module).__name__
    if parametrize.is_parametrized(module):  # peft's LoRA on the experts' parameters (target_parameters)
        return True, None, f"{name}'s weights are parametrized (LoRA on them): its experts stay HF's"
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3
            and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]):
        return True, None, f"{name}'s weights are not (E, 2I, H) gate/up and (E, H, I) down"
    layout = {k: getattr(module, k, v) for k, v in (("has_gate", True), ("has_bias", False),
                                                    ("is_transposed", False), ("is_concatenated", True))}
    if layout != {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}:
        return True, None, f"{name} keeps its experts as {layout}, not gated, bias-free, (out, in) and in halves"
    act = getattr(module, "act_fn", None)
    if isinstance(act, SILU):
        return True, "swiglu_mlp", ""
    if isinstance(act, nn.Module) and gelu_form(act) == "tanh":
        return True, "geglu_mlp", ""
    return True, None, f"{name}'s experts apply {type(act).__name__}, neither SiLU nor GELU's tanh form"


def check(module: nn.Module, where: str, task: str, flag: str = "mlp=False", adapted: Collection[int] = ()
          ) -> None:
    """Refuse, naming ``flag`` as the way to keep HF's experts, experts under LoRA (``adapted``:
    the ids of the modules a peft layer wraps, ``adapters.wrapped_by_peft``), widths no GEMM takes
    or weights frozen apart."""
    if id(module) in adapted:
        raise KernelError(f"{where} has LoRA adapters on its weights (peft's target_parameters), and the {task} "
                          f"kernel reads the weights itself; pass {flag} to keep HF's experts (the adapters train "
                          "there)")
    if module.gate_up_proj.requires_grad != module.down_proj.requires_grad:
        raise KernelError(f"{where}: gate_up_proj and down_proj differ in requires_grad; the {task} kernel "
                          f"trains or freezes an expert's weights together: set both, or pass {flag}")
    check_mlp_widths(where, module.down_proj.shape[1], module.down_proj.shape[2], flag)


def patch(module: nn.Module, site: None, task: str, kernel: Kernel) -> None:
    """Patch experts that :func:`recognised` took (``site``: none, their layout is fixed)."""
    reorder(module, "gate_up_proj", interleave_expert_halves, expert_halves)
    module.coda_mlp = kernel
    module.coda_flags = {task: True}
    module.forward = PatchedForward(module, _forward)


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward (Mixtral's code) with each expert's MLP as the kernel."""
    out = torch.zeros_like(hidden_states)
    experts = self.gate_up_proj.shape[0]
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for (e,) in hit.tolist():
        pos, token = torch.where(mask[e])
        x = hidden_states[token].contiguous()
        y = self.coda_mlp(x, self.gate_up_proj[e], self.down_proj[e])["y"]
        out.index_add_(0, token, (y * top_k_weights[token, pos, None]).to(out.dtype))
    return out


def find(layers: nn.ModuleList, prefix: str, flag: str) -> dict[str, tuple[nn.Module, str]]:
    """{name: (experts, the task of their kernel)} for every experts module in ``layers`` that a
    kernel runs, named ``<prefix>.<i>.<path>``; each checked first (:func:`check`, naming ``flag``)."""
    found = {}
    adapted = wrapped_by_peft(layers)
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            is_experts, task, _ = recognised(module)
            if is_experts and task is not None:
                where = f"{prefix}.{i}.{name}"
                check(module, where, task, flag, adapted)
                found[where] = (module, task)
    return found
