"""What the transformers drop-ins share: ``llama.py`` (:func:`apply_to_llama`) and ``gpt2.py``
(:func:`apply_to_gpt2`) patch a model *instance* the same way.

- A patched module's forward is a :class:`PatchedForward`, an object bound to the module rather
  than a closure or a bound method, so that ``copy.deepcopy`` and pickle carry it to the copy's
  own module.
- Each slot of a drop-in (a task it runs: ``out_proj_residual``, ``mlp_block``, ...) holds the
  suite's expert program (:func:`suite_kernel`) unless ``kernels={slot: ...}`` gives an accepted
  one: a run directory or a :class:`Kernel` of the slot's task or of one with its contract (the
  same inputs, params, outputs and gradients; :func:`slot_kernel`).
- The refusals every drop-in makes before it changes anything: a model already patched, a model
  wrapped by torch.compile, parameters that are not bf16 (the kernels are verified for bf16).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coda_agent.tasks import SUITE_DIR, load_task

from .kernel import Kernel, KernelError
from .source import load_kernel


@lru_cache(maxsize=None)
def suite_kernel(name: str, suite: Path = SUITE_DIR) -> Kernel:
    """The expert program of a suite's task (LLaMA-3's by default), as a Kernel."""
    task = load_task(suite / f"{name}.yaml")
    return Kernel.from_files(task.expert_path, task.path)


class PatchedForward:
    """A module's replacement forward, bound to it.  An object rather than a bound method,
    so that copy.deepcopy and pickle carry it over to the copy's own module."""

    def __init__(self, module: nn.Module, fn: Any):
        self.module, self.fn = module, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *args, **kwargs)


def check_slots(kernels: dict[str, Any] | None, slots: tuple[str, ...]) -> None:
    for name in sorted(set(kernels or {}) - set(slots)):
        raise KernelError(f"kernels: {name!r} is not a task the drop-in runs; it takes {list(slots)}")


def slot_kernel(slot: str, given: Kernel | str | Path | None, default: Kernel) -> Kernel:
    """The kernel for the drop-in's ``slot``: ``default`` (the suite's), or the one ``given``, of
    ``default``'s task or of one with its contract."""
    if given is None:
        return default
    kernel = given if isinstance(given, Kernel) else load_kernel(given)
    if kernel.name != default.name and (differs := contract_differs(kernel, default)):
        raise KernelError(f"kernels[{slot!r}] solves task {kernel.name!r}, whose contract is not that of "
                          f"{default.name!r}: {differs}")
    return kernel


def contract_differs(kernel: Kernel, slot: Kernel) -> str:
    """Where ``kernel``'s contract differs from ``slot``'s ("" where it does not)."""
    for what in ("inputs", "outputs", "gradients"):
        if getattr(kernel, what) != getattr(slot, what):
            return f"{what} {list(getattr(kernel, what))} against {list(getattr(slot, what))}"
    if set(kernel.params) != set(slot.params):
        return f"params {sorted(kernel.params)} against {sorted(slot.params)}"
    return ""


def refuse_patched(stack: nn.Module) -> None:
    """Refuse a decoder stack a drop-in has patched (its flags say how)."""
    flags = getattr(stack, "coda_flags", None)
    if flags is not None:
        raise KernelError(f"this model is already patched ({flags}); patch a fresh one")


def refuse_wrapped(model: Any, patch: str) -> None:
    """Refuse a model torch.compile wraps: its own modules are what the patch replaces."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise KernelError(f"this model is wrapped by torch.compile; patch the model itself first, then compile "
                          f"it: {patch}(model); model = torch.compile(model)")


# The modules of GPT-2's decoder stack (``GPT2Model``): how a drop-in tells a GPT-2 from other models.
GPT2_STACK = ("wte", "wpe", "h", "ln_f")


def require_bf16(model: nn.Module, patch: str) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.bfloat16}:
        raise KernelError(f"the model's parameters are {sorted(map(str, dtypes))}; the suite's kernels are "
                          f"verified for bf16: call model.to(torch.bfloat16) before {patch}")
