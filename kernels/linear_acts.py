"""A linear layer and the activation that a module's code applies to its output at once, in
``apply_to_model``: ``act(fc(x))`` run as one GEMM whose epilogue adds the bias and applies the
activation (the GPT-2 suite's ``linear_gelu``, ``linear_gelu_tanh`` or ``linear_relu``, by the
activation's value), wherever a model writes it:

- encoders' intermediates, the first half of BERT's MLP (``BertIntermediate``: ``dense`` then
  ``intermediate_act_fn``) and of the ~60 encoders that copy or rewrite it (RoBERTa, XLM-R,
  ELECTRA, DeBERTa, RoFormer, RoBERTa-PreLayerNorm's LayerNorm-first one, BigBird's tanh GELU ...);
- decoder layers that run their MLP inline (``fc1``, ``activation_fn``, dropout, ``fc2``, the
  residual add: OPT, BioGPT, XGLM, TrOCR, and BART's, Whisper's and M2M100's encoder and decoder
  layers), or in a helper the forward calls (ALBERT's ``ff_chunk``);
- prediction heads' transforms (BERT's and ELECTRA's: dense, activation, LayerNorm).

The second linear and whatever follows stay HF's (a dropout between the two may sit there). The
site is found in the code, not in a list of classes, so the rule itself is what keeps it exact:
in the code of the module's methods (their AST), the statement ``v = self.L(e)`` directly
followed by ``v = self.A(v)`` (the pre-activation is overwritten, so nothing reads it), or the
expression ``self.A(self.L(e))``; neither ``self.L`` nor ``self.A`` is touched anywhere else in
the class's methods (its ``__init__`` aside), nor named as a string (``getattr``); and the
linear is held by no second parent (which may run it alone: the patch changes the linear itself,
while the activation is only replaced in the module's own attribute). The patch then makes ``L``
return ``act(L(e))`` through the kernel and sets ``A`` to the identity, which computes what HF
computes for every input: the only reads of the two attributes are that one composition. ``L``
must be an ``nn.Linear`` (a LoRA layer is refused with the flag that keeps it HF's, another type is
passed by), ``A`` an activation without parameters or buffers (a PReLU that starts as ReLU does not
stay one) that equals the exact GELU, its tanh form or ReLU on a probe (``dropin.activation_form``).
A linear without a bias gets zeros.

The backward's derivative is one pass over the incoming gradient (no GEMM produces it here) that
also reduces the bias gradient, before the two gradient GEMMs. GELU's kernels keep the
pre-activation; ReLU's keeps nothing: its derivative is read off the output, which the next linear
keeps as its input anyway.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Any, Collection, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import lora_of
from .code_rules import assigned, run_methods, self_call, touched_once
from .dropin import (ACTIVATION_MODULES, GELUS, PatchedForward, activation_form, check_mlp_projection,
                     check_mlp_widths)
from .kernel import Kernel
# The activation, probed by value -> the GPT-2 suite's task
TASKS = {"exact": "linear_gelu", "tanh": "linear_gelu_tanh", "relu": "linear_relu"}
FORMS = {**GELUS, "relu": F.relu}
NAMES = {"exact": "the exact GELU", "tanh": "GELU's tanh form", "relu": "ReLU"}


def recognised(module: nn.Module, shared: Collection[int] = ()) -> tuple[list[tuple[tuple[str, str], str]], str]:
    """([((the linear's attribute, the activation's), the task of the kernel that computes them)]
    for each site in ``module``'s code where an activation is applied to a linear's output at once
    (see the module docstring), why a site that stays HF's is passed by).  ``shared``: the ids of
    the model's modules that more than one parent holds (:func:`shared_modules`)."""
    sites, why = [], ""
    for pair in candidates(type(module)):
        lin, act = (getattr(module, name, None) for name in pair)
        if (type(lin) is not nn.Linear and lora_of(lin) is None) or not _activation_module(act):
            continue  # not a linear and an activation: dropout after a projection, a norm before an MLP
        if id(lin) in shared:  # its patched forward would run the activation for the other holder too
            why = (f"{type(module).__name__} applies {pair[1]} to {pair[0]}, but another module holds that "
                   "linear too, and may run it alone")
            continue
        form = None if any(True for _ in (*act.parameters(), *act.buffers())) else activation_form(act, FORMS)
        if form is None:  # a PReLU that starts as ReLU does not stay one: no parameters
            why = (f"{type(module).__name__} applies {pair[1]} ({type(act).__name__}) to {pair[0]}, which is none "
                   f"of {', '.join(NAMES.values())} (or has parameters)")
            continue
        sites.append((pair, TASKS[form]))
    return sites, why


def shared_modules(model: nn.Module) -> set[int]:
    """The ids of the modules of ``model`` that more than one parent attribute holds (a module
    shared by two layers' code counts; one layer shared by many places, as ALBERT's, holds its
    children once)."""
    held: dict[int, int] = {}
    for parent in model.modules():
        for child in parent._modules.values():
            if child is not None:
                held[id(child)] = held.get(id(child), 0) + 1
    return {i for i, n in held.items() if n > 1}


def _activation_module(act: Any) -> bool:
    return isinstance(act, nn.Module) and type(act).__module__ in ACTIVATION_MODULES


def check(module: nn.Module, where: str, pair: tuple[str, str], task: str, flag: str = "mlp=False") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's, a linear the ``task`` kernel cannot read."""
    lin = getattr(module, pair[0])
    check_mlp_projection(lin, f"{where}.{pair[0]}", task, flag, runs=f"{pair[0]} with its activation")
    inter, width = lin.weight.shape
    check_mlp_widths(f"{where}.{pair[0]}", width, inter, flag)


def patch(module: nn.Module, pair: tuple[str, str], task: str, kernel: Kernel) -> None:
    """``pair[0]`` returns the activation of its output through ``kernel``; ``pair[1]`` becomes the
    identity (a module stays a module, so the state dict and the module tree keep their keys)."""
    lin_name, act_name = pair
    lin = getattr(module, lin_name)
    lin.coda_mlp = kernel
    lin.coda_flags = {task: True}
    lin.forward = PatchedForward(lin, _forward)
    setattr(module, act_name, nn.Identity())
    module.coda_flags = {task: True}


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The linear and its activation as the kernel, on any leading shape."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # no token: no GEMM to launch; the empty result, any activation's
        return F.linear(x, self.weight, self.bias)
    b = self.bias if self.bias is not None else rows.new_zeros(self.weight.shape[0])
    y = self.coda_mlp(rows.contiguous(), self.weight, b)["y"]
    return y.view(*x.shape[:-1], self.weight.shape[0])


# --------------------------------------------------------------------------- the rule, on the code


@lru_cache(maxsize=None)
def candidates(cls: type) -> tuple[tuple[str, str], ...]:
    """The (L, A) attribute pairs where a method of ``cls`` (its forward, or a helper it calls:
    ALBERT's ``ff_chunk``) applies ``self.A`` to ``self.L``'s output at once and nothing else in
    the class touches either (module docstring), whatever the attributes hold; () where the code
    cannot be read."""
    pairs = dict.fromkeys(p for f in run_methods(cls) for p in _pairs(f))
    return tuple(p for p in pairs if touched_once(cls, p))


def _pairs(fn: ast.FunctionDef) -> Iterator[tuple[str, str]]:
    for node in ast.walk(fn):
        outer = self_call(node)
        inner = outer and self_call(outer[1])
        if inner:  # self.A(self.L(e))
            yield inner[0], outer[0]
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for first, second in zip(stmts, stmts[1:]):
                a, b = assigned(first), assigned(second)
                lin = a and self_call(a[1])
                act = b and self_call(b[1])
                if lin and act and a[0] == b[0] and isinstance(act[1], ast.Name) and act[1].id == a[0]:
                    yield lin[0], act[0]  # v = self.L(e); v = self.A(v)
