"""The fused LM head and loss in a causal LM of any code, found by what its forward does.

``apply_to_llama`` and ``apply_to_model`` replace a causal LM's forward where it is code they know
(LLaMA's, Granite's, Mixtral's, Gemma-2's, Gemma-4's: ``families.CAUSAL_LMS``,
``modules.SOFTCAP_LMS``).  Most causal LMs' forwards are other code that does the same thing: the
decoder, ``logits = self.lm_head(h)``, perhaps a cast or a scale of the logits (Mamba's fp32,
Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``), then HF's causal-LM loss, and whatever the
forward adds after it (a router's load-balancing loss) or returns beside it (its own output class).
Here the forward stays the model's own, and only the step from head to loss changes:

- in training with labels the head's forward returns its input ``h`` (the rows the forward asked
  for) instead of the logits, so whatever the forward does to "the logits" it does to ``h``;
- the model's ``loss_function`` (HF's ``ForCausalLMLoss`` otherwise) then receives that tensor and
  runs the fused kernel (``lm_head_xent``; no logits exist) over it and the head's weight;
- the output goes back with ``logits`` None, as the known forwards' patched ones do.

That is HF's loss exactly when every map between head and loss commutes with the head, as a cast
and a scale by a constant do (``(s h) W^T = s (h W^T)``), and the head and loss are each called
once.  A probe checks it as the model is patched (:func:`probe`): the forward runs on a few tokens
(eval mode, no gradient) both ways, HF's logits scaled by ``PROBE_SCALES`` against the deferred
path's head input scaled alike (a power of two: a forward that only casts or scales gives the same
bits both ways), and the losses and logits must agree.  A soft-cap, a clamp, a slice of the
vocabulary or a loss computed by other code does not commute at the large scale, or calls the head
or the loss otherwise, and the head stays HF's, with the reason.  Not guaranteed: a forward that
branches on something the probe does not vary (the labels' values, a config flag changed after
patching).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.utils import ModelOutput

from .dropin import PatchedForward
from .kernel import Kernel, KernelError
from .llama_ops import IGNORE_INDEX, causal_lm_loss

PROBE_TOKENS = 4  # a few tokens: the probe runs the whole model four times, on the CPU too
# The logits of a config-built model are about 0.1-1: 1 keeps them so, 1024 puts them past any
# soft-cap (Gemma's 30) or clamp a forward might apply.  Powers of two: scaling is exact.
PROBE_SCALES = (1.0, 1024.0)
PROBE_RTOL = 1e-2  # a scale that is not a power of two (1 / logits_scaling) rounds bf16 logits apart


def probe(model: nn.Module) -> str | None:
    """None where ``model``'s forward hands its output embeddings' logits to HF's causal-LM loss
    through maps that commute with the head (see the module docstring), else why not."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__} has no output embeddings of nn.Linear"
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return f"its loss is {getattr(model, 'loss_type', None)!r}, not HF's causal-LM loss"
    if head.weight.device.type == "meta":
        return "its weights are on the meta device (patch it once they are loaded)"
    params = inspect.signature(type(model).forward).parameters
    if "labels" not in params:
        return f"{type(model).__name__}.forward takes no labels"
    if "forward" in head.__dict__:  # accelerate's hooks (a device map) set it on the instance, as the patch does
        return "its LM head's forward is replaced already (accelerate's hooks?)"
    ids = (torch.arange(PROBE_TOKENS, device=head.weight.device) * 7919 % head.weight.shape[0])[None]
    # no KV cache (nor a state-space model's, which some models size by their whole context)
    call = {"input_ids": ids, "labels": ids, **({"use_cache": False} if "use_cache" in params else {})}
    modes = {m: m.training for m in model.modules()}
    own_loss = model.__dict__.get("_loss_function")
    model.eval()
    try:
        with torch.no_grad():
            for scale in PROBE_SCALES:
                if (why := _compare(model, head, call, scale)) is not None:
                    return why
    except Exception as e:  # noqa: BLE001 - any failure of the probe keeps HF's head, and says why
        return f"its forward failed the head probe ({type(e).__name__}: {str(e)[:200]})"
    finally:
        head.__dict__.pop("forward", None)
        if own_loss is None:
            model.__dict__.pop("_loss_function", None)
        else:
            model._loss_function = own_loss
        for m, mode in modes.items():
            m.training = mode
    return None


