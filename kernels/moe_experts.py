"""A mixture of experts' experts, kept as 3-D weights, each expert run as the gated MLP kernel of
its activation (``swiglu_mlp``, ``geglu_mlp``, ``swiglu_clamp_mlp``), in ``apply_to_model`` and,
with ``swiglu=False``, in ``apply_to_llama``.

transformers keeps the experts of Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE,
Granite-MoE, Jamba, MiniMax, Phi-MoE and some forty more in one module: ``gate_up_proj`` (E, 2I, H)
with each expert's gate rows then its up rows, ``down_proj`` (E, H, I), and a forward that, for
every expert some token was routed to, gathers those tokens, runs ``down(act(gate(x)) * up(x))``,
scales each row by its routing weight and adds it back into the output (``index_add_``).  Three
codes of that forward qualify (:data:`CODES`, ``families.same_code``, on the function that
``use_experts_implementation`` wraps where it does):

- Mixtral's, which the others copy, with a gate, without biases and untransposed (the flags that
  decorator keeps), and a SiLU or GELU's tanh form (probed by value): ``swiglu_mlp``, ``geglu_mlp``;
- DeepSeek-V4's, the same layout with the activation in a ``_apply_gate`` method (GLM-5, HY-V4,
  MiniMax-M3, Step-3.7 copy it), and GPT-OSS's, whose ``gate_up_proj`` is (E, H, 2I) with gate
  and up columns interleaved, ``down_proj`` (E, I, H), and biases: each runs as
  ``swiglu_clamp_mlp`` where its ``_apply_gate``, probed by value, is the clamped SwiGLU
  ``min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, -limit, limit) + offset)`` with the
  module's limit (and alpha, else 1), offset 0 or 1; another gate (Step-3.7 clamps after SiLU)
  is passed by, with why.

The router and a shared expert stay where they are (a shared expert of LLaMA's MLP code is
``gated_mlps``').

The patch lays each expert's weights out once, in place, as the kernels read them: halves'
gate and up rows interleaved (``fused_weights.reorder``: the state dict keeps HF's layout and key,
loading included); GPT-OSS's (E, H, N) weights stored with each expert's columns contiguous, so
that its transpose is the kernels' (N, H) row-major weight and autograd lands the gradients
without a copy (``fused_weights.column_major``; shape, values and key stay).  The forward then
computes what HF's does with the kernel in place of the linears and the activation: the same
experts in the same order, the same rows gathered in the same order (so the ``index_add_`` sums in
HF's order), and the routing weight applied after, in bf16 as HF does.  Each expert's call is one
autograd node over that expert's slice of the weights, whose gradients accumulate into the 3-D
Parameters as HF's slices do.  The loop over experts is HF's too, so ``torch.compile`` breaks the
graph where it breaks HF's (the experts that were hit are data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from .adapters import wrapped_by_peft
from .dropin import PatchedForward, check_mlp_widths, gelu_form
from .families import same_code
from .fused_weights import column_major, expert_halves, interleave_expert_halves, reorder
from .gated_mlps import CLAMP_TASK, SILU, clamp_params
from .kernel import Kernel, KernelError

TASKS = (CLAMP_TASK,)  # the task experts run as beside gated_mlps' (swiglu_mlp, geglu_mlp)
# the forward codes that qualify: the function use_experts_implementation wraps, where it does
CODES = {"mixtral": MixtralExperts.forward.__wrapped__, "gate_method": DeepseekV4Experts.forward.__wrapped__,
         "gpt_oss": GptOssExperts.forward}


@dataclass(frozen=True)
class Variant:
    """How a recognised experts module runs: its forward's code (a key of :data:`CODES`), the
    task of the kernel that runs each expert and that kernel's params (the clamped gate's)."""

    code: str
    task: str
    params: dict[str, float] = field(default_factory=dict)

    @property
    def columns(self) -> bool:
        """GPT-OSS's layout: (E, H, 2I) gate/up with interleaved columns, (E, I, H) down, biases."""
        return self.code == "gpt_oss"


def _code_of(module: nn.Module) -> str | None:
    forward = getattr(type(module), "forward", None)
    fn = getattr(forward, "__wrapped__", forward)
    return None if fn is None else next((k for k, want in CODES.items() if same_code(fn, want)), None)


def recognised(module: nn.Module) -> tuple[bool, str | None, str]:
    """(whether ``module`` is experts of a qualifying code, the task of the kernel that runs each
    expert, why there is none)."""
    variant, why = variant_of(module)
    return variant is not None or bool(why), None if variant is None else variant.task, why


def variant_of(module: nn.Module) -> tuple[Variant | None, str]:
    """(how experts of a qualifying code run, why they do not); (None, "") for any other module."""
    code = _code_of(module)
    if code is None:
        return None, ""
    name = type(module).__name__
    if parametrize.is_parametrized(module):  # peft's LoRA on the experts' parameters (target_parameters)
        return None, f"{name}'s weights are parametrized (LoRA on them): its experts stay HF's"
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3):
        return None, f"{name}'s gate_up_proj and down_proj are not 3-D Parameters"
    inter, hidden = (down.shape[1], down.shape[2]) if code == "gpt_oss" else (down.shape[2], down.shape[1])
    want = (down.shape[0], hidden, 2 * inter) if code == "gpt_oss" else (down.shape[0], 2 * inter, hidden)
    if tuple(gu.shape) != want:
        return None, f"{name}'s gate_up_proj is {tuple(gu.shape)}, not {want} beside down_proj {tuple(down.shape)}"
    if code == "gpt_oss":
        return _clamped(module, code, interleaved=True)
    layout = {k: getattr(module, k, v) for k, v in (("has_gate", True), ("has_bias", False),
                                                    ("is_transposed", False), ("is_concatenated", True))}
    if layout != {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}:
        return None, f"{name} keeps its experts as {layout}, not gated, bias-free, (out, in) and in halves"
    if code == "gate_method":
        return _clamped(module, code, interleaved=False)
    act = getattr(module, "act_fn", None)
    if isinstance(act, SILU):
        return Variant(code, "swiglu_mlp"), ""
    if isinstance(act, nn.Module) and gelu_form(act) == "tanh":
        return Variant(code, "geglu_mlp"), ""
    return None, f"{name}'s experts apply {type(act).__name__}, neither SiLU nor GELU's tanh form"


