"""Fused projection weights that keep their parts' state-dict keys.

``apply_to_llama`` fuses q, k and v (and gate and up) into one weight, re-laid out for its kernels
(RoPE's pairs, interleaved gate/up rows).  :func:`relayout` puts that weight in place of the
parts and hooks the owner's state dict, so that ``state_dict()`` still holds each part's HF key
and value and ``load_state_dict`` fuses an HF checkpoint back, into sharded (DTensor) parameters
too (:func:`placed_like`).  The parts' names stay as :class:`FusedPart` modules, which own no
parameters, read their rows and refuse to run: ``torch.distributed.checkpoint`` walks each
state-dict key to its module.  A part may be a dotted path (``q_proj.base_layer``: the base of a
LoRA layer, ``adapters.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .dropin import DTensor


class FusedWeight(nn.Module):
    """One fused projection weight and its bias, if the parts have biases, kept under
    ``<name>.weight`` and ``<name>.bias`` (the hooks give HF's keys back)."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool, bias: torch.Tensor | None = None,
                 bias_requires_grad: bool = True):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bias_requires_grad)


def relayout(module: nn.Module, fused: str, parts: tuple[str, ...], fuse: Any, split: Any) -> None:
    """Replace ``module.<parts>`` (Linears; a dotted path reaches a LoRA layer's ``base_layer``)
    by one FusedWeight ``module.<fused>``, and hook the state dict so that it keeps the parts'
    keys and values.  ``fuse`` and ``split`` map the parts' rows to the fused rows and back;
    biases (all parts' or none) follow their rows."""
    linears = [module.get_submodule(p) for p in parts]
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    with_bias = biases[0] is not None
    hooks = _FusedParts(fused, parts, fuse, split, with_bias)
    for p in parts:  # first: the fused module may take a part's name (Phi-3's qkv_proj, gate_up_proj)
        set_submodule(module, p, None)
    with torch.no_grad():
        bias = hooks.fuse_bias(*(b.detach() for b in biases)) if with_bias else None
        set_submodule(module, fused, FusedWeight(fuse(*(w.detach() for w in weights)), weights[0].requires_grad,
                                                  bias, with_bias and biases[0].requires_grad))
    module.register_state_dict_post_hook(_Hook(hooks.save))
    module.register_load_state_dict_pre_hook(_Hook(hooks.load))
    for i, p in enumerate(parts):
        if p != fused:
            set_submodule(module, p, FusedPart(module, hooks, i))


