"""MLPs without a gate in ``apply_to_model``: ``proj(act(fc(x)))`` with biases, as GPT-Neo, GPT-J,
CodeGen, Phi, Falcon, GPT-BigCode, StarCoder-2, GPT-NeoX, Persimmon, Nemotron, BLOOM and MPT write
it, as CTRL builds it (``nn.Sequential(Linear, ReLU, Linear)``) and as a training codebase's own
model writes it (nanoGPT's ``MLP``), run as the GPT-2 suite's ``gelu_mlp`` (the exact GELU),
``gelu_tanh_mlp`` (its tanh form: ``gelu_new``, ``gelu_pytorch_tanh``, BLOOM's own), ``relu_mlp``
(ReLU) or ``relu2_mlp`` (the squared ReLU), the activation probed by value (:func:`activation`).

A module qualifies by its forward's code (``families.same_code``, so a family that copies one of
these forwards under its own class name qualifies too: GPT-Neo's and GPT-BigCode's MLPs are GPT-2's
code), with ``nn.Linear`` projections (Falcon's ``FalconLinear`` computes the same); or by the shape
of its code (:func:`site_by_rule`: a forward of one argument whose temporaries are each read once,
``x = self.fc(x)`` reassignments included, returning ``self.P(self.A(self.F(x)))``, or that wrapped
in ``self.D(...)``, a dropout or any module, which then runs on the kernel's output, with each
attribute touched nowhere else in the class), with ``nn.Linear`` or ``Conv1D`` projections of an
MLP's shapes ((I, H) then (H, I)) and one of torch's or transformers' activation modules; or as an
``nn.Sequential`` of exactly Linear, activation, Linear and optionally Dropout, which runs each once
in order. A module of such shape whose linears are not an MLP's (a classifier head to another width)
is no site.

The fc GEMM's epilogue adds the bias and applies the activation, keeping only the pre-activation for
the backward (ReLU's keeps its output, whose sign is its derivative), whose derivative rides in the
epilogue of ``dy @ W_proj``. A projection without a bias (Falcon's, StarCoder-2's and MPT's
``bias=False`` configs, or one of the two) gets a zero bias per call, whose gradient nobody asks
for.

The dropout some of these forwards apply after the projection runs on the kernel's output as HF
applies it, and so does the residual add that BLOOM's and MPT's MLPs take as a second argument
(BLOOM's ``slow_but_exact`` tensor-parallel sum, with ``pretraining_tp > 1``, is the same sum in
the GEMM's order, without the projection's bias, which the kernel then gets as zeros). Falcon's
layer adds into the MLP's output in place, which is safe while the kernel does not keep that output
for its backward (``Kernel.keeps``); a kernel that does gets a copy.

A ``Conv1D`` projection (GPT-2's, OpenAI GPT's, ImageGPT's: the weight kept (in, out)) is read as
its transposed view, and the patch stores its weight column-major, as ``apply_to_gpt2`` does, so the
kernels' weight gradients land in ``.grad`` without a copy (``fused_weights.column_major``); GPT-2
itself is ``apply_to_gpt2``'s, which folds its norms and residual adds too. A module with another
activation stays HF's.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bloom.modeling_bloom import BloomMLP, dropout_add
from transformers.models.falcon.modeling_falcon import FalconLinear, FalconMLP
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.gptj.modeling_gptj import GPTJMLP
from transformers.models.mpt.modeling_mpt import MptMLP
from transformers.models.nemotron.modeling_nemotron import NemotronMLP
from transformers.models.phi.modeling_phi import PhiMLP
from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2MLP
from transformers.pytorch_utils import Conv1D

from .adapters import linear_of, lora_of
from .code_rules import forward_expression, self_call, touched_once
from .dropin import (GELUS, PatchedForward, activation_form, check_mlp_projection, check_mlp_widths,
                     library_activation)
from .families import same_code
from .fused_weights import column_major
from .kernel import Kernel, KernelError

# The activation, probed by value -> the GPT-2 suite's task
TASKS = {"exact": "gelu_mlp", "tanh": "gelu_tanh_mlp", "relu": "relu_mlp", "relu2": "relu2_mlp"}
FORMS = {**GELUS, "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x))}
NAMES = "a GELU, ReLU or the squared ReLU"
LINEARS = (nn.Linear, FalconLinear, Conv1D)  # Conv1D keeps its weight (in, out): see weight()
BY_RULE, SEQUENTIAL = "an MLP's", "an nn.Sequential MLP's"  # the kinds of the sites no list names


def _no_dropout(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y


def _dropout(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return module.dropout(y)


def _residual_dropout(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.dropout(y, p=module.residual_dropout, training=module.training)


def _dropout_add(module: nn.Module, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return dropout_add(y, residual, module.hidden_dropout, module.training)


def _dropout_then_add(module: nn.Module, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return F.dropout(y, p=module.hidden_dropout, training=module.training) + residual


def _applied(name: str, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    # the module the forward applies to the projection's output (a dropout), as the forward applies it
    return getattr(module, name)(y)


def _with_bias(module: nn.Module) -> bool:
    return True


def _bloom_bias(module: nn.Module) -> bool:
    # BLOOM's tensor-parallel sum (pretraining_tp > 1 with slow_but_exact) adds up the projection's
    # slices with F.linear and no bias: dense_4h_to_h.bias is not in its output
    return not (module.pretraining_tp > 1 and module.slow_but_exact)


def _own_copy(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    # Falcon's layer adds the attention output into the MLP's in place (`mlp_output +=`): if the
    # kernel's autograd Function keeps y for its backward, the layer gets a copy to change
    return y.clone() if module.coda_mlp.keeps("y") else y


@dataclass(frozen=True)
class Site:
    """Where an MLP keeps its parts, whose code it is, and what follows its projection: the
    family's dropout, the residual add of the forward's further arguments, or a copy the layer may
    change in place."""

    kind: str
    fc: str
    act: str
    proj: str
    after: Callable[..., torch.Tensor] = _no_dropout
    proj_bias: Callable[[nn.Module], bool] = _with_bias  # whether the forward adds the projection's bias


# Whose MLP code -> (its forward, its site)
MLPS: dict[str, tuple[Any, Site]] = {kind: (fn, Site(kind, *names, *after)) for kind, fn, names, after in (
    ("GPT-2's", GPT2MLP.forward, ("c_fc", "act", "c_proj"), (_dropout,)),
    ("GPT-J's", GPTJMLP.forward, ("fc_in", "act", "fc_out"), (_dropout,)),
    ("Phi's", PhiMLP.forward, ("fc1", "activation_fn", "fc2"), (_no_dropout,)),
    ("GPT-NeoX's", GPTNeoXMLP.forward, ("dense_h_to_4h", "act", "dense_4h_to_h"), (_no_dropout,)),
    ("Falcon's", FalconMLP.forward, ("dense_h_to_4h", "act", "dense_4h_to_h"), (_own_copy,)),
    ("StarCoder-2's", Starcoder2MLP.forward, ("c_fc", "act", "c_proj"), (_residual_dropout,)),
    ("Nemotron's", NemotronMLP.forward, ("up_proj", "act_fn", "down_proj"), (_no_dropout,)),
    ("BLOOM's", BloomMLP.forward, ("dense_h_to_4h", "gelu_impl", "dense_4h_to_h"), (_dropout_add, _bloom_bias)),
    ("MPT's", MptMLP.forward, ("up_proj", "act", "down_proj"), (_dropout_then_add,)))}


def recognised(module: nn.Module) -> tuple[Site | None, str | None, str]:
    """(the MLP's site, the task of the kernel that computes it, why there is none): (None, None,
    "") for a module of no such code."""
    kind = next((k for k, (fn, _) in MLPS.items() if same_code(type(module).forward, fn)), None)
    site = MLPS[kind][1] if kind else _site_of(module)
    if site is None:
        return None, None, ""
    fc = getattr(module, site.fc, None)
    if not isinstance(fc, LINEARS) and lora_of(fc) is None:
        return site, None, f"{type(module).__name__}.{site.fc} is {type(fc).__name__}, not nn.Linear or Conv1D"
    act = getattr(module, site.act, None)
    form = activation(act) if isinstance(act, nn.Module) else None
    if form is None:
        code = f"{site.kind} MLP code" if kind else f"{site.kind} shape of code"
        return site, None, f"{type(module).__name__} is {code} with {type(act).__name__}, none of {NAMES}"
    return site, TASKS[form], ""


def _site_of(module: nn.Module) -> Site | None:
    """The site of an MLP found by the shape of its code or as an ``nn.Sequential`` (module
    docstring), where its parts are what an MLP's are; else None."""
    if type(module) is nn.Sequential:
        names = list(module._modules)
        parts = list(module._modules.values())
        if len(parts) not in (3, 4) or (len(parts) == 4 and not isinstance(parts[3], nn.Dropout)):
            return None
        site = _site(SEQUENTIAL, names)
    else:
        site = site_by_rule(type(module))
        if site is None:
            return None
    fc, proj = (linear_of(getattr(module, n, None)) for n in (site.fc, site.proj))
    if type(fc) not in (nn.Linear, Conv1D) or type(proj) not in (nn.Linear, Conv1D) \
            or not library_activation(getattr(module, site.act)):
        return None
    if weight(fc).shape[::-1] != weight(proj).shape:  # not an MLP's widths: a head to another width
        return None
    return site


