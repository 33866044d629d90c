"""Gated MLPs, ``down(act(gate(x)) * up(x))``, as the kernel of their activation: SiLU's
``swiglu_mlp``, GELU's tanh form's ``geglu_mlp`` (Gemma's ``gelu_pytorch_tanh``, probed by value:
``dropin.gelu_form``).  ``apply_to_model`` patches every one it finds, wherever it sits (a
post-norm block's MLP, a mixture of experts' shared expert, every layer of a hybrid), and
``apply_to_llama`` the MLPs it runs alone.

The gate/up GEMM's epilogue applies the activation, the backward's derivative rides in the
epilogue of ``dy @ W_down``, and only the pre-activation is kept between the two.  Gate and up
are fused into one weight with interleaved rows, once, at patch time (``fused_weights.relayout``:
the state dict keeps HF's keys).

A module qualifies by its forward's code: LLaMA's MLP (and the many families that copy it,
``families.same_code``), Phi-3's (one ``gate_up_proj``, gate and up in halves), the clamped
SwiGLUs of DeepSeek-V4's and GLM-5's MLPs (their shared experts and dense layers: gate clamped to
``limit`` from above, up to [-limit, limit], SiLU) and MiniMax-M3's dense MLP (gate and up in
halves, ``sigmoid(alpha g) g (u + 1)``), which run as ``swiglu_clamp_mlp`` with the module's limit
and alpha and take biases (:data:`CLAMPED`), or any forward whose code has the gated MLP's shape
(:func:`layout_by_rule`: its single argument ``x`` and temporaries each read once, returning
``self.D(self.A(self.G(x)) * self.U(x))`` in either order of the product, with each of the four
attributes touched nowhere else in the class: Llama 4's ``Llama4TextMLP`` writes it in two
statements).  An MLP of such code with another activation (the exact GELU, xIELU) stays HF's,
with why.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2CLS
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLDenseMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from .adapters import linear_of
from .code_rules import forward_expression, self_call, touched_once
from .dropin import PatchedForward, check_mlp_projection, check_mlp_widths, gelu_form, suite_kernel
from .families import same_code
from .fused_weights import halves_from_interleaved, interleave_halves, interleave_rows, relayout, split_interleaved
from .kernel import Kernel, KernelError

TASKS = ("swiglu_mlp", "geglu_mlp")
CLAMP_TASK = "swiglu_clamp_mlp"  # moe_experts' clamped experts run as it too (its TASKS list it)
SILU = (nn.SiLU, ACT2CLS["silu"])
FUSED = "gate_up_proj"  # the fused gate/up weight's attribute


@dataclass(frozen=True)
class Layout:
    """Where a gated MLP keeps its parts: the projections fused into ``gate_up_proj`` (gate and
    up, or one weight of both in halves), the down projection and the activation."""

    parts: tuple[str, ...]
    down: str
    act: str


# Whose MLP code -> (its forward, its layout)
CODES = {"LLaMA's": (LlamaMLP.forward, Layout(("gate_proj", "up_proj"), "down_proj", "act_fn")),
         "Phi-3's": (Phi3MLP.forward, Layout((FUSED,), "down_proj", "activation_fn"))}
BY_RULE = "a gated MLP's"  # the kind of one found by its code's shape


@dataclass(frozen=True)
class Clamp:
    """A clamped SwiGLU's params as its module holds them: the attribute of the limit, alpha's
    (None: alpha 1, the SiLU of the module's activation) and the offset added to the clamped up."""

    limit: str
    alpha: str | None
    offset: float

    def params(self, module: nn.Module) -> dict[str, float] | None:
        """The kernel's params, or None where the module's values are no finite numbers."""
        alpha = 1.0 if self.alpha is None else getattr(module, self.alpha, None)
        return clamp_params(getattr(module, self.limit, None), alpha, self.offset)


def clamp_params(limit: Any, alpha: Any, offset: float) -> dict[str, float] | None:
    """``swiglu_clamp_mlp``'s params from a module's values, or None where the limit is no finite
    positive number or alpha no finite number (a dense MLP's and an experts module's alike)."""
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (limit, alpha)) or limit <= 0:
        return None
    return {"limit": float(limit), "alpha": float(alpha), "offset": offset}


