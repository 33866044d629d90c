"""Which transformers models ``apply_to_llama`` can patch, read from their code.

A model qualifies when every module whose forward the patch replaces (the decoder layer, the
RMSNorms, the MLP where ``swiglu`` replaces it, the causal LM's loss path) runs the instructions
of its family's, compared as code objects together with the module-level helpers they call
(:func:`same_code`: transformers' families copy LLaMA's modules under other class names, and a
copy may call a helper of the same name that differs, which the refusal names:
:func:`differing_global`), and each module holds the submodules its family's does.
RoPE runs in the QKV epilogue only where the rotary tables are LLaMA's and the attention's own
rotation turns LLaMA's halves of a head or interleaved pairs, on a probe (:func:`tables_are_llamas`,
:func:`rotation_layout`); elsewhere it stays HF's, through the rotation the attention itself calls
(which may be any: the attention's code is compared with that name left free, :data:`ROTATION`).  A family
(:class:`Family`, ``_FAMILIES``) is told by its attention's code and then its decoder layer's;
the RMSNorms are LLaMA's (scale w) or Gemma's (scale 1 + w).  What a family does beyond LLaMA's
is one layer's :class:`AttentionPlan`, which the patched forwards read.  So a model with extra
norms (Gemma-2, OLMo-2), softcapped logits or LayerNorms (Cohere) is refused by what differs,
instead of training silently wrong; :func:`check_model` refuses what a known family may still
hold that the kernels do not take (dtypes, MLP biases, residual dropout, RoPE scaling, parts of
one fused weight frozen apart, an LM head with a bias).
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.granite.modeling_granite import GraniteDecoderLayer, GraniteForCausalLM
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1Attention
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                                      LlamaRMSNorm, apply_rotary_pos_emb)
from transformers.models.ministral3 import modeling_ministral3 as ministral3
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralForCausalLM
from transformers.models.phi3 import modeling_phi3 as phi3
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
from transformers.models.seed_oss.modeling_seed_oss import SeedOssAttention, SeedOssMLP
from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention

from .adapters import linear_of, require_projection
from .dropin import (LLAMA_STACK, NO_DROP_IN, check_lm_head, has_modules, refusal_hint, refuse_wrapped,
                     require_kernel_dtypes)
from .kernel import KernelError

STATIC_ROPE = ("default", "linear", "llama3")
ROTATION = frozenset({"apply_rotary_pos_emb"})  # the attention's rotation, which the patched layer calls as its own


@dataclass(frozen=True)
class AttentionPlan:
    """What a layer does beyond LLaMA's, as the patched forwards read it:

    - ``qk_norm``: per-head RMSNorms of q and k (the attention's ``qk_norms`` submodules), before
      RoPE (Qwen3's q_norm, k_norm) or, with ``norm_after_rope``, after it (Hunyuan's
      query_layernorm and key_layernorm);
    - ``window``: a sliding window (Mistral's; Qwen2's and Qwen3's sliding layers);
    - ``fused``: q, k and v in one projection and gate and up in another (Phi-3's layout);
    - ``rotary``: the rotation the attention's own code calls (its module's
      ``apply_rotary_pos_emb``), which the patched layer calls where RoPE stays HF's;
    - ``residual_scale``: what each sublayer adds to the residual stream is scaled (Granite's
      ``residual_multiplier``);
    - ``rotates``: whether the layer applies RoPE at all (SmolLM3's layers without position
      encoding do not);
    - ``query_scale``: position ids -> a multiplier of each token's q after RoPE (Ministral 3's
      LLaMA-4 attention scaling), or None."""

    qk_norm: bool = False
    norm_after_rope: bool = False
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")
    window: int | None = None
    fused: bool = False
    rotary: Any = apply_rotary_pos_emb
    residual_scale: float = 1.0
    rotates: bool = True
    query_scale: Any = None


def head_dim(cfg: Any) -> int:
    """A config's head width (its ``head_dim``, else hidden_size / heads)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@dataclass(frozen=True)
class Family:
    """A model family the patched layer stands in for, told by its attention's code and then its
    decoder layer's: the forwards of the modules the patch replaces, each module's submodules, and
    the plan of a layer."""

    attention: Any
    layer: Any
    mlp: Any  # None: a mixture of experts, which stays HF's (swiglu=False)
    children: dict[str, frozenset[str]]
    plan: Any  # the attention module -> its AttentionPlan
    norms: tuple[str, ...] = ()  # the attention's RMSNorms, kept HF's (Qwen3's q/k norms)


# An RMSNorm's forward -> the offset of its scale: LLaMA's multiplies by w, Helium's by w in fp32
# before rounding (the kernels' order: they scale in fp32), Gemma's by 1 + w (in fp32).
_NORM_OFFSETS = {LlamaRMSNorm.forward: 0.0, HeliumRMSNorm.forward: 0.0, GemmaRMSNorm.forward: 1.0}

_LLAMA_CHILDREN = {"layer": frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}),
                   "self_attn": frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
                   "mlp": frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})}


