"""What the transformers drop-ins share: ``llama.py`` (:func:`apply_to_llama`), ``gpt2.py``
(:func:`apply_to_gpt2`) and ``gpt_neox.py`` (:func:`apply_to_gpt_neox`) patch a model *instance*
the same way.

- LoRA adapters (peft) on the projections the kernels read run beside them (``adapters.py``).
- A patched module's forward is a :class:`PatchedForward`, an object bound to the module rather
  than a closure or a bound method, so that ``copy.deepcopy`` and pickle carry it to the copy's
  own module.
- Each slot of a drop-in (a task it runs: ``out_proj_residual``, ``mlp_block``, ...) holds the
  suite's expert program (:func:`suite_kernel`) unless ``kernels={slot: ...}`` gives an accepted
  one: a run directory or a :class:`Kernel` of the slot's task or of one with its contract (the
  same inputs, params, outputs and gradients; :func:`slot_kernel`).
- The refusals every drop-in makes before it changes anything: a model already patched, a model
  wrapped by torch.compile, parameters that are neither bf16 nor fp32 (the kernels are verified
  for bf16; fp32 master weights train under bf16 autocast, see :class:`PatchedForward`).
- What a patched layer owes HF's output capture: the attention weights (:func:`record_attention`).
- The two drop-ins built from the GPT-2 suite's kernels (``gpt2.py``, ``gpt_neox.py``: pre-LN
  blocks with LayerNorms, biases and a GELU MLP) share their block's plan (:class:`BlockPlan`, its
  kernels by slot: :func:`block_plan`), the GELU probe that picks the MLP kernel
  (:func:`gelu_form`, :func:`gelu_of`) and the refusals of what those kernels do not take
  (:func:`require_code`, :func:`require_children`, :func:`require_layer_norm`,
  :func:`check_lm_head`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed holds no sharded parameters
    DTensor = ()

from coda_agent.tasks import SUITE_DIR, SUITES, load_task

from .adapters import adapter_modules, check_lora, lora_of
from .kernel import Kernel, KernelError
from .source import load_kernel


@lru_cache(maxsize=None)
def suite_kernel(name: str, suite: Path = SUITE_DIR) -> Kernel:
    """The expert program of a suite's task (LLaMA-3's by default), as a Kernel."""
    task = load_task(suite / f"{name}.yaml")
    return Kernel.from_files(task.expert_path, task.path)


class PatchedForward:
    """A module's replacement forward, bound to it.  An object rather than a bound method,
    so that copy.deepcopy and pickle carry it over to the copy's own module.

    Mixed precision: a module with fp32 parameters (master weights) runs inside
    ``torch.autocast(dtype=torch.bfloat16)`` as its bf16 copy, the model the kernels are verified
    in: each fp32 parameter is cast to bf16 for the call (autograd carries its gradient back to
    the fp32 one, as autocast's own casts do), as is every fp32 tensor coming in (hidden states,
    RoPE's cos and sin, an additive mask, saturated to bf16's range as HF builds a bf16 model's
    mask).  The outermost patched module casts its subtree, so a patched causal LM (the fused loss)
    runs embeddings, norms and head in bf16 too.  Autocast stays on for HF's own ops inside, and a
    layer that FSDP2 gathers only when it runs casts its own parameters then; the kernels run with
    autocast off (``kernel.autocast_off``).  Under FSDP2's ``MixedPrecisionPolicy(param_dtype=
    torch.bfloat16)`` the parameters a forward sees are bf16 already."""

    def __init__(self, module: nn.Module, fn: Any):
        self.module, self.fn = module, fn

    @property
    def __signature__(self) -> inspect.Signature:
        """The replaced forward's parameters, as ``inspect.signature(module.forward)`` reads them
        from a bound method: HF's Trainer keeps only the dataset columns the forward names
        (``remove_unused_columns``), and would drop ``input_ids`` and ``labels`` for ``*args``."""
        sig = inspect.signature(self.fn)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_tables"}

    def _masters(self) -> dict[str, torch.Tensor]:
        """The module's fp32 parameters now, by name (a tied one once): read through its modules'
        parameter tables, found once (a call is on the hot path: walking a 32-layer model's names
        costs 0.5 ms on a CPU), whose entries FSDP2 and the casts below swap in place.  A DTensor
        is a parameter FSDP2 holds sharded until its own module's forward gathers it (in its
        MixedPrecisionPolicy's dtype): that forward's PatchedForward sees it then."""
        tables = self.__dict__.get("_tables")
        if tables is None:  # LoRA adapters' own parameters are no kernel's: they keep peft's dtype
            adapters = adapter_modules(self.module)
            tables = self._tables = [(f"{prefix}." if prefix else "", m._parameters)
                                     for prefix, m in self.module.named_modules()
                                     if m._parameters and id(m) not in adapters]
        found: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for prefix, table in tables:
            for name, p in table.items():
                if p is not None and p.dtype == torch.float32 and not isinstance(p, DTensor) and id(p) not in seen:
                    seen.add(id(p))
                    found[prefix + name] = p
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        master = self._masters()
        if not master:
            return self.fn(self.module, *args, **kwargs)
        device = next(iter(master.values())).device.type
        if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16):
            raise KernelError(f"{type(self.module).__name__} has fp32 parameters and runs outside "
                              f"torch.autocast({device!r}, dtype=torch.bfloat16); the kernels run bf16: train "
                              "under that autocast (fp32 master weights), or call model.to(torch.bfloat16)")
        lowered = {n: p.to(torch.bfloat16) for n, p in master.items()}
        args, kwargs = _bf16(args), {k: _bf16(v) for k, v in kwargs.items()}
        with _reparametrize_module(self.module, lowered, tie_weights=True):
            return self.fn(self.module, *args, **kwargs)


def _bf16(x: Any) -> Any:
    """fp32 tensors (in tuples and lists too) as bf16, saturated: an additive mask's fp32 minimum
    would round to -inf, and a row masked whole to NaN."""
    if isinstance(x, (tuple, list)):
        return type(x)(_bf16(v) for v in x)
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        big = torch.finfo(torch.bfloat16).max
        return x.clamp(-big, big).to(torch.bfloat16)
    return x


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
    """Refuse a model or decoder stack a drop-in has patched, whole or in part (the flags of the
    first patched module in it say how)."""
    flags = next((m.coda_flags for m in stack.modules() if hasattr(m, "coda_flags")), None)
    if flags is not None:
        raise KernelError(f"this model is already patched ({flags}); patch a fresh one")


def refuse_wrapped(model: Any, patch: str) -> None:
    """Refuse a model torch.compile wraps: its own modules are what the patch replaces."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise KernelError(f"this model is wrapped by torch.compile; patch the model itself first, then compile "
                          f"it: {patch}(model); model = torch.compile(model)")