_SPLIT = Layout(("gate_proj", "up_proj"), "down_proj", "act_fn")
# Whose clamped MLP code -> (its forward, its layout, its params)
CLAMPED = {"DeepSeek-V4's": (DeepseekV4MLP.forward, _SPLIT, Clamp("limit", None, 0.0)),
           "GLM-5's": (Glm5NextTextMLP.forward, _SPLIT, Clamp("swiglu_limit", None, 0.0)),
           "MiniMax-M3's": (MiniMaxM3VLDenseMLP.forward, Layout((FUSED,), "down_proj", ""),
                            Clamp("swiglu_limit", "swiglu_alpha", 1.0))}


def recognised(module: nn.Module) -> tuple[str | None, Layout | None, str | None]:
    """(whose MLP code ``module``'s forward is, its layout, the task of the kernel that computes
    it); (None, None, None) for no gated MLP, a None task for one whose activation no kernel has."""
    clamped = next((k for k, (fn, _, _) in CLAMPED.items() if same_code(type(module).forward, fn)), None)
    if clamped is not None:
        _, layout, clamp = CLAMPED[clamped]
        silu = clamp.alpha is not None or isinstance(getattr(module, layout.act, None), SILU)
        return clamped, layout, CLAMP_TASK if silu and clamp.params(module) is not None else None
    kind = next((k for k, (fn, _) in CODES.items() if same_code(type(module).forward, fn)), None)
    layout = CODES[kind][1] if kind else layout_by_rule(type(module))
    if layout is None:
        return None, None, None
    if kind is None and (hasattr(module, FUSED) or not all(_bare_linear(getattr(module, p, None))
                                                           for p in (*layout.parts, layout.down))):
        # the shape of code, but not of linears without biases (a vision tower's MLP), or the fused
        # name is taken: no site (a known code's biases are refused instead, naming the flag)
        return None, None, None
    act = getattr(module, layout.act, None)
    task = "swiglu_mlp" if isinstance(act, SILU) else "geglu_mlp" if _gelu(act) == "tanh" else None
    return kind or BY_RULE, layout, task


def _bare_linear(m: Any) -> bool:
    base = linear_of(m)
    return type(base) is nn.Linear and base.bias is None


def why_not(module: nn.Module, kind: str, layout: Layout) -> str:
    """Why a gated MLP of ``kind`` whose activation no kernel computes is passed by."""
    act = getattr(module, layout.act, None)
    if kind in CLAMPED:
        return (f"{type(module).__name__} is {kind} clamped MLP code with {type(act).__name__} or no finite "
                f"{CLAMPED[kind][2].limit}, not the clamped SwiGLU")
    code = "a gated MLP in its code's shape" if kind == BY_RULE else f"{kind} MLP code"
    return f"{type(module).__name__} is {code} with {type(act).__name__}, neither SiLU nor GELU's tanh form"


@lru_cache(maxsize=None)
def layout_by_rule(cls: type) -> Layout | None:
    """The layout of a gated MLP whose forward has the shape of code the module docstring names;
    None for any other code."""
    read = forward_expression(cls)
    if read is None:
        return None
    down, x = self_call(read[0]), read[1]
    product = down and down[1]
    if not (isinstance(product, ast.BinOp) and isinstance(product.op, ast.Mult)):
        return None
    for gated, other in ((product.left, product.right), (product.right, product.left)):
        act, up = self_call(gated), self_call(other)
        gate = act and self_call(act[1])
        if gate and up and all(isinstance(a, ast.Name) and a.id == x for a in (gate[1], up[1])):
            names = (gate[0], up[0], down[0], act[0])
            if len(set(names)) == 4 and touched_once(cls, names):
                return Layout((gate[0], up[0]), down[0], act[0])
    return None


def _gelu(act: Any) -> str | None:
    return gelu_form(act) if isinstance(act, nn.Module) else None