def _mistral_plan(attn: nn.Module) -> AttentionPlan:
    return AttentionPlan(window=getattr(attn.config, "sliding_window", None))


def _attention_global(attn: nn.Module, name: str, default: Any = None) -> Any:
    """What ``name`` is bound to in the module of ``attn``'s forward (its own rotation, a helper)."""
    return inspect.unwrap(type(attn).forward).__globals__.get(name, default)


def _ministral3_plan(attn: nn.Module) -> AttentionPlan:
    """Ministral 3's: the config's window, and q scaled per position after RoPE as its attention
    scales it (``get_llama_4_attn_scale`` of the attention's own module)."""
    rope = attn.config.rope_parameters
    beta, span = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    scale = _attention_global(attn, "get_llama_4_attn_scale")
    return AttentionPlan(window=getattr(attn.config, "sliding_window", None),
                         query_scale=lambda position_ids: scale(position_ids, beta, span))


def _phi3_plan(attn: nn.Module) -> AttentionPlan:
    return dataclasses.replace(_mistral_plan(attn), fused=True)


# Whose layer -> its family, told by the attention's code and then the decoder layer's.  Mistral,
# Qwen2, Qwen3 and SmolLM3 (whose layers may skip RoPE) copy LLaMA's decoder layer, RMSNorm and
# MLP; Granite copies LLaMA's attention and MLP and scales what each sublayer adds to the residual
# stream; Phi-3 fuses the projections, keeps residual dropouts and may rotate part of each head;
# Seed-OSS is LLaMA's with a residual dropout after its attention's and its MLP's output
# projections (which :func:`check_model` requires off).
# The decoder stack's own forward stays the model's (embeddings and their multiplier, masks, the
# final norm).
_FAMILIES = {
    "LLaMA's": Family(LlamaAttention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward, _LLAMA_CHILDREN,
                      lambda attn: AttentionPlan()),
    "Mistral's": Family(MistralAttention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward, _LLAMA_CHILDREN,
                        _mistral_plan),
    "Ministral 3's": Family(ministral3.Ministral3Attention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward,
                            _LLAMA_CHILDREN, _ministral3_plan),
    "Qwen3's": Family(Qwen3Attention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward,
                      {**_LLAMA_CHILDREN, "self_attn": _LLAMA_CHILDREN["self_attn"] | {"q_norm", "k_norm"}},
                      lambda attn: AttentionPlan(qk_norm=True, window=attn.sliding_window), ("q_norm", "k_norm")),
    "Qwen2's": Family(Qwen2Attention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward, _LLAMA_CHILDREN,
                      lambda attn: AttentionPlan(window=attn.sliding_window)),
    "SmolLM3's": Family(SmolLM3Attention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward, _LLAMA_CHILDREN,
                        lambda attn: AttentionPlan(window=attn.sliding_window, rotates=bool(attn.use_rope))),
    "Granite's": Family(LlamaAttention.forward, GraniteDecoderLayer.forward, LlamaMLP.forward, _LLAMA_CHILDREN,
                        lambda attn: AttentionPlan(residual_scale=float(attn.config.residual_multiplier))),
    "Phi-3's": Family(phi3.Phi3Attention.forward, phi3.Phi3DecoderLayer.forward, phi3.Phi3MLP.forward,
                      {"layer": _LLAMA_CHILDREN["layer"] | {"resid_attn_dropout", "resid_mlp_dropout"},
                       "self_attn": frozenset({"qkv_proj", "o_proj"}),
                       "mlp": frozenset({"gate_up_proj", "down_proj", "activation_fn"})}, _phi3_plan),
    # Hunyuan's dense models: LLaMA's modules, with per-head RMSNorms of q and k after RoPE.
    "Hunyuan's": Family(HunYuanDenseV1Attention.forward, LlamaDecoderLayer.forward, LlamaMLP.forward,
                        {**_LLAMA_CHILDREN,
                         "self_attn": _LLAMA_CHILDREN["self_attn"] | {"query_layernorm", "key_layernorm"}},
                        lambda attn: AttentionPlan(qk_norm=True, norm_after_rope=True,
                                                   qk_norms=("query_layernorm", "key_layernorm")),
                        ("query_layernorm", "key_layernorm")),
    "Seed-OSS's": Family(SeedOssAttention.forward, LlamaDecoderLayer.forward, SeedOssMLP.forward, _LLAMA_CHILDREN,
                         lambda attn: AttentionPlan()),
    # Mixtral: Mistral's attention, a decoder layer that computes LLaMA's (its arguments in another
    # order) around a mixture of experts.  Qwen3-MoE is Qwen3's family with such an MLP.
    "Mixtral's": Family(MistralAttention.forward, MixtralDecoderLayer.forward, None,
                        {k: v for k, v in _LLAMA_CHILDREN.items() if k != "mlp"}, _mistral_plan),
}

