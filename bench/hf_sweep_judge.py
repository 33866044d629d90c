"""One model type through every drop-in, for ``bench/hf_sweep.py`` (its worker process): the model
built tiny (its variant's config values on top), the truth and HF's bf16 error, each drop-in's
patch, retried as its refusals say, and its results held to tests/test_llama.py's bar (the
sweep's docstring says how, and what each outcome means)."""

from __future__ import annotations

import copy
import functools
import json
import re
import resource
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dropin_coverage as cov  # noqa: E402

from coda_agent.kernels import like_hf  # noqa: E402

DROP_INS = ("apply_to_llama", "apply_to_gpt2", "apply_to_gpt_neox", "apply_to_model")
# The encoder-decoder families' decoders (BART's, Whisper's, Marian's ... ForCausalLM) count their
# layers and heads under these names; at their defaults the small widths do not divide.
SEQ2SEQ_SMALL = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=128, decoder_ffn_dim=128)
MEMORY_LIMIT = 10 << 30  # a worker's address space: a model past it fails its own step (unbuilt), not the host


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): two rows of 16 tokens, the first four labels of the first row ignored (a prompt)."""
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


# The batch every model is judged on, and two more on which a miss must stand: a tensor whose bf16
# result cancels (a scalar gate's gradient summed over every token) misses on one batch by the luck
# of HF's rounding there, where a kernel that computes something else misses on every batch.
BATCHES = (batch(1), batch(11), batch(12))
SEED = 2  # every training forward's: the same dropout masks in every copy


# --------------------------------------------------------------------------- one model (the worker)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights moved off one and biases drawn at the weights' scale: HF initializes them to
    one and zero, where a norm or bias that is dropped or misplaced would not show."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name.lower() and name.endswith("weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def grads_in_hf_layout(model: torch.nn.Module, keys: set[str]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (zeros where none came), read through the state dict: HF's keys and
    layout, a fused weight's parts under their own keys."""
    with torch.no_grad():
        data = {n: p.data for n, p in model.named_parameters()}
        for p in model.parameters():
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        try:
            return {k: v.detach().clone() for k, v in model.state_dict().items() if k in keys}
        finally:
            for n, p in model.named_parameters():
                p.data = data[n]