def weight(m: nn.Module) -> torch.Tensor:
    """A projection's weight as nn.Linear keeps it, (out, in), which the kernels read: a Conv1D's
    (GPT-2's, OpenAI GPT's) transposed, a view of the same Parameter."""
    return m.weight.t() if isinstance(m, Conv1D) else m.weight


@lru_cache(maxsize=None)
def site_by_rule(cls: type) -> Site | None:
    """The attributes of an MLP whose forward has the shape of code the module docstring names;
    None for any other code."""
    read = forward_expression(cls)
    outer = read and self_call(read[0])
    node: ast.expr | None = outer and outer[1]
    names = [outer[0]] if outer else []
    while (call := self_call(node)) is not None:
        names.append(call[0])
        node = call[1]
    if not (isinstance(node, ast.Name) and node.id == read[1]) or len(set(names)) != len(names):
        return None
    chain = names[::-1]  # fc, act, proj[, what follows]
    if len(chain) not in (3, 4) or not touched_once(cls, tuple(chain)):
        return None
    return _site(BY_RULE, chain)


def _site(kind: str, names: list[str]) -> Site:
    """A site found by a rule: ``names`` are the fc, the activation, the projection and, where there
    is a fourth, the module applied to the projection's output."""
    return Site(kind, *names[:3], partial(_applied, names[3]) if len(names) == 4 else _no_dropout)