# The causal LMs whose forward the patch replaces in training (the LM head and loss): LLaMA's;
# Granite's, which divides the logits; the mixtures of experts' (Mixtral's, and Qwen3-MoE's and
# Qwen2-MoE's, which are its code), which add the router's load-balancing loss.
CAUSAL_LMS = {"LLaMA's": LlamaForCausalLM.forward, "Granite's": GraniteForCausalLM.forward,
              "Mixtral's": MixtralForCausalLM.forward}


@lru_cache(maxsize=None)  # every layer of a model asks the same few questions of the same classes
def same_code(fn: Any, want: Any, free: frozenset[str] = frozenset()) -> bool:
    """Whether two functions compute the same thing, as far as their code shows: the same
    instructions on the same names and constants, their docstrings aside, nested code objects
    alike, and every global they name bound to the same object in both modules, or to
    functions that are the same code in turn.  transformers' model families copy LLaMA's modules
    under other class names (Mistral's decoder layer, RMSNorm and MLP are LLaMA's code); the
    globals matter because a copied forward may call a helper of the same name that differs
    (Ernie 4.5's attention is LLaMA's bytecode, its ``apply_rotary_pos_emb`` rotates interleaved
    pairs).  The module-level names in ``free`` may be bound to anything in ``fn``'s module:
    the caller runs ``fn``'s own binding of them (the attention's rotation, :data:`ROTATION`)."""
    return _differs(fn, want, frozenset(), free) is None


def differing_global(fn: Any, want: Any, free: frozenset[str] = frozenset()) -> str:
    """Where :func:`same_code` finds two functions different: the module-level name (a helper
    such as ``eager_attention_forward``) whose binding differs while the instructions are alike,
    or "" where the instructions themselves differ."""
    return _differs(fn, want, frozenset(), free) or ""