def train_and_eval(model: torch.nn.Module, keys: set[str], b: int = 0) -> dict[str, torch.Tensor]:
    """The loss of one training step, every gradient and the eval logits."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    ids, labels = BATCHES[b]
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    got = {"loss": out.loss.detach().reshape(1), **{f"d {k}": v for k, v in grads_in_hf_layout(model, keys).items()}}
    model.eval()
    with torch.no_grad():
        got["logits"] = model(input_ids=ids).logits
    return got


def _distance(t: torch.Tensor, truth: torch.Tensor) -> float:
    return float("inf") if t.shape != truth.shape else (t.float() - truth.float()).abs().max().item()


def misses(got: dict, hi: dict, lo: dict) -> list[tuple[str, float]]:
    """[(tensor, how far past the bar)] for each tensor of ``got`` that misses the drop-in tests' bar
    against the truth ``hi`` and HF's bf16 ``lo``, worst first; a tensor whose fp32 truth overflows
    (a loud variant) has no truth to judge it by."""
    return like_hf.misses(got, hi, lo, overflowed_truth_unjudged=True)


ACTIVATION_KEYS = ("hidden_act", "activation_function", "hidden_activation", "activation", "afn")
BIAS_KEYS = ("mlp_bias", "attention_bias", "bias", "use_bias", "add_bias_linear", "qkv_bias", "use_qkv_bias")
LOUD = 50.0  # the "loud" variant's factor on the MLPs' first GEMMs: pre-activations past +-10


def variant_config(class_name: str, variant: str) -> dict[str, Any] | None:
    """The config values a variant sets on top of the small widths, or None where the model type's
    config has nothing the variant changes: ``dropout`` (every dropout probability 0.1), ``tied``
    (``tie_word_embeddings`` flipped), ``bias`` (every bias flag on), ``act=NAME`` (the activation,
    a key of transformers' ACT2FN); ``+loud`` after any of them scales the MLPs' first GEMMs
    (:func:`loud`)."""
    import transformers

    variant = variant.split("+")[0]
    if variant in ("", "loud"):
        return {}
    defaults = getattr(transformers, class_name).config_class().to_dict()
    if variant == "dropout":
        set_ = {k: 0.1 for k, v in defaults.items() if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}
    elif variant == "tied":
        set_ = {"tie_word_embeddings": not defaults["tie_word_embeddings"]} if "tie_word_embeddings" in defaults \
            else {}
    elif variant == "bias":
        set_ = {k: True for k in BIAS_KEYS if isinstance(defaults.get(k), bool)}
    elif variant.startswith("act="):
        set_ = {k: variant[4:] for k in ACTIVATION_KEYS if isinstance(defaults.get(k), str)}
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return set_ or None


def loud(model: torch.nn.Module) -> torch.nn.Module:
    """The MLPs' first GEMMs (every nn.Linear that widens, the output embeddings aside, and the
    experts' 3-D gate/up weights) scaled by :data:`LOUD`, so that the pre-activations reach past
    where an activation's clip or kink sits (ReLU6's 6, the clipped GELU's 10)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not head and m.out_features > m.in_features:
                m.weight.mul_(LOUD)
            gu = getattr(m, "gate_up_proj", None)
            if isinstance(gu, torch.nn.Parameter) and gu.dim() == 3:
                gu.mul_(LOUD)
    return model


class Subject:
    """A model type's fp32 model (perturbed) with its truth and HF's bf16 error, per config fix."""

    def __init__(self, class_name: str, variant: str = ""):
        self.class_name, self.widths, self._by_fixes = class_name, {}, {}
        self.variant, self.config = variant, variant_config(class_name, variant) or {}

    def build(self, fixes: dict[str, float]) -> torch.nn.Module:
        """The fp32 model, perturbed, after one eval forward: a model that changes itself on its
        first call (BigBird swaps its attention modules for a short input) does it before the
        truth is taken, as it does in ``apply_to_model``'s head probe."""
        model = perturbed(cov.build(self.class_name, {**self.config, **fixes}, **self.widths))
        if self.variant.endswith("loud"):
            loud(model)
        with torch.no_grad():
            model.eval()(input_ids=BATCHES[0][0][:, :4])
        return model

    def first(self, build_s: int) -> str | None:
        """Build the model as dropin_coverage does (plain, else at latent or per-layer-kind widths);
        why not, or None."""
        why = None
        for widths in ({}, {"latent": True}, {"layered": True}):
            if widths and not (cov._latent_attention if "latent" in widths else cov._layered)(self.class_name):
                continue
            self.widths = widths
            try:
                cov.signal.alarm(build_s)
                try:
                    base = self.build({})
                finally:
                    cov.signal.alarm(0)
                params = sum(p.numel() for p in base.parameters())
                if params > cov.MAX_PARAMS:
                    return f"{params / 1e6:.0f}M parameters at the small widths"
                self._by_fixes[()] = self._truth(base)
                return None
            except cov._Timeout:
                why = why or f"took over {build_s} s to build"
            except Exception as e:  # noqa: BLE001 - this model type is not judged, with why
                why = why or f"{type(e).__name__}: {str(e)[:240]}"
        return why

    def _truth(self, base: torch.nn.Module, b: int = 0) -> tuple[torch.nn.Module, dict, dict]:
        """(the model, the truth, HF's bf16 results: per tensor the bf16 model's or the fp32 model's
        under bf16 autocast, whichever is further from the truth)."""
        keys = {n for n, _ in base.named_parameters(remove_duplicate=False)}
        hi = train_and_eval(copy.deepcopy(base).float(), keys, b)
        lo = train_and_eval(copy.deepcopy(base).bfloat16(), keys, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = train_and_eval(copy.deepcopy(base).float(), keys, b)
        return base, hi, {k: max((lo[k], mixed.get(k, lo[k])), key=lambda t: _distance(t, hi[k])) for k in hi}

    def get(self, fixes: dict[str, float], b: int = 0) -> tuple[torch.nn.Module, dict, dict]:
        """The model built with ``fixes``, its truth and HF's bf16 results on batch ``b``."""
        key = tuple(sorted(fixes.items()))
        if key not in self._by_fixes:
            self._by_fixes[key] = self._truth(self.build(fixes))
        if b == 0:
            return self._by_fixes[key]
        if (key, b) not in self._by_fixes:
            self._by_fixes[key, b] = self._truth(self._by_fixes[key][0], b)
        return self._by_fixes[key, b]


def upcast(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """``model`` (bf16, unpatched) with the modules ``names`` computed in fp32 inside, bf16 at their
    boundaries: HF's code, more exact where the kernels run."""
    def run_fp32(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        up = {n: t.float() for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_floating_point()}
        cast = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        kw = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
        with _reparametrize_module(module, up):
            out = type(module).forward(module, *cast, **kw)
        low = next(a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point())
        if torch.is_tensor(out):
            return out.to(low) if out.is_floating_point() else out
        return type(out)(o.to(low) if torch.is_tensor(o) and o.is_floating_point() else o for o in out)

    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(run_fp32, module)
    return model


def second_opinion(missed: list[tuple[str, float]], base: torch.nn.Module, parts: dict[str, Any], hi: dict,
                   lo: dict, keys: set[str], b: int = 0) -> tuple[list[tuple[str, float]], list[str]]:
    """(the misses that stand, the tensors excused): a tensor is excused where HF's model, with the
    patched modules computed in fp32 inside (:func:`upcast`), misses the bar at least half as far
    as the patched model does.  Such a tensor is ill-conditioned in bf16 (a sum that cancels: a
    scalar gate's gradient through a norm that undoes its scale), so any valid rounding upstream
    moves it, and HF's bf16 result stood near the truth by luck; a kernel computing something
    else misses where the more exact HF code does not."""
    names = [n for v in parts.values() if isinstance(v, list) for n in v]
    if not names:
        return missed, []
    try:
        alt = dict(misses(train_and_eval(upcast(copy.deepcopy(base).bfloat16(), names), keys, b), hi, lo))
    except Exception:  # noqa: BLE001 - no second opinion: the misses stand
        return missed, []
    stand = [(k, r) for k, r in missed if alt.get(k, 0.0) < r / 2]
    return stand, [f"{k} {r:.2f}x (HF's, more exact: {alt[k]:.2f}x)" for k, r in missed if alt.get(k, 0.0) >= r / 2]


def standing(got: dict, subject: Subject, fixes: dict[str, float], patched: torch.nn.Module,
             parts: dict[str, Any], keys: set[str]) -> tuple[list[tuple[str, float]], list[str]]:
    """(the misses of the patched model's results ``got`` on the first batch that stand, the ones
    excused and why): a miss stands where the more exact HF code does not miss as far
    (:func:`second_opinion`) and the patched model misses that tensor on every batch of
    :data:`BATCHES` (its ratio there the least of them)."""
    base, hi, lo = subject.get(fixes)
    missed, noisy = second_opinion(misses(got, hi, lo), base, parts, hi, lo, keys)
    for b in range(1, len(BATCHES)):
        if not missed:
            break
        _, hi_b, lo_b = subject.get(fixes, b)
        again = dict(misses(train_and_eval(patched, keys, b), hi_b, lo_b))
        noisy += [f"{k} {r:.2f}x, not on batch {b}" for k, r in missed if k not in again]
        missed = [(k, min(r, again[k])) for k, r in missed if k in again]
    return missed, noisy


def nothing_found(message: str) -> bool:
    return message.startswith("apply_to_model found none of")


def names_a_fix(message: str) -> bool:
    """Whether a refusal says what to do: a flag to pass, a config value, a call to make, another
    drop-in or the way on (train it unpatched, write tasks for it)."""
    return bool(re.search(r"\bpass \w+=|build the model with|model\.\w+\(|coda_agent\.\w+\(|train it unpatched|"
                          r"patch (a|the) |use |call |unmerge|freeze|resize_token_embeddings", message))


def attempt(subject: Subject, drop_in: str) -> dict[str, Any]:
    """One drop-in on a bf16 copy of the subject, retried as its refusals say; its outcome."""
    import coda_agent
    from coda_agent.kernels import KernelError

    flags: dict[str, bool] = {}
    fixes: dict[str, float] = {}
    while True:
        base, hi, lo = subject.get(fixes)
        patched = copy.deepcopy(base).bfloat16()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                getattr(coda_agent, drop_in)(patched, **flags)
            break
        except KernelError as e:
            msg = str(e)
            flag = re.search(r"pass (\w+)=False", msg)
            fix = re.search(r"build the model with (\w+)=([0-9.]+)", msg)
            if flag is not None and flag[1] not in flags:
                flags[flag[1]] = False
            elif fix is not None and fix[1] not in fixes:
                fixes[fix[1]] = float(fix[2])
            else:
                outcome = "nothing" if nothing_found(msg) else "refused"
                return {"outcome": outcome, "message": msg, "flags": flags, "config": fixes,
                        **({} if names_a_fix(msg) else {"unclear": True})}
        except Exception as e:  # noqa: BLE001 - the contract's breach: recorded, the sweep goes on
            return {"outcome": "crashed", "message": f"at the patch: {type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:], "flags": flags, "config": fixes}
    keys = {k[2:] for k in hi if k.startswith("d ")}
    try:
        got = train_and_eval(patched, keys)
    except Exception as e:  # noqa: BLE001
        return {"outcome": "crashed", "message": f"patched, then {type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-2000:], "flags": flags, "config": fixes}
    parts = getattr(patched, "coda_flags", None)
    what = {"parts": {k: len(v) if isinstance(v, list) else v for k, v in parts.items() if v}} if parts else {}
    missed, noisy = standing(got, subject, fixes, patched, parts or {}, keys)
    if set(patched.state_dict()) != set(base.state_dict()):
        missed.insert(0, ("state dict keys", float("inf")))
    row = {"outcome": "WRONG" if missed else "correct", "flags": flags, "config": fixes, **what,
           "loss": got["loss"].item(), "fp32_loss": hi["loss"].item(), **({"noisy": noisy} if noisy else {})}
    if missed:
        row["worst"] = [(k, round(r, 2)) for k, r in missed[:6]]
        row["missed"] = len(missed)
    return row


def judge(model_type: str, class_name: str, build_s: int, variant: str = "") -> dict[str, Any]:
    start = time.time()
    if variant_config(class_name, variant) is None:
        return {"model_type": model_type, "class": class_name, "outcome": "n/a",
                "why": f"its config has nothing the variant {variant!r} changes", "seconds": 0.0}
    subject = Subject(class_name, variant)
    why = subject.first(build_s)
    row: dict[str, Any] = {"model_type": model_type, "class": class_name}
    if why is not None:
        return {**row, "outcome": "unbuilt", "why": why, "seconds": round(time.time() - start, 1)}
    row.update({k: True for k in subject.widths})
    row["params"] = sum(p.numel() for p in subject.get({})[0].parameters())
    for drop_in in DROP_INS:
        row[drop_in] = attempt(subject, drop_in)
    row["outcome"] = overall(row)
    row["seconds"] = round(time.time() - start, 1)
    return row


def overall(row: dict[str, Any]) -> str:
    """A model type's outcome: the worst of its drop-ins' (a wrong or crashed patch first), else
    correct where one patched it, else apply_to_model's."""
    outcomes = [row[d]["outcome"] for d in DROP_INS if d in row]
    for worst in ("WRONG", "crashed", "correct"):
        if worst in outcomes:
            return worst
    return row["apply_to_model"]["outcome"]


def worker(models: list[str], build_s: int, variant: str = "") -> None:
    """Judge ``models`` in order, a ``start`` line before each and its row after, on stdout."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cov.SMALL.update(SEQ2SEQ_SMALL)
    cov.signal.signal(cov.signal.SIGALRM, cov._alarm)
    out = sys.__stdout__
    sys.stdout = sys.stderr  # what models print goes to the log, not the protocol
    for model_type in models:
        print(json.dumps({"start": model_type}), file=out, flush=True)
        try:
            row = judge(model_type, causal_lms[model_type], build_s, variant)
        except Exception as e:  # noqa: BLE001 - the sweep's own failure on this model, kept as a row
            row = {"model_type": model_type, "class": causal_lms[model_type], "outcome": "crashed",
                   "why": f"the sweep itself: {type(e).__name__}: {e}"}
        print(json.dumps(row, default=str), file=out, flush=True)