def _clamped(module: nn.Module, code: str, interleaved: bool) -> tuple[Variant | None, str]:
    """The clamped SwiGLU's params that the module's ``_apply_gate`` computes, probed by value in
    fp64 on both sides of its bounds (module docstring)."""
    name = type(module).__name__
    limit = next((getattr(module, k) for k in ("limit", "swiglu_limit") if hasattr(module, k)), None)
    alpha = next((getattr(module, k) for k in ("alpha", "swiglu_alpha") if hasattr(module, k)), 1.0)
    if clamp_params(limit, alpha, 0.0) is None:
        return None, f"{name} has no finite clamp limit (limit or swiglu_limit): not the clamped SwiGLU"
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.rand(32, 48, generator=gen, dtype=torch.float64) * 6.0 - 3.0) * limit
    g, u = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    try:
        with torch.no_grad():
            got = module._apply_gate(gate_up)
    except Exception as e:  # noqa: BLE001 - a gate that cannot run on a probe is no gate of ours
        return None, f"{name}._apply_gate failed on a probe ({type(e).__name__}: {e})"
    for offset in (0.0, 1.0):
        want = g * torch.sigmoid(g * alpha) * (u + offset)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-9,
                                                                                        atol=1e-12):
            return Variant(code, CLAMP_TASK, clamp_params(limit, alpha, offset)), ""
    return None, (f"{name}._apply_gate is not min(g, {limit}) * sigmoid({alpha} * min(g, {limit})) * "
                  f"(clamp(u, -{limit}, {limit}) + 0 or 1), the clamped SwiGLU its kernel computes")


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
    _, rows, cols = module.down_proj.shape  # (E, H, I); GPT-OSS's (E, I, H)
    check_mlp_widths(where, *((cols, rows) if _columns(module) else (rows, cols)), flag)


def _columns(module: nn.Module) -> bool:
    return _code_of(module) == "gpt_oss"


def patch(module: nn.Module, site: None, task: str, kernel: Kernel) -> None:
    """Patch experts that :func:`recognised` took (``site``: none, their layout is fixed)."""
    variant, why = variant_of(module)
    if variant is None or variant.task != task:
        raise KernelError(f"{type(module).__name__} does not run as {task}: {why or 'its gate is another'}")
    if variant.columns:
        column_major(module.gate_up_proj)
        column_major(module.down_proj)
    else:
        reorder(module, "gate_up_proj", interleave_expert_halves, expert_halves)
    module.coda_mlp = kernel
    module.coda_variant = variant
    module.coda_flags = {task: True}
    module.forward = PatchedForward(module, _gpt_oss_forward if variant.columns else _forward)


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward (Mixtral's and DeepSeek-V4's code) with each expert's MLP as the kernel."""
    return _route(self, hidden_states, top_k_index, top_k_weights)


def _gpt_oss_forward(self: nn.Module, hidden_states: torch.Tensor, router_indices: torch.Tensor | None = None,
                     routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """GPT-OSS's experts forward, its argument names kept, with each expert's MLP as the kernel."""
    return _route(self, hidden_states, router_indices, routing_weights)


def _route(self: nn.Module, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
           ) -> torch.Tensor:
    """The routing loop the qualifying codes share: each expert that was hit runs on its tokens in
    the order ``torch.where`` gives them, and its rows, scaled by their routing weights, are added
    back in that order."""
    out = torch.zeros_like(hidden_states)
    experts = self.gate_up_proj.shape[0]
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(index, num_classes=experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    weights_of = _weights_of(self)
    for (e,) in hit.tolist():
        pos, token = torch.where(mask[e])
        x = hidden_states[token].contiguous()
        y = self.coda_mlp(x, *weights_of(e), **self.coda_variant.params)["y"]
        out.index_add_(0, token, (y * weights[token, pos, None]).to(out.dtype))
    return out


def _weights_of(self: nn.Module) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """The kernel's weight inputs for expert ``e``: (w_gu, w_down) as (2I, H) and (H, I) views, with
    b_gu and b_down for the clamped kernel (zeros that take no gradient where the experts have
    no biases)."""
    if self.coda_variant.columns:
        return lambda e: (self.gate_up_proj[e].t(), self.gate_up_proj_bias[e], self.down_proj[e].t(),
                          self.down_proj_bias[e])
    if self.coda_variant.task != CLAMP_TASK:
        return lambda e: (self.gate_up_proj[e], self.down_proj[e])
    like = self.down_proj
    b_gu = torch.zeros(self.gate_up_proj.shape[1], dtype=like.dtype, device=like.device)
    b_down = torch.zeros(like.shape[1], dtype=like.dtype, device=like.device)
    return lambda e: (self.gate_up_proj[e], b_gu, self.down_proj[e], b_down)


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