def _differs(fn: Any, want: Any, seen: frozenset, free: frozenset = frozenset()) -> str | None:
    """None where ``fn`` is ``want``'s code (see :func:`same_code`); else "" where the instructions
    differ, or the name of the first global whose binding differs (those in ``free`` aside)."""
    def consts(c: Any) -> tuple:
        # A docstring is the first constant, which no instruction loads.
        used = {i.arg for i in dis.get_instructions(c) if i.opname in ("LOAD_CONST", "RETURN_CONST")}
        return c.co_consts[1:] if c.co_consts[:1] and isinstance(c.co_consts[0], str) and 0 not in used \
            else c.co_consts

    def same(a: Any, b: Any) -> bool:
        ca, cb = consts(a), consts(b)
        return (a.co_code == b.co_code and a.co_names == b.co_names and len(ca) == len(cb)
                and all(same(x, y) if hasattr(x, "co_code") and hasattr(y, "co_code")
                        else type(x) is type(y) and x == y for x, y in zip(ca, cb)))

    f, w = inspect.unwrap(fn), inspect.unwrap(want)
    a, b = getattr(f, "__code__", None), getattr(w, "__code__", None)
    if a is None or b is None or not same(a, b):
        return ""
    if f is w or (a, b) in seen:
        return None
    seen = seen | {(a, b)}
    ga, gb = getattr(f, "__globals__", {}), getattr(w, "__globals__", {})
    for name in sorted(_global_names(a) - free):
        x, y = ga.get(name, _MISSING), gb.get(name, _MISSING)
        if x is y:
            continue
        if not (inspect.isfunction(x) and inspect.isfunction(y) and _differs(x, y, seen) is None):
            return name
    return None


_MISSING = object()


