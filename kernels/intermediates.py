"""The first half of an encoder's MLP in ``apply_to_model``: ``act(dense(x))``, as BERT writes its
``BertIntermediate`` and the many encoders that copy it write theirs (about 60 classes of
transformers: RoBERTa, XLM-R, ELECTRA, DeBERTa, CamemBERT, ERNIE, RoFormer, BigBird, LayoutLM, ViLT,
VideoMAE, BLIP-2's Q-Former ...), run as
the GPT-2 suite's ``linear_gelu``: one GEMM whose epilogue adds the bias and applies the exact GELU,
keeping the pre-activation for the backward, whose derivative is one pass over the incoming
gradient (no GEMM produces it here) before the two gradient GEMMs.

These models split their MLP in two modules, and the second (``BertOutput``: the projection, its
dropout, then the residual add and LayerNorm) stays HF's. A module qualifies by its forward's code
(``families.same_code``) with an ``nn.Linear`` dense layer and an activation probed by value to be
the exact GELU (``dropin.activation_form``); a dense layer without a bias gets zeros. Another
activation (GELU's tanh form, ReLU) is passed by with why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bert.modeling_bert import BertIntermediate

from .dropin import GELUS, PatchedForward, activation_form, check_mlp_projection, check_mlp_widths
from .families import same_code
from .kernel import Kernel

TASK = "linear_gelu"
# Whose code -> (its forward, (dense, activation) attributes)
INTERMEDIATES = {"BERT's": (BertIntermediate.forward, ("dense", "intermediate_act_fn"))}


def recognised(module: nn.Module) -> tuple[str | None, str | None, str]:
    """(whose intermediate code ``module``'s forward is, the task of the kernel that computes it, why
    there is none): (None, None, "") for a module of no such code."""
    kind = next((k for k, (fn, _) in INTERMEDIATES.items() if same_code(type(module).forward, fn)), None)
    if kind is None:
        return None, None, ""
    act = getattr(module, INTERMEDIATES[kind][1][1], None)
    if not (isinstance(act, nn.Module) and activation_form(act, {"exact": GELUS["exact"]})):
        return kind, None, (f"{type(module).__name__} is {kind} intermediate code with {type(act).__name__}, "
                            "not the exact GELU")
    return kind, TASK, ""


def check(module: nn.Module, where: str, kind: str, task: str = TASK, flag: str = "mlp=False") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's, a dense layer the ``task`` kernel cannot read."""
    dense_name = INTERMEDIATES[kind][1][0]
    dense = getattr(module, dense_name, None)
    check_mlp_projection(dense, f"{where}.{dense_name}", task, flag, runs="the dense layer with its GELU")
    inter, width = dense.weight.shape
    check_mlp_widths(where, width, inter, flag)


def patch(module: nn.Module, kind: str, kernel: Kernel) -> None:
    module.coda_mlp = kernel
    module.coda_intermediate = kind
    module.coda_flags = {TASK: True}
    module.forward = PatchedForward(module, _forward)


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The intermediate's forward as its kernel, on any leading shape."""
    dense_name, act_name = INTERMEDIATES[self.coda_intermediate][1]
    dense = getattr(self, dense_name)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # no token: no GEMM to launch, HF's math on the empty rows
        y = getattr(self, act_name)(F.linear(rows, dense.weight, dense.bias))
    else:
        b = dense.bias if dense.bias is not None else rows.new_zeros(dense.weight.shape[0])
        y = self.coda_mlp(rows.contiguous(), dense.weight, b)["y"]
    return y.view(*x.shape[:-1], dense.weight.shape[0])
