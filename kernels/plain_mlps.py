"""MLPs without a gate in ``apply_to_model``: ``proj(act(fc(x)))`` with biases, as GPT-Neo, GPT-J,
CodeGen, Phi, Falcon, GPT-BigCode, StarCoder-2, GPT-NeoX, Persimmon, Nemotron, BLOOM and MPT write
it, run as the GPT-2 suite's ``gelu_mlp`` (the exact GELU), ``gelu_tanh_mlp`` (its tanh form:
``gelu_new``, ``gelu_pytorch_tanh``, BLOOM's own) or ``relu2_mlp`` (the squared ReLU), the
activation probed by value (:func:`activation`).

A module qualifies by its forward's code (``families.same_code``, so a family that copies one of
these forwards under its own class name qualifies too: GPT-Neo's and GPT-BigCode's MLPs are GPT-2's
code), with ``nn.Linear`` projections (Falcon's ``FalconLinear`` computes the same). The fc GEMM's
epilogue adds the bias and applies the activation, keeping only the pre-activation for the backward,
whose derivative rides in the epilogue of ``dy @ W_proj``. A projection without a bias (Falcon's,
StarCoder-2's and MPT's ``bias=False`` configs) gets a zero bias per call, whose gradient nobody
asks for. The dropout some of these forwards apply after the projection runs on the kernel's output
as HF applies it, and so does the residual add that BLOOM's and MPT's MLPs take as a second
argument (BLOOM's ``slow_but_exact`` tensor-parallel sum is the same sum, in the GEMM's order).
Falcon's layer adds into the MLP's output in place, which is safe while the kernel does not keep
that output for its backward (``Kernel.keeps``); a kernel that does gets a copy. GPT-2's own MLP
(``Conv1D`` weights, transposed) is ``apply_to_gpt2``'s, and a module with another activation stays
HF's.
"""

from __future__ import annotations

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

from .adapters import lora_of
from .dropin import GELUS, PatchedForward, activation_form, check_mlp_projection, check_mlp_widths
from .families import same_code
from .kernel import Kernel, KernelError

# The activation, probed by value -> the GPT-2 suite's task
TASKS = {"exact": "gelu_mlp", "tanh": "gelu_tanh_mlp", "relu2": "relu2_mlp"}
FORMS = {**GELUS, "relu2": lambda x: torch.square(F.relu(x))}
LINEARS = (nn.Linear, FalconLinear)


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