def _global_names(code: Any) -> set[str]:
    """The names a code object (and those nested in it) loads as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            names |= _global_names(c)
    return names


def llama_architecture(model: nn.Module, keep_mlp: bool = False) -> tuple[nn.Module, str, list[AttentionPlan], float]:
    """(the decoder stack, whose causal LM ``model`` is (:data:`CAUSAL_LMS`; "" for a decoder stack
    alone), each layer's attention plan, the offset of its RMSNorms' scale) for a model whose every
    module the patch replaces computes what its family's does (``_FAMILIES``); the layers'
    RMSNorms are LLaMA's (scale w) or Gemma's (scale 1 + w, in fp32), all alike.  ``keep_mlp``
    (``swiglu=False``): the MLPs stay HF's, so they may be anything a layer calls as ``mlp``, a
    mixture of experts included.  Anything else (extra norms, logit caps, LayerNorms) is refused by
    name, since the patched forwards would silently drop it."""
    refuse_wrapped(model, "apply_to_llama")
    causal_lm = hasattr(model, "lm_head") and isinstance(getattr(model, "model", None), nn.Module)
    base = model.model if causal_lm else model

    if not has_modules(base, LLAMA_STACK):
        inner = next((n for n, m in model.named_children() if has_modules(m, LLAMA_STACK)), None)
        head = (f"; its head is not a causal LM's lm_head: patch its decoder stack, apply_to_llama(model.{inner}), "
                "and the head stays HF's") if inner is not None else ""  # a classification or QA head
        raise KernelError(f"apply_to_llama patches a transformers LlamaForCausalLM or LlamaModel (or a model "
                          f"family built from LLaMA's modules, such as Mistral or Qwen3); got "
                          f"{type(model).__name__}{refusal_hint(model, 'apply_to_llama', head)}")
    checks = []
    lm = ""
    if causal_lm:
        lm = next((k for k, fn in CAUSAL_LMS.items() if same_code(type(model).forward, fn)), "LLaMA's")
        checks.append(("causal LM", model, CAUSAL_LMS[lm], lm))
    attentions: list[AttentionPlan] = []
    offsets: set[float] = set()
    unknown_norm = None  # the first RMSNorm that is neither LLaMA's nor Gemma's
    for layer in base.layers:
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, nn.Module):
            raise KernelError(f"{type(layer).__name__} has no self_attn module; apply_to_llama patches decoder "
                              f"layers of LLaMA's shape{NO_DROP_IN}")
        # The attention's own rotation may be any: the patched layer calls it wherever RoPE stays
        # HF's, and fuses RoPE into the QKV epilogue only where a probe finds a rotation the epilogue
        # computes (rotation_layout), so a copy of LLaMA's attention with an interleaved rotation
        # (Helium's, Ernie 4.5's) is that family.
        kinds = [k for k, f in _FAMILIES.items() if same_code(type(attn).forward, f.attention, ROTATION)]
        if not kinds:
            firsts = {}  # families that share an attention are named once, by the first of them
            for k, f in _FAMILIES.items():
                firsts.setdefault(f.attention, k)
            # A copy of a family's attention that calls a helper of its own (other than its rotation)
            # is named by that helper: its forward reads as the family's.
            helpers = ((k, differing_global(type(attn).forward, f, ROTATION)) for f, k in firsts.items())
            kind, helper = next(((k, h) for k, h in helpers if h), ("", ""))
            if helper:
                home = _attention_global(attn, "__name__", "its module")
                raise KernelError(f"{type(attn).__name__}.forward is the code of {kind} attention, but the {helper} "
                                  f"it calls ({home}) differs from {kind}: the patched layer would compute {kind} "
                                  "instead")
            known = list(firsts.values())
            raise KernelError(f"{type(attn).__name__}.forward is not {', '.join(known[:-1])} or {known[-1]} "
                              f"attention; the patched layer would drop what it adds{NO_DROP_IN}")
        # Families that share an attention (LLaMA's, Granite's) differ in their decoder layer.
        kind = next((k for k in kinds if same_code(type(layer).forward, _FAMILIES[k].layer)), kinds[0])
        family = _FAMILIES[kind]
        if family.mlp is None and not keep_mlp:
            raise KernelError(f"{type(layer.mlp).__name__} is a mixture of experts, which the MLP block kernel "
                              "(mlp_block) is not; pass swiglu=False to keep HF's MLP (the attention side and the "
                              "LM head are still patched)")
        for part, want in family.children.items():
            if part == "mlp" and keep_mlp:
                continue
            module = layer if part == "layer" else getattr(layer, part)
            if set(dict(module.named_children())) != want:
                extra = sorted(set(dict(module.named_children())) ^ want)
                hint = "; pass swiglu=False to keep this model's own MLP" if part == "mlp" else ""
                raise KernelError(f"{type(module).__name__} differs from {kind} {part} in {extra}: the patched "
                                  f"layer computes that one's, so this model would lose that part"
                                  f"{hint or NO_DROP_IN}")

        def whose(fn: Any) -> str:
            return "LLaMA's" if fn in (LlamaDecoderLayer.forward, LlamaMLP.forward) else kind

        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            offset = next((o for fn, o in _NORM_OFFSETS.items() if same_code(type(norm).forward, fn)), None)
            if offset is None:
                unknown_norm = unknown_norm or norm
            else:
                offsets.add(offset)
        checks += [("decoder layer", layer, family.layer, whose(family.layer)),
                   *([] if keep_mlp else [("MLP", layer.mlp, family.mlp, whose(family.mlp))]),
                   *(("RMSNorm", getattr(attn, name), LlamaRMSNorm.forward, "LLaMA's") for name in family.norms)]
        rotary = _attention_global(attn, "apply_rotary_pos_emb", apply_rotary_pos_emb)
        attentions.append(dataclasses.replace(family.plan(attn), rotary=rotary))
    if unknown_norm is not None:
        raise KernelError(f"{type(unknown_norm).__name__}.forward computes something other than LLaMA's RMSNorm (or "
                          f"Gemma's, 1 + w) ({type(model).__name__} is not a LLaMA-architecture model); "
                          f"apply_to_llama would replace it with LLaMA's{NO_DROP_IN}")
    if len(offsets) > 1:
        raise KernelError("the layers mix LLaMA's and Gemma's RMSNorms; apply_to_llama patches one kind")
    for what, module, want, owner in checks:
        if not same_code(type(module).forward, want):
            raise KernelError(f"{type(module).__name__}.forward computes something other than {owner} {what} "
                              f"({type(model).__name__} is not a LLaMA-architecture model); apply_to_llama "
                              f"would replace it with {owner}")
    return base, lm, attentions, offsets.pop() if offsets else 0.0


def _llama_tables(inv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = pos.double()[..., None] * inv.double()
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


_PROBE_POSITIONS = (0, 1, 7, 4093)


def _rotate_pairs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RoPE on interleaved pairs (x[2i], x[2i + 1]) at LLaMA's frequencies (GPT-J's and GLM's layout,
    Ernie 4.5's and Helium's rotation), from LLaMA's tables (both halves alike)."""
    half = cos.shape[-1] // 2
    c, s = (t[:, None, :, :half].repeat_interleave(2, dim=-1) for t in (cos, sin))

    def turn(x: torch.Tensor) -> torch.Tensor:
        return x * c + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * s

    return turn(q), turn(k)