# The modules of GPT-2's decoder stack (``GPT2Model``) and of GPT-NeoX's (``GPTNeoXModel``): how a
# drop-in tells those models from others (and points to the drop-in that patches them).
GPT2_STACK = ("wte", "wpe", "h", "ln_f")
GPT_NEOX_STACK = ("embed_in", "layers", "final_layer_norm")
LLAMA_STACK = ("embed_tokens", "layers", "norm", "rotary_emb")

# What a refusal of a model no drop-in of whole layers patches ends with: the way on.  apply_to_model's
# own refusals end with NO_KERNEL.
NO_KERNEL = ("; train it unpatched, or write tasks for its blocks (README, \"Write your own task\") and run "
             "the accepted kernels with coda_agent.kernels.load_kernel")
NO_DROP_IN = ("; coda_agent.apply_to_model(model) patches the modules of it that are a kernel's code (MLPs "
              "gated or not, LLaMA's or Gemma-2's LM head and loss), if any"
              + NO_KERNEL.replace("; train", "; else train", 1))


def has_modules(model: Any, names: tuple[str, ...]) -> bool:
    """Whether ``model`` holds a module under each of ``names`` (a decoder stack's)."""
    return all(isinstance(getattr(model, a, None), nn.Module) for a in names)


# Each drop-in's decoder stack: where its causal LM keeps it, its modules, the family, the drop-in.
STACKS = (("model", LLAMA_STACK, "LLaMA", "apply_to_llama"), ("transformer", GPT2_STACK, "GPT-2", "apply_to_gpt2"),
          ("gpt_neox", GPT_NEOX_STACK, "GPT-NeoX", "apply_to_gpt_neox"))


