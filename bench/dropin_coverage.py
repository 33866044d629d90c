"""Which transformers causal LMs the drop-ins patch, and how the others are refused.

Each model type transformers maps to a causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) is
built on the CPU from its default config, shrunk to a few layers of small widths, in bf16; each
drop-in of whole layers (``apply_to_llama``, ``apply_to_gpt2``, ``apply_to_gpt_neox``) then patches
a copy, and where none of them takes the model, ``apply_to_model`` (its modules one by one); and
where a refusal names a flag that keeps a part HF's (``pass swiglu=False``) or a config value
(``build the model with resid_pdrop=0.0``), tries again with it, as a user would.  A patched
model trains one step (the reference lowering) and its loss is set beside the unpatched model's
(a miss beyond bf16 rounding is an error), with the flags and config values it took; a refusal
is kept with its message.  The contract this checks: a drop-in either patches
a model, which then computes HF's loss, or refuses it with a ``KernelError`` that says what to do;
any other exception is a bug (``"error"`` rows).  A config that does not build at the small
widths (its own constraints between sizes), or whose unpatched model then fails its own step, is
listed as ``unbuilt``, not judged, unless it is a latent-attention config (DeepSeek-V2/V3's MLA)
that builds and steps at small latent widths (``latent`` in its row), or one whose layers differ
(Gemma-4's, the hybrids') that builds and steps with a layer of each kind (``layered``)::

    python3 bench/dropin_coverage.py OUT.json [--models llama,phi,...] [--build-s 60]
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

DROP_INS = ("apply_to_llama", "apply_to_gpt2", "apply_to_gpt_neox")
FALLBACK = "apply_to_model"  # tried where no drop-in of whole layers patches the model: the way on
# The small widths, under every name configs give them (GPT-2's n_embd, T5-style d_model, ...).
SMALL = dict(hidden_size=64, n_embd=64, d_model=64, num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2,
             num_attention_heads=4, n_head=4, num_heads=4, num_key_value_heads=2, intermediate_size=128, n_inner=128,
             ffn_dim=128, vocab_size=256, head_dim=16, max_position_embeddings=128, n_positions=128,
             moe_intermediate_size=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
             shared_expert_intermediate_size=64, num_experts_per_tok=2, moe_topk=2, rotary_dim=16)
# Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3...): its config derives
# head_dim and the query-key width from these in __init__, and its heads are never grouped; and
# DeepSeek's MoE from the second layer on, its experts in one group (4 routed experts).
MLA_SMALL = dict(qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
                 num_key_value_heads=SMALL["num_attention_heads"], first_k_dense_replace=1, n_group=1,
                 topk_group=1)
# Configs whose layers differ (Gemma-3n/4's sliding and full attention, hybrids of attention and
# state-space or linear-attention layers) keep a list or period per layer that the two small layers
# must match; built again from these (``layered`` in its row): one layer of each kind its defaults
# list, the hybrids' attention on the second layer and their state-space layers at small widths
# (Bamba's defaults, 128 heads of a 256-wide state, asked its reference scan for 16 GiB), and Gemma's
# per-layer inputs small.
LAYERED_SMALL = dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                     attn_layer_indices=[1], vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                     num_kv_shared_layers=0, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                     mamba_chunk_size=16)
# A patched model's loss against the unpatched bf16 model's: both round in bf16 (a loss near 5.5
# moves ~0.02 per rounding step), and a wiring error misses by far more.
LOSS_TOLERANCE = 0.01
MAX_PARAMS = 30e6  # a config whose size the small widths do not reach (vision towers, ...) is skipped


class _Timeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Timeout


def build(class_name: str, fixes: dict[str, float] | None = None, latent: bool = False,
          layered: bool = False) -> torch.nn.Module:
    """transformers' ``class_name`` from its default config at the small widths (:data:`SMALL`),
    with ``fixes`` (config values a refusal asked for) on top; ``latent``: a config built with
    :data:`MLA_SMALL` too, so that its __init__ derives the latent widths; ``layered``: one built
    with :data:`LAYERED_SMALL` and a layer of each kind.  A default padding id past the small
    vocabulary (Phi-3's 32000, SmolLM3's 128004) becomes 0: the embedding refuses it."""
    import transformers

    cls = getattr(transformers, class_name)
    small = {**{k: v for k, v in SMALL.items() if k != "head_dim"}, **MLA_SMALL} if latent else SMALL
    if layered:
        small = {**SMALL, **LAYERED_SMALL, **_small_layer_types(cls)}
    config = cls.config_class(**small) if latent or layered else cls.config_class()
    # A layered config took its widths at __init__, where it spreads them per layer (Gemma-4's
    # head_dim is then the layers' to read, not the config's): only the fixes come after.
    for name, value in {**({} if layered else small), **(fixes or {})}.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except (AttributeError, TypeError, ValueError):  # a derived attribute of this config
                pass
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and pad >= getattr(config, "vocab_size", SMALL["vocab_size"]):
        config.pad_token_id = 0
    torch.manual_seed(0)
    return cls(config)


IDS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))  # every model's batch
# Each training forward starts from this seed, so the dropout a config keeps (BERT's 0.1) draws the
# same masks in the patched model as in HF's: the kernels draw no random numbers of their own.
DROPOUT_SEED = 2


def hf_loss(model: torch.nn.Module) -> float:
    """The unpatched model's training loss on this sweep's batch."""
    reference = copy.deepcopy(model).train()
    torch.manual_seed(DROPOUT_SEED)
    return reference(input_ids=IDS, labels=IDS).loss.item()


def patch_and_train(model: torch.nn.Module, drop_in: str, want: float, class_name: str,
                    **widths: bool) -> dict[str, Any]:
    """One drop-in on a copy of ``model``: its loss beside HF's (``want``), or the refusal.  A
    refusal that names a flag (``pass swiglu=False``) is retried with it, one that names a config
    value (``build the model with resid_pdrop=0.0``) on the model rebuilt with it, as a user
    would; the row records both (``flags``, ``config``).  ``widths``: :func:`build`'s ``latent`` or
    ``layered``, as the model was built."""
    import coda_agent
    from coda_agent.kernels import KernelError

    flags: dict[str, bool] = {}
    fixes: dict[str, float] = {}
    while True:
        patched = copy.deepcopy(model)
        try:
            getattr(coda_agent, drop_in)(patched, **flags)
            break
        except KernelError as e:
            flag = re.search(r"pass (\w+)=False", str(e))
            fix = re.search(r"build the model with (\w+)=([0-9.]+)", str(e))
            if flag is not None and flag[1] not in flags:
                flags[flag[1]] = False
            elif fix is not None and fix[1] not in fixes:
                fixes[fix[1]] = float(fix[2])
                model = build(class_name, fixes, **widths).bfloat16()
                want = hf_loss(model)
            else:
                return {"result": "refused", "message": str(e), "flags": flags, "config": fixes}
        except Exception as e:  # the contract's breach: reported, not raised, so the sweep goes on
            return {"result": "error", "message": f"{type(e).__name__}: {e}", "flags": flags, "config": fixes}
    try:
        patched.train()
        torch.manual_seed(DROPOUT_SEED)
        loss = patched(input_ids=IDS, labels=IDS).loss
        loss.backward()
    except Exception as e:
        return {"result": "error", "message": f"patched, then {type(e).__name__}: {e}", "flags": flags}
    if not abs(loss.item() - want) <= LOSS_TOLERANCE * abs(want):
        return {"result": "error", "message": f"patched, its loss {loss.item():.4f} against HF's {want:.4f}",
                "flags": flags, "config": fixes}
    parts = getattr(patched, "coda_flags", None)  # apply_to_model's: the MLPs it patched and the head
    what = {} if parts is None else {"parts": {k: len(v) if isinstance(v, list) else v for k, v in parts.items()}}
    return {"result": "patched", "flags": flags, "config": fixes, "loss": loss.item(), "hf_loss": want, **what}


def _flags(outcome: dict[str, Any]) -> str:
    given = {**outcome["flags"], **outcome.get("config", {})}
    return f"({', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""


def judge(class_name: str, build_s: int) -> dict[str, Any]:
    """One model type's row: why it is not judged (``unbuilt``), or its size and each drop-in's
    outcome.  A latent-attention config that does not build or step at the small widths is
    built again at :data:`MLA_SMALL`'s (``latent`` in its row), one with kinds of layer with a
    layer of each (``layered``)."""
    row = _judged(class_name, build_s, latent=False)
    for kind, applies in (("latent", _latent_attention), ("layered", _layered)):
        if "unbuilt" in row and applies(class_name):
            again = _judged(class_name, build_s, **{kind: True})
            if "unbuilt" not in again:
                return {kind: True, **again}
    return row


ATTENTION_KINDS = {"full_attention", "sliding_attention", "attention"}


def _small_layer_types(cls: Any) -> dict[str, list[str]]:
    """The default config's kinds of layer, one each and an attention layer among them, as many as
    the small layers (none where it lists no kinds)."""
    defaults = cls.config_class()
    kinds = defaults.layer_types if "layer_types" in defaults.to_dict() else None
    if not isinstance(kinds, list) or not kinds:
        return {}
    distinct = list(dict.fromkeys(kinds))
    if not set(distinct) & ATTENTION_KINDS:  # a hybrid whose defaults list no attention layer: HF's own
        distinct.append("full_attention")  # step needs one (Granite-MoE-Hybrid's cache asks it its length)
    n = SMALL["num_hidden_layers"]
    return {"layer_types": (distinct * n)[:n]}


def _layered(class_name: str) -> bool:
    import transformers

    cls = getattr(transformers, class_name)
    keys = cls.config_class().to_dict()
    return "layer_types" in keys or any(k in keys for k in LAYERED_SMALL)


def _latent_attention(class_name: str) -> bool:
    import transformers

    return hasattr(getattr(transformers, class_name).config_class(), "kv_lora_rank")


def _judged(class_name: str, build_s: int, latent: bool = False, layered: bool = False) -> dict[str, Any]:
    signal.alarm(build_s)
    try:
        model = build(class_name, latent=latent, layered=layered)
    except _Timeout:
        return {"unbuilt": f"took over {build_s} s"}
    except Exception as e:
        return {"unbuilt": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        signal.alarm(0)
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS:
        return {"unbuilt": f"{params / 1e6:.0f}M parameters at the small widths"}
    model = model.bfloat16()
    try:
        want = hf_loss(model)
    except Exception as e:  # the small widths broke HF's own model (a top-k over fewer experts)
        return {"unbuilt": f"HF's own step fails at the small widths: {type(e).__name__}: {str(e)[:200]}"}
    widths = {"latent": latent, "layered": layered}
    row = {drop_in: patch_and_train(model, drop_in, want, class_name, **widths) for drop_in in DROP_INS}
    if not any(outcome["result"] == "patched" for outcome in row.values()):
        row[FALLBACK] = patch_and_train(model, FALLBACK, want, class_name, **widths)
    return {"params": params, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="", help="model types (transformers' keys), comma-separated; all by default")
    parser.add_argument("--build-s", type=int, default=30, help="seconds a model may take to build")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

    wanted = [m for m in args.models.split(",") if m]
    unknown = sorted(set(wanted) - set(causal_lms))
    if unknown:
        parser.error(f"not causal LM model types of this transformers: {unknown}")
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    for model_type, class_name in sorted(causal_lms.items()):
        if wanted and model_type not in wanted:
            continue
        row = {"model_type": model_type, "class": class_name, **judge(class_name, args.build_s)}
        rows.append(row)
        print(json.dumps({k: (v["result"] if isinstance(v, dict) else v) for k, v in row.items()}), flush=True)
    judged = [r for r in rows if "unbuilt" not in r]
    summary = {"models": len(rows), "built": len(judged),
               **{kind: sorted(f"{r['model_type']}:{d}{_flags(r[d])}" for r in judged for d in (*DROP_INS, FALLBACK)
                               if d in r and r[d]["result"] == kind)
                  for kind in ("patched", "error")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    return 1 if summary["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