# The rotations the QKV epilogue reproduces, by the layout of each head's columns: the epilogue
# rotates adjacent pairs, so LLaMA's halves are permuted into pairs in the fused weight's rows,
# and interleaved pairs are its own layout.
ROTATIONS = {"halves": apply_rotary_pos_emb, "pairs": _rotate_pairs}


def rotation_layout(base: nn.Module, attentions: list[AttentionPlan]) -> str | None:
    """Which of :data:`ROTATIONS` every attention's own rotation computes (None: another, or
    they differ), probed on random q and k with LLaMA's tables: LLaMA's whole-head halves
    (Phi-3's function, which also rotates part of a head, agrees on whole heads), or interleaved
    pairs (Ernie 4.5's, Helium's)."""
    inv = getattr(getattr(base, "rotary_emb", None), "inv_freq", None)  # Mellum's rotary keeps no table
    if not isinstance(inv, torch.Tensor) or inv.numel() * 2 != head_dim(base.config):
        return None
    inv = inv.detach().float().cpu()
    pos = torch.tensor([_PROBE_POSITIONS])
    cos, sin = (t.float() for t in _llama_tables(inv, pos))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, len(_PROBE_POSITIONS), inv.numel() * 2, generator=gen) for _ in range(2))
    layouts = set()
    for rotary in {a.rotary for a in attentions}:
        try:
            got = rotary(q, k, cos, sin)
        except (RuntimeError, ValueError, IndexError):
            return None
        layouts.add(next((name for name, rotate in ROTATIONS.items()
                          if all(torch.allclose(g.float(), w, atol=1e-5) for g, w in zip(got, rotate(q, k, cos, sin)))),
                         None))
    return layouts.pop() if len(layouts) == 1 else None


def tables_are_llamas(base: nn.Module) -> bool:
    """Whether the rotary embedding gives LLaMA's tables, ``cos(pos * inv_freq)`` and ``sin``
    over both halves of a head (what the QKV epilogue computes from ``inv_freq``), checked on a
    few positions: the families' rotary forwards differ in code, not in these values."""
    rotary = base.rotary_emb
    inv = rotary.inv_freq.detach().float()
    pos = torch.tensor([_PROBE_POSITIONS], device=inv.device)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, device=inv.device), pos)
    want_cos, want_sin = _llama_tables(inv, pos)
    return bool(torch.allclose(cos.double(), want_cos, atol=1e-5) and torch.allclose(sin.double(), want_sin, atol=1e-5))