def refusal_hint(model: Any, patch: str, head: str = "", default: str = NO_DROP_IN) -> str:
    """How a refusal of ``model`` by ``patch`` (whose decoder stack it lacks) ends, naming the way
    on: unwrap a DataParallel, ``head`` (the caller's hint for a head over its own family's stack,
    where it has one), the drop-in whose stack it holds if that one takes it, else ``default``
    (after why the drop-in whose stack it holds refuses it too: StableLM holds LLaMA's stack and
    LayerNorms)."""
    if isinstance(getattr(model, "module", None), nn.Module):  # DataParallel, DistributedDataParallel
        return "; it wraps the model (model.module): patch the model itself first, then wrap it"
    if head:
        return head
    for attr, stack, family, other in STACKS:
        if other != patch and has_modules(getattr(model, attr, model), stack):
            why = refusal_by(other, model)
            if why is None:
                return f"; it is built like {family}: coda_agent.{other}(model) patches those"
            return f"; it is built like {family}, but coda_agent.{other} refuses it too ({why}){default}"
    return default


def refusal_by(patch: str, model: Any) -> str | None:
    """Why the drop-in ``patch`` refuses ``model`` even with every part it can keep HF's kept
    (the first clause of its refusal), or None where it takes it: its architecture check alone,
    which changes nothing."""
    from . import families, gpt2, gpt_neox  # those modules import this one

    check = {"apply_to_llama": lambda m: families.llama_architecture(m, keep_mlp=True),
             "apply_to_gpt2": lambda m: gpt2.gpt2_architecture(m, keep_mlp=True),
             "apply_to_gpt_neox": lambda m: gpt_neox.gpt_neox_architecture(m, layer_norm=False, keep_mlp=True)}
    try:
        check[patch](model)
    except KernelError as e:
        return str(e).split(";")[0].split(": the patched")[0]
    return None


def record_attention(weights: torch.Tensor | None) -> None:
    """Hand a patched layer's attention weights to transformers' output capture
    (``output_attentions=True``).  HF records them with a forward hook on the attention module,
    whose forward a patched layer does not call, so without this they would come back empty.  As
    HF's hook does, nothing is recorded where the implementation returns none (SDPA, flash)."""
    if weights is None:
        return
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capture: it records nothing either
        return
    collected = _active_collector.get()
    if collected is not None and "attentions" in collected:
        collected["attentions"].append(weights)


def require_kernel_dtypes(model: nn.Module, patch: str) -> None:
    """The kernels run bf16: a bf16 model, or fp32 master weights trained in mixed precision
    (``torch.autocast(dtype=torch.bfloat16)``, or FSDP2's ``MixedPrecisionPolicy(param_dtype=
    torch.bfloat16)``), which :class:`PatchedForward` runs as the bf16 model."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes <= {torch.bfloat16, torch.float32}:
        raise KernelError(f"the model's parameters are {sorted(map(str, dtypes))}; the suite's kernels are "
                          f"verified for bf16: call model.to(torch.bfloat16) before {patch}, or keep fp32 "
                          "master weights and train under torch.autocast(dtype=torch.bfloat16)")


# --------------------------------------------------------------------------- the GPT-2 suite's blocks

GPT2_SUITE = SUITES["gpt2"]
# The MLP block's task by the GELU the model runs.
MLP_TASKS = {"exact": "mlp_block", "tanh": "mlp_block_tanh"}
# The slots of a block built from the GPT-2 suite's kernels, and the fused LM head's.
GPT2_SLOTS = ("ln_qkv", "out_proj_residual", "mlp_block", "lm_head_xent", "lm_head_xent_frozen")


def xent_kernels(given: dict[str, Any]) -> tuple[Kernel, Kernel]:
    """The LM head + loss kernels: a trained head's (lm_head_xent) and a frozen one's
    (lm_head_xent_frozen, no weight gradient), the suite's or those ``given``."""
    return (slot_kernel("lm_head_xent", given.get("lm_head_xent"), suite_kernel("lm_head_xent")),
            slot_kernel("lm_head_xent_frozen", given.get("lm_head_xent_frozen"), suite_kernel("lm_head_xent_frozen")))