def check(module: nn.Module, where: str, layout: Layout, task: str, flag: str = "mlp=False") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's MLPs, one that holds what the kernel does not
    take: projections it cannot read, biases, gate and up frozen apart, widths no GEMM's."""
    for p in (*layout.parts, layout.down):
        m = getattr(module, p, None)
        check_mlp_projection(m, f"{where}.{p}", task, flag)
        if m.bias is not None and task != CLAMP_TASK:
            raise KernelError(f"{where}.{p}.bias: MLP biases are not in the {task} kernel; pass {flag} to keep "
                              "HF's MLPs")
    if len({getattr(module, p).bias is None for p in layout.parts}) > 1:
        raise KernelError(f"{where}: {' and '.join(layout.parts)} differ in having a bias, and the kernel fuses them "
                          f"into one projection; pass {flag} to keep HF's MLPs")
    frozen = {p: getattr(module, p).weight.requires_grad for p in layout.parts}
    if len(set(frozen.values())) > 1:
        raise KernelError(f"{where}: requires_grad differs across {', '.join(layout.parts)} ({frozen}); the kernel "
                          "fuses them into one parameter, which trains or freezes as a whole: freeze or unfreeze "
                          f"them together first, or pass {flag}")
    check_mlp_widths(where, *getattr(module, layout.down).weight.shape, flag)


def check_gated_mlp(module: nn.Module, where: str, flag: str) -> tuple[Layout, str]:
    """(its layout, its kernel's task) for one gated MLP that a layer drop-in runs alone (its norm
    and residual outside it); refuses, naming ``flag`` as the way to keep HF's, an MLP that no
    kernel computes or that holds what its kernel does not take.  A drop-in checks every layer's
    before it patches any (:func:`patch_gated_mlp`)."""
    kind, layout, task = recognised(module)
    if layout is None or task is None:
        act = getattr(module, layout.act, None) if layout else None
        raise KernelError(f"{where} is {type(module).__name__} with {type(act).__name__}: no kernel of the suite "
                          f"computes it (a gated MLP, LLaMA's or Phi-3's code or its shape, with SiLU or GELU's "
                          f"tanh form); pass {flag} to keep HF's MLP")
    check(module, where, layout, task, flag)
    return layout, task


def patch_gated_mlp(module: nn.Module, layout: Layout, task: str) -> None:
    """Patch one gated MLP that :func:`check_gated_mlp` took as the suite's kernel of ``task``."""
    patch(module, layout, task, suite_kernel(task))


def patch(module: nn.Module, layout: Layout, task: str, kernel: Kernel) -> None:
    if len(layout.parts) == 2:
        relayout(module, FUSED, layout.parts, interleave_rows, split_interleaved)
    else:  # Phi-3's gate_up_proj, gate and up in halves
        relayout(module, FUSED, layout.parts, interleave_halves, halves_from_interleaved)
    module.coda_mlp = kernel
    module.coda_gated = layout
    kind = recognised(module)[0] if task == CLAMP_TASK else None
    module.coda_params = CLAMPED[kind][2].params(module) if kind in CLAMPED else None
    module.coda_flags = {task: True}
    module.forward = PatchedForward(module, _forward)


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward as its kernel, on any leading shape."""
    fused, down = getattr(self, FUSED), getattr(self, self.coda_gated.down)
    w_gu, w_down = fused.weight, down.weight
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # an expert no token was routed to: no GEMM to launch, the same empty result
        g, u = split_interleaved(w_gu)
        return (rows @ g.t() * (rows @ u.t())) @ w_down.t()
    if getattr(self, "coda_params", None) is None:
        y = self.coda_mlp(rows.contiguous(), w_gu, w_down)["y"]
    else:  # the clamped SwiGLU, with biases (zeros that take no gradient where the projections have none)
        b_gu = fused.bias if fused.bias is not None else w_gu.new_zeros(w_gu.shape[0])
        b_down = down.bias if down.bias is not None else w_down.new_zeros(w_down.shape[0])
        y = self.coda_mlp(rows.contiguous(), w_gu, b_gu, w_down, b_down, **self.coda_params)["y"]
    return y.view(*x.shape[:-1], w_down.shape[0])