def check_model(model: nn.Module, base: nn.Module, cfg: Any, rope: bool, swiglu: bool, xent: bool = False) -> None:
    """Refuse, naming the fix, what a model of a known family may hold that the kernels chosen by
    the flags do not take: other dtypes, residual dropout, MLP biases, biases on some of q/k/v
    only, parts of one fused weight frozen apart, an activation other than SwiGLU's, RoPE beyond a
    static frequency table, an LM head that is more than its weight or whose vocabulary the fused
    LM head's logits chunk cannot lay out (``xent``: the fused LM head and loss runs)."""
    require_kernel_dtypes(model, "apply_to_llama")
    for i, layer in enumerate(base.layers):
        for part in ("self_attn", "mlp") if swiglu else ("self_attn",):  # swiglu=False: the MLP stays HF's
            for name, m in getattr(layer, part).named_children():
                if name.endswith("_proj"):
                    require_projection(m, f"layers.{i}.{part}.{name}", nn.Linear, "nn.Linear",
                                       "swiglu" if part == "mlp" else "")
        dropped = [n for n in ("resid_attn_dropout", "resid_mlp_dropout") if getattr(layer, n, None) is not None
                   and getattr(layer, n).p > 0]
        if dropped:
            raise KernelError(f"layers.{i}.{dropped[0]} drops with p = {getattr(layer, dropped[0]).p}: the patched "
                              "layer adds each residual inside a GEMM epilogue, with no dropout; build the model "
                              "with resid_pdrop=0.0 (Phi-3's default)")
        # Seed-OSS drops the attention's and the MLP's outputs (the MLP's only matters where the MLP
        # kernel replaces it; HF's MLP keeps its own dropout).
        for part in ("self_attn", "mlp") if swiglu else ("self_attn",):
            p = getattr(getattr(layer, part), "residual_dropout", 0.0)
            if isinstance(p, float) and p > 0:
                raise KernelError(f"layers.{i}.{part}.residual_dropout = {p}: the patched layer adds each residual "
                                  "inside a GEMM epilogue, with no dropout; build the model with "
                                  "residual_dropout=0.0 (config.residual_dropout)")
        linears = [n for n in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") if hasattr(layer.mlp, n)]
        mlp = [n for n in linears if getattr(layer.mlp, n).bias is not None]
        if mlp and swiglu:
            raise KernelError(f"layers.{i}.mlp.{mlp[0]}.bias: MLP biases (mlp_bias) are not in the suite's "
                              "SwiGLU kernels; pass swiglu=False to keep HF's MLP")
        qkv = [getattr(layer.self_attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "qkv_proj")
               if hasattr(layer.self_attn, n)]
        if any(qkv) and not all(qkv):
            raise KernelError(f"layers.{i}.self_attn: biases on some of q_proj, k_proj, v_proj ({qkv}); the fused "
                              "QKV GEMM adds one bias to all three or none")
        # The fused weight is one Parameter with one requires_grad: parts frozen apart (q_proj alone,
        # say) would all train or all freeze with the first part's flag.
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj")),
                            *((("mlp", ("gate_proj", "up_proj")),) if swiglu else ())):
            module = getattr(layer, part)
            if not all(isinstance(linear_of(getattr(module, n, None)), nn.Linear) for n in names):
                continue  # Phi-3's projections are fused already
            for kind in ("weight", "bias"):
                params = {n: getattr(linear_of(getattr(module, n)), kind) for n in names}
                grads = {n: p.requires_grad for n, p in params.items() if p is not None}
                if len(set(grads.values())) > 1:
                    hint = " (or pass swiglu=False to keep HF's MLP)" if part == "mlp" else ""
                    raise KernelError(
                        f"layers.{i}.{part}: requires_grad differs across the {kind}s of {', '.join(names)} "
                        f"({grads}); apply_to_llama fuses them into one parameter, which trains or freezes as a "
                        f"whole: freeze or unfreeze them together before apply_to_llama{hint}")
    head = getattr(model, "lm_head", None) if xent else None
    if head is not None:  # the fused LM head and loss takes what every drop-in's takes
        check_lm_head(head)
    if swiglu and cfg.hidden_act not in ("silu", "swish"):
        raise KernelError(f"hidden_act {cfg.hidden_act!r}: the MLP kernel is SwiGLU (silu); pass swiglu=False to "
                          "keep HF's MLP")
    if rope:
        rotary = base.rotary_emb
        if rotary.rope_type not in STATIC_ROPE or rotary.attention_scaling != 1.0:
            raise KernelError(f"rope_type {rotary.rope_type!r} (attention scaling {rotary.attention_scaling}) "
                              f"changes RoPE beyond a static frequency table ({', '.join(STATIC_ROPE)}); pass "
                              "rope=False to keep HF's RoPE")