@dataclass(frozen=True)
class BlockPlan:
    """A pre-LN block's kernels, as its patched forward reads them: ``layer_norm`` (the first
    LayerNorm and the QKV projection as ln_qkv), ``mlp`` (the second LayerNorm, the MLP and its
    residual add as mlp_block); the attention output projection is always out_proj_residual."""

    layer_norm: bool
    mlp: bool
    ln_qkv: Kernel
    out_proj: Kernel
    mlp_block: Kernel


def block_plan(layer_norm: bool, mlp: bool, gelu: str | None, given: dict[str, Any]) -> BlockPlan:
    """The plan of every block: each slot's kernel, the GPT-2 suite's or the one ``given``; the MLP
    slot's task is the model's GELU's (``gelu``; None: mlp=False)."""
    mlp_default = suite_kernel(MLP_TASKS[gelu or "exact"], GPT2_SUITE)
    plan = BlockPlan(layer_norm, mlp,
                     slot_kernel("ln_qkv", given.get("ln_qkv"), suite_kernel("ln_qkv", GPT2_SUITE)),
                     slot_kernel("out_proj_residual", given.get("out_proj_residual"),
                                 suite_kernel("out_proj_residual", GPT2_SUITE)),
                     slot_kernel("mlp_block", given.get("mlp_block"), mlp_default))
    # The two GELUs' tasks share a contract, so the contract check lets either through: the task's
    # name tells them apart.
    if mlp and plan.mlp_block.name in MLP_TASKS.values() and plan.mlp_block.name != mlp_default.name:
        raise KernelError(f"kernels['mlp_block'] solves {plan.mlp_block.name!r}, whose GELU is not this model's "
                          f"({gelu}, task {mlp_default.name!r}): give a kernel of {mlp_default.name!r}")
    return plan


GELUS = {"exact": F.gelu, "tanh": lambda x: F.gelu(x, approximate="tanh")}
# Where the activation modules that a site found by a rule on the code may apply are defined (a
# model's own are passed by: their code, not a probe, says what they compute)
ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def library_activation(act: Any) -> bool:
    """Whether ``act`` is one of torch's or transformers' activation modules, without parameters
    or buffers (a PReLU that starts as ReLU does not stay one)."""
    return (isinstance(act, nn.Module) and type(act).__module__ in ACTIVATION_MODULES
            and not any(True for _ in (*act.parameters(), *act.buffers())))


def activation_form(act: nn.Module, forms: dict[str, Any]) -> str | None:
    """Which of ``forms`` (name -> function) an activation module computes, probed once in fp64;
    None: none of them.  The probe reaches past [-6, 6] to +-1e4, where activations that agree
    with a form near zero clip (ReLU6 is ReLU up to 6, transformers' ``gelu_10`` the exact GELU up
    to 10): a pre-activation of a trained model goes there.  An activation with parameters or
    buffers (PReLU: its slope trains) computes no fixed form, and one that fails on the probe none
    of these.  The probe is made per call: the package keeps no tensor between calls
    (tests/test_cuda_graphs.py)."""
    if any(True for _ in (*act.parameters(), *act.buffers())):
        return None
    wide = torch.logspace(0.5, 4.0, 36, dtype=torch.float64)
    probe = torch.cat([-wide.flip(0), torch.linspace(-6.0, 6.0, 241, dtype=torch.float64), wide])
    try:
        with torch.no_grad():
            got = act(probe.clone())
    except Exception:  # noqa: BLE001 - an activation that cannot run on the probe is none of the forms
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    return next((k for k, fn in forms.items() if torch.allclose(got, fn(probe), rtol=1e-12, atol=1e-9)), None)


def gelu_form(act: nn.Module) -> str | None:
    """Which GELU an activation module computes, "exact" or "tanh" (HF writes the tanh form three
    ways: gelu_new, gelu_pytorch_tanh, gelu_fast); None: neither."""
    return activation_form(act, GELUS)


def check_mlp_projection(m: Any, where: str, task: str, flag: str, linears: tuple[type, ...] = (nn.Linear,),
                         runs: str = "the whole MLP") -> None:
    """Refuse, naming ``flag`` as the way to keep HF's MLPs, an MLP projection (at ``where``) whose
    weight the kernel of ``task`` (which ``runs`` it) cannot read: a LoRA layer, or a module not of
    ``linears``."""
    if lora_of(m) is not None:
        raise KernelError(f"{where} has LoRA adapters, and the {task} kernel runs {runs}; pass "
                          f"{flag} to keep HF's MLPs (the adapters train there)")
    if type(m) not in linears:
        raise KernelError(f"{where} is {type(m).__name__}, not nn.Linear: the {task} kernel reads its "
                          f"weight; patch the unwrapped bf16 model, or pass {flag}")