def activation(act: nn.Module) -> str | None:
    """Which of the kernels' activations ``act`` computes (a key of :data:`TASKS`), probed by value
    (``dropin.activation_form``); None: none of them."""
    return activation_form(act, FORMS)


def check(module: nn.Module, where: str, site: Site, task: str, flag: str = "mlp=False") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's MLP, one that holds what ``task``'s kernel does
    not take."""
    fc, proj = getattr(module, site.fc), getattr(module, site.proj)
    for name, m in ((site.fc, fc), (site.proj, proj)):
        check_mlp_projection(m, f"{where}.{name}", task, flag, LINEARS)
    width, inter = weight(proj).shape
    if weight(fc).shape != (inter, width):
        raise KernelError(f"{where}: {site.fc}'s weight is {tuple(weight(fc).shape)} as nn.Linear keeps it, not "
                          f"({inter}, {width}) as {site.proj}'s {tuple(weight(proj).shape)} implies; pass {flag} to "
                          "keep HF's MLPs")
    check_mlp_widths(where, width, inter, flag)


def patch(module: nn.Module, site: Site, task: str, kernel: Kernel) -> None:
    for name in (site.fc, site.proj):
        if isinstance(getattr(module, name), Conv1D):
            column_major(getattr(module, name).weight)
    module.coda_mlp = kernel
    module.coda_plain_mlp = site
    module.coda_flags = {task: True}
    module.forward = PatchedForward(module, _forward)


def _forward(self: nn.Module, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The MLP's forward as its kernel, on any leading shape, then what the family's code does next
    (with ``rest``, the forward's further arguments: BLOOM's and MPT's residual)."""
    site = self.coda_plain_mlp
    fc, proj = getattr(self, site.fc), getattr(self, site.proj)
    w_fc, w_proj = weight(fc), weight(proj)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # no token: no GEMM to launch, HF's math on the empty rows
        y = F.linear(getattr(self, site.act)(F.linear(rows, w_fc, fc.bias)), w_proj,
                     proj.bias if site.proj_bias(self) else None)
    else:
        # bias=False (or a bias the forward does not add): zeros the kernel adds, whose gradients
        # autograd never asks for
        b_fc = fc.bias if fc.bias is not None else rows.new_zeros(w_fc.shape[0])
        b_proj = proj.bias if proj.bias is not None and site.proj_bias(self) else rows.new_zeros(w_proj.shape[0])
        y = self.coda_mlp(rows.contiguous(), w_fc, b_fc, w_proj, b_proj)["y"]
    return site.after(self, y.view(*x.shape[:-1], w_proj.shape[0]), *rest)