def _own_copy(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    # Falcon's layer adds the attention output into the MLP's in place (`mlp_output +=`): if the
    # kernel's autograd Function keeps y for its backward, the layer gets a copy to change
    return y.clone() if module.coda_mlp.keeps("y") else y


# Whose MLP code -> (its forward, (fc, activation, proj) attributes, what follows the proj: the
# family's dropout, the residual add of the forward's further arguments, or a copy the layer may
# change in place).
MLPS: dict[str, tuple[Any, tuple[str, str, str], Callable[..., torch.Tensor]]] = {
    "GPT-2's": (GPT2MLP.forward, ("c_fc", "act", "c_proj"), _dropout),
    "GPT-J's": (GPTJMLP.forward, ("fc_in", "act", "fc_out"), _dropout),
    "Phi's": (PhiMLP.forward, ("fc1", "activation_fn", "fc2"), _no_dropout),
    "GPT-NeoX's": (GPTNeoXMLP.forward, ("dense_h_to_4h", "act", "dense_4h_to_h"), _no_dropout),
    "Falcon's": (FalconMLP.forward, ("dense_h_to_4h", "act", "dense_4h_to_h"), _own_copy),
    "StarCoder-2's": (Starcoder2MLP.forward, ("c_fc", "act", "c_proj"), _residual_dropout),
    "Nemotron's": (NemotronMLP.forward, ("up_proj", "act_fn", "down_proj"), _no_dropout),
    "BLOOM's": (BloomMLP.forward, ("dense_h_to_4h", "gelu_impl", "dense_4h_to_h"), _dropout_add),
    "MPT's": (MptMLP.forward, ("up_proj", "act", "down_proj"), _dropout_then_add),
}


def recognised(module: nn.Module) -> tuple[str | None, str | None, str]:
    """(whose MLP code ``module``'s forward is, the task of the kernel that computes it, why there is
    none): (None, None, "") for a module of no such code."""
    kind = next((k for k, (fn, _, _) in MLPS.items() if same_code(type(module).forward, fn)), None)
    if kind is None:
        return None, None, ""
    fc_name, act_name, proj_name = MLPS[kind][1]
    fc = getattr(module, fc_name, None)
    if not isinstance(fc, LINEARS) and lora_of(fc) is None:
        return kind, None, (f"{type(module).__name__}.{fc_name} is {type(fc).__name__}, not nn.Linear"
                            + (" (GPT-2's layout: apply_to_gpt2 takes GPT-2)" if type(fc).__name__ == "Conv1D" else ""))
    act = getattr(module, act_name, None)
    form = activation(act) if isinstance(act, nn.Module) else None
    if form is None:
        return kind, None, (f"{type(module).__name__} is {kind} MLP code with {type(act).__name__}, neither a GELU "
                            "nor the squared ReLU")
    return kind, TASKS[form], ""


def activation(act: nn.Module) -> str | None:
    """Which of the kernels' activations ``act`` computes (a key of :data:`TASKS`), probed by value
    (``dropin.activation_form``); None: none of them."""
    return activation_form(act, FORMS)


def check(module: nn.Module, where: str, kind: str, task: str, flag: str = "mlp=False") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's MLP, one that holds what ``task``'s kernel does
    not take."""
    names = MLPS[kind][1]
    fc, proj = getattr(module, names[0]), getattr(module, names[2])
    for name, m in ((names[0], fc), (names[2], proj)):
        check_mlp_projection(m, f"{where}.{name}", task, flag, LINEARS)
    if (fc.bias is None) != (proj.bias is None):
        raise KernelError(f"{where}: {names[0]} has {'no ' * (fc.bias is None)}bias and {names[2]} "
                          f"{'none' if proj.bias is None else 'one'}; the {task} kernel takes both or neither "
                          f"(zeros); pass {flag} to keep HF's MLPs")
    width, inter = proj.weight.shape
    if fc.weight.shape != (inter, width):
        raise KernelError(f"{where}: {names[0]}'s weight is {tuple(fc.weight.shape)}, not ({inter}, {width}) as "
                          f"{names[2]}'s {tuple(proj.weight.shape)} implies; pass {flag} to keep HF's MLPs")
    check_mlp_widths(where, width, inter, flag)


def patch(module: nn.Module, kind: str, task: str, kernel: Kernel) -> None:
    module.coda_mlp = kernel
    module.coda_plain_mlp = kind
    module.coda_flags = {task: True}
    module.forward = PatchedForward(module, _forward)


def _forward(self: nn.Module, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The MLP's forward as its kernel, on any leading shape, then what the family's code does next
    (with ``rest``, the forward's further arguments: BLOOM's and MPT's residual)."""
    fc_name, act_name, proj_name = MLPS[self.coda_plain_mlp][1]
    fc, proj = getattr(self, fc_name), getattr(self, proj_name)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # no token: no GEMM to launch, HF's math on the empty rows
        y = F.linear(getattr(self, act_name)(F.linear(rows, fc.weight, fc.bias)), proj.weight, proj.bias)
    else:
        b_fc, b_proj = fc.bias, proj.bias
        if b_fc is None:  # bias=False: zeros the kernel adds, whose gradients autograd never asks for
            b_fc = rows.new_zeros(fc.weight.shape[0])
            b_proj = rows.new_zeros(proj.weight.shape[0])
        y = self.coda_mlp(rows.contiguous(), fc.weight, b_fc, proj.weight, b_proj)["y"]
    return MLPS[self.coda_plain_mlp][2](self, y.view(*x.shape[:-1], proj.weight.shape[0]), *rest)