def check_mlp_widths(where: str, width: int, inter: int, flag: str) -> None:
    """Refuse an MLP whose widths are no GEMM's: rows of a multiple of 16 bytes."""
    if width % 8 or inter % 8:
        raise KernelError(f"{where}: hidden size {width} and intermediate size {inter} must be multiples of 8 (a "
                          f"GEMM row of 16 bytes); pass {flag} to keep HF's MLPs")


def gelu_of(act: nn.Module, where: str, setting: str, patch: str, units: str, so_far: str | None) -> str:
    """The GELU the activation module ``act`` (at ``where``; the config's ``setting``) computes,
    which the MLP kernel follows; refused where it is neither form, or not the one the earlier
    ``units`` (blocks, layers) run (``so_far``)."""
    form = gelu_form(act)
    if form is None:
        raise KernelError(f"{where} ({type(act).__name__}, {setting}) is neither the exact GELU nor its tanh "
                          "approximation, the MLP kernels' two activations; pass mlp=False to keep HF's MLP")
    if so_far not in (None, form):
        raise KernelError(f"the {units} mix the exact GELU and its tanh approximation; {patch} runs one MLP "
                          "kernel; pass mlp=False to keep HF's MLPs")
    return form


def require_code(module: Any, want: Any, what: str, family: str, model: str, patch: str) -> None:
    """Refuse a ``module`` whose forward is not ``family``'s ``what`` (``want``), compared as code
    (``families.same_code``): the patch would replace it with that one."""
    from .families import same_code  # here, not at the top: families imports this module

    if not isinstance(module, nn.Module) or not same_code(type(module).forward, want):
        raise KernelError(f"{type(module).__name__}.forward computes something other than {family}'s {what} "
                          f"({model} is not {family}); {patch} would replace it with {family}'s{NO_DROP_IN}")


def require_children(module: nn.Module, want: frozenset[str], where: str, family: str, part: str,
                     unit: str) -> None:
    """Refuse a ``module`` whose submodules are not ``family``'s ``part``'s: the patched ``unit``
    computes that one's, so the model would lose what differs."""
    if set(dict(module.named_children())) != want:
        extra = sorted(set(dict(module.named_children())) ^ want)
        raise KernelError(f"{where}: {type(module).__name__} differs from {family}'s {part} in {extra}: the "
                          f"patched {unit} computes {family}'s, so this model would lose that part{NO_DROP_IN}")


def require_layer_norm(ln: Any, where: str) -> None:
    if type(ln) is not nn.LayerNorm or ln.weight is None or ln.bias is None:
        raise KernelError(f"{where} is not an nn.LayerNorm with a weight and a bias, which the kernels fold into "
                          "their GEMMs")


def check_lm_head(head: Any) -> None:
    """Refuse an LM head the fused LM head and loss (lm_head_xent) does not take, naming the fix."""
    check_lora(head, "lm_head", "the fused LM head and loss (lm_head_xent) reads its weight alone: pass "
               "fused_linear_cross_entropy=False")
    if type(head) is not nn.Linear or head.bias is not None:
        what = f"is {type(head).__name__}, not nn.Linear" if type(head) is not nn.Linear else "has a bias"
        raise KernelError(f"lm_head {what}: the fused LM head and loss (lm_head_xent) reads lm_head.weight alone; "
                          "pass fused_linear_cross_entropy=False to keep HF's LM head and loss")
    if head.weight.shape[0] % 8:
        raise KernelError(f"the vocabulary has {head.weight.shape[0]} tokens, not a multiple of 8: the fused LM "
                          "head's logits chunk needs rows of a multiple of 16 bytes. Pad it as nanoGPT pads "
                          "GPT-2's 50257 to 50304 (model.resize_token_embeddings(pad_to_multiple_of=64); the "
                          "new tokens join the softmax) or pass fused_linear_cross_entropy=False")