def _compare(model: nn.Module, head: nn.Linear, call: dict[str, Any], scale: float) -> str | None:
    """HF's forward with the logits scaled by ``scale`` against the deferred path's (the head's
    input scaled, the loss taking the logits of what reaches it)."""
    calls = {"head": 0, "loss": 0}
    seen: list[torch.Tensor] = []

    def scaled_logits(h: torch.Tensor) -> torch.Tensor:
        calls["head"] += 1
        return F.linear(h, head.weight) * scale

    def deferred(h: torch.Tensor) -> torch.Tensor:
        calls["head"] += 1
        return h * scale

    def loss_of_reached(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        calls["loss"] += 1
        seen.append(logits)
        return ForCausalLMLoss(F.linear(logits.to(head.weight.dtype), head.weight), labels, vocab_size, **kwargs)

    head.forward = scaled_logits
    model.__dict__.pop("_loss_function", None)
    want = _loss_and_logits(type(model).forward(model, **call))
    if calls["head"] != 1:
        return f"its forward calls the LM head {calls['head']} times, not once"
    head.forward, model.loss_function = deferred, loss_of_reached
    got = _loss_and_logits(type(model).forward(model, **call))
    if calls["loss"] != 1 or seen[0].shape[-1] != head.in_features:
        return "its forward does not hand the LM head's logits to self.loss_function"
    reached = F.linear(seen[0].to(head.weight.dtype), head.weight).float()
    for what, a, b in (("loss", want[0], got[0]), ("logits", want[1], reached)):
        if a is None or a.shape != b.shape or (a.float() - b).abs().max() > PROBE_RTOL * (a.float().abs().max() + 1):
            return f"its forward maps the logits between the LM head and the loss (the {what} disagree in the probe)"
    return None


def _loss_and_logits(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if isinstance(out, ModelOutput):
        return out.get("loss"), out.get("logits")
    return (out[0], out[1]) if isinstance(out, tuple) and len(out) > 1 else (None, None)


def patch(model: nn.Module, xent: Kernel, xent_frozen: Kernel) -> None:
    """In training with labels, ``model``'s head and loss run as ``xent`` (``xent_frozen`` for a
    frozen head); ``model`` passed :func:`probe`."""
    head = model.get_output_embeddings()
    head.coda_defer = False
    head.forward = _HeadForward(head)
    model.loss_function = _DeferredLoss(head, xent, xent_frozen)
    params = list(inspect.signature(type(model).forward).parameters)
    model.coda_labels_at = params.index("labels") - 1  # where a positional call passes the labels
    model.forward = _DeferringForward(model, _deferring_forward)


class _HeadForward:
    """The output embeddings' forward: the logits, or in a deferred call the input itself."""

    def __init__(self, head: nn.Linear):
        self.head = head

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.head.coda_defer else F.linear(h, self.head.weight, self.head.bias)


class _DeferredLoss:
    """``model.loss_function``: HF's causal-LM loss, or in a deferred call the fused kernel over
    what reached it (the head's input, cast or scaled as the forward does to logits)."""

    def __init__(self, head: nn.Linear, xent: Kernel, xent_frozen: Kernel):
        self.head, self.xent, self.xent_frozen = head, xent, xent_frozen

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if not self.head.coda_defer:
            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
                                   **kwargs)
        if ignore_index != IGNORE_INDEX:
            raise KernelError(f"the fused LM head and loss ignores label {IGNORE_INDEX}, not {ignore_index}; pass "
                              "fused_linear_cross_entropy=False to keep HF's head and loss")
        w = self.head.weight
        return causal_lm_loss(logits.to(w.dtype), w, labels, shift_labels, self.xent, num_items_in_batch,
                              self.xent_frozen)


class _DeferringForward(PatchedForward):
    """The model's own forward, its head deferred to the loss in training with labels; the
    signature is the model's (HF's Trainer keeps the dataset columns the forward names)."""

    @property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(type(self.module).forward)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


def _deferring_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    at = self.coda_labels_at
    labels = kwargs.get("labels", args[at] if len(args) > at else None)
    if not (self.training and (labels is not None or kwargs.get("shift_labels") is not None)):
        return type(self).forward(self, *args, **kwargs)
    head = self.get_output_embeddings()
    head.coda_defer = True
    try:
        out = type(self).forward(self, *args, **kwargs)
    finally:
        head.coda_defer = False
    if isinstance(out, ModelOutput):  # "logits" holds the head's input: no logits were made
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return (out[0], None, *out[2:])
