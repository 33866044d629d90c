"""When a catalogue launch may skip torch's dispatcher.

Every launch is a ``torch.library`` custom op (see gemm.py), so torch.compile
keeps it as one node and autograd sees the differentiable ones.  In eager mode
the op's Python machinery (schema defaults, the ADInplaceOrView and autograd
wrappers, Dynamo's disable guard) costs tens of microseconds per call
(bench/host_path.py measures the catalogue's host time per program call); a
block of a dozen launches pays it on every step, and a program over small
shapes (GPT-2 small, a RoPE backward of two thin GEMMs) is host-bound on it.

So a launch calls its op's body directly when nothing could tell the
difference: outside torch.compile and torch.jit.trace, with no
TorchDispatchMode active (fake tensors, FLOP counters, functionalisation see
every op), no functorch transform, plain tensors only (no subclass), and, for
an op with a derivative, nothing that needs one. The op would bump the version
counter of every tensor it mutates (autograd's check that a saved tensor was
not overwritten); :func:`mutated` does that on the direct path.
TorchFunctionModes see the catalogue function itself, not its op, either way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def direct(tensors: Iterable[object], *, differentiable: bool = False) -> bool:
    """Whether a launch over ``tensors`` (lists of them included) may run its op's body directly
    (see the module doc).
    ``differentiable``: the op has a registered derivative, so a tensor that requires grad
    under grad mode sends the call through autograd."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or torch._C._get_tracing_state() is not None \
            or torch._C._functorch.maybe_current_level() is not None:
        return False
    grad = differentiable and torch.is_grad_enabled()
    for value in tensors:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN_TYPES or (grad and t.requires_grad)):
                return False
    return True


def mutated(tensors: Iterable[torch.Tensor]) -> None:
    """What the op's ADInplaceOrView kernel does for the tensors it writes."""
    increment_version([t for t in tensors if isinstance(t, torch.Tensor)])