# A gated MLP's gate and up rows fused for its kernels, [g0, u0, g1, u1, ...] (adjacent GEMM columns
# are one pair), from two weights or from one in halves (Phi-3's gate_up_proj): ``relayout``'s fuse
# and split.
def interleave_rows(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.stack((g, u), dim=1).reshape(2 * g.shape[0], -1)


def split_interleaved(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w[0::2], w[1::2]


def interleave_halves(w: torch.Tensor) -> torch.Tensor:
    return interleave_rows(*w.chunk(2))


def halves_from_interleaved(w: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.cat((w[0::2], w[1::2])),)


def set_submodule(module: nn.Module, path: str, child: nn.Module | None) -> None:
    """``module.<path> = child`` for a dotted path; None deletes it."""
    parent, _, name = path.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    if child is None:
        delattr(owner, name)
    else:
        setattr(owner, name, child)


class FusedPart(nn.Module):
    """What stays under a fused part's name (``q_proj``, ``gate_proj``): no parameters of its own
    (the fused projection holds them), a ``weight`` and ``bias`` that read this part's rows of it
    (a detached copy, for reading).  The state dict's keys name the parts, and
    ``torch.distributed.checkpoint`` walks each key to its module (``get_model_state_dict``, the
    way FSDP2 training saves), so the names resolve.  Calling it is an error: the patched layer
    runs the fused projection."""

    def __init__(self, owner: nn.Module, hooks: "_FusedParts", index: int):
        super().__init__()
        # Not a child module (that would be a cycle): a plain reference, which copy and pickle keep.
        object.__setattr__(self, "_part_of", (owner, hooks, index))

    def _read(self, kind: str) -> torch.Tensor | None:
        owner, hooks, index = self._part_of
        value = getattr(owner.get_submodule(hooks.fused), kind)
        if value is None:
            return None
        with torch.no_grad():
            parts = hooks.split(value) if kind == "weight" else hooks.split_bias(value)
        return parts[index].detach()

    weight = property(lambda self: self._read("weight"))
    bias = property(lambda self: self._read("bias"))

    def forward(self, *args: Any) -> Any:
        owner, hooks, _ = self._part_of
        raise RuntimeError(f"{type(owner).__name__}: this projection is one part of the fused {hooks.fused!r} "
                           "(coda_agent.apply_to_llama); the patched layer runs that, not the part")


class _Hook:
    """A bound method as a module hook: torch tags each hook with an attribute, which a bound
    method does not take; pickle carries this object and its method alike."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class _FusedParts:
    """The state-dict hooks of one fused projection: ``save`` splits it into the parts' keys,
    ``load`` fuses the parts' keys back.  An object whose ``fuse`` and ``split`` are module-level
    functions (or partials of them), not closures, so that pickle (``torch.save(model)``) carries
    the patched model as it carries the unpatched one."""

    def __init__(self, fused: str, parts: tuple[str, ...], fuse: Any, split: Any, with_bias: bool):
        self.fused, self.parts, self.fuse, self.split = fused, parts, fuse, split
        self.kinds = ("weight", "bias") if with_bias else ("weight",)

    def fuse_bias(self, *bs: torch.Tensor) -> torch.Tensor:
        return self.fuse(*(b[:, None] for b in bs))[:, 0].contiguous()

    def split_bias(self, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, 0] for t in self.split(b[:, None]))

    def save(self, mod: nn.Module, state: dict, prefix: str, meta: Any) -> None:
        for kind in self.kinds:
            tensor = state.pop(f"{prefix}{self.fused}.{kind}").detach()
            unfused = self.split(tensor) if kind == "weight" else self.split_bias(tensor)
            for p, t in zip(self.parts, unfused):
                # Contiguous, as a Linear's own tensors are: save_pretrained's check for shared
                # storage reads each tensor's end through view(-1), which a strided row view fails.
                state[f"{prefix}{p}.{kind}"] = t.contiguous()

    def load(self, mod: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for kind in self.kinds:
            keys = [f"{prefix}{p}.{kind}" for p in self.parts]
            if all(k in state for k in keys):
                join = self.fuse if kind == "weight" else self.fuse_bias
                fused = join(*(state.pop(k) for k in keys))
                state[f"{prefix}{self.fused}.{kind}"] = placed_like(fused, getattr(mod.get_submodule(self.fused), kind))


def placed_like(value: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """``value`` laid out as ``param`` is across ranks.  A sharded model (FSDP2, tensor parallel)
    holds DTensor parameters, and loading copies into them only from DTensors: a checkpoint's
    full parts (``set_model_state_dict(full_state_dict=True)``) fuse into a full tensor, which is
    cut into the parameter's shards, and parts saved by a sharded model (replicated by the
    split's row permutation) fuse into a DTensor, which is moved to the parameter's placement."""
    if not isinstance(param, DTensor):
        return value
    from torch.distributed.tensor import distribute_tensor

    if isinstance(value, DTensor):
        return value.redistribute(param.device_mesh, param.placements)
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def column_major(weight: nn.Parameter) -> None:
    """Store an (in, out) weight (a Conv1D's; GPT-OSS's experts', (E, in, out)) with its columns
    contiguous, in place: ``weight.transpose(-1, -2)`` is then the row-major (out, in) tensor whose
    layout the kernels' weight gradients have, so autograd lands them in ``.grad`` without a copy
    (``gpt2``'s module docstring, Weights); the Parameter, its shape, values and state-dict key
    stay."""
    if not weight.transpose(-1, -2).is_contiguous():
        with torch.no_grad():
            weight.data = weight.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def interleave_expert_halves(w: torch.Tensor) -> torch.Tensor:
    """(E, 2I, H) experts' weights of gate then up (halves) -> each expert's rows interleaved."""
    return torch.stack(w.chunk(2, dim=1), dim=2).reshape(w.shape)


def expert_halves(w: torch.Tensor) -> torch.Tensor:
    """:func:`interleave_expert_halves` undone."""
    return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)


def reorder(module: nn.Module, name: str, to_kernel: Any, to_hf: Any) -> None:
    """Re-lay ``module.<name>``, a Parameter, for the kernels in place (the same Parameter object,
    so an optimizer built before the patch still holds it; patch before its first step) and hook
    the state dict so that it keeps HF's layout under the same key, loading included."""
    param = getattr(module, name)
    with torch.no_grad():
        param.data = to_kernel(param.data).contiguous()
    hooks = _Reordered(name, to_kernel, to_hf)
    module.register_state_dict_post_hook(_Hook(hooks.save))
    module.register_load_state_dict_pre_hook(_Hook(hooks.load))


class _Reordered:
    """The state-dict hooks of one re-laid Parameter (:func:`reorder`), picklable as
    :class:`_FusedParts` is."""

    def __init__(self, name: str, to_kernel: Any, to_hf: Any):
        self.name, self.to_kernel, self.to_hf = name, to_kernel, to_hf

    def save(self, mod: nn.Module, state: dict, prefix: str, meta: Any) -> None:
        key = f"{prefix}{self.name}"
        if key in state:
            state[key] = self.to_hf(state[key].detach()).contiguous()

    def load(self, mod: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        key = f"{prefix}{self.name}"
        if key in state:
            state[key] = placed_like(self.to_kernel(state[key]), getattr(mod, self.name))
