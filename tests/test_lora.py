"""LoRA fine-tuning of a patched model: peft's adapters on the projections the drop-ins run in
their kernels (``kernels/adapters.py``), on real peft and transformers models (tiny configs, CPU,
the reference lowering; a GPU case per drop-in), in the Trainer too (FSDP2: ``test_fsdp.py``).

Truth is the unpatched peft model in fp32, HF's bf16 peft model the noise floor, as in
``test_llama.py``: the loss and the logits within its bar.  An adapter's gradient is a product
of two bf16 paths (its input's activations and its output's gradient), each rounded differently
by the kernels than by HF, and HF's own error on it swings 3x between configs of one model
(0.009 to 0.028 relative on the same v_proj adapter): it gets three times HF's error.  The
adapters start random (``init_lora_weights=False``), so a term dropped, unrotated, left in the
wrong layout or scaled wrong misses the logits by tens of percent, and a gradient path cut
misses its gradient by all of it."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import test_llama as llama_tests  # noqa: E402
from dropin_models import MODELS  # noqa: E402
from test_llama import batch, tiny, tiny_llama  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def with_lora(model: torch.nn.Module, targets: list[str] | str, seed: int = 3, **options) -> torch.nn.Module:
    """``model`` under fresh random LoRA adapters (rank 4) on ``targets``; peft keeps the adapters
    fp32 on a bf16 model (``autocast_adapter_dtype``) and freezes the rest."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                             **options)
    return peft.get_peft_model(model, config)


def step(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The loss, the eval logits and the gradient of every trainable parameter of one step on
    ``data`` (ids, labels; test_llama's batch by default)."""
    ids, labels = data or batch()
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {f"d {n}": p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"loss": out.loss.detach(), "logits": logits, **grads}


def assert_like_peft(got: dict, hi: dict, lo: dict) -> None:
    """:func:`test_llama.assert_like_hf` for the loss and logits; adapters' gradients at 3x HF's error."""
    assert set(got) == set(hi)
    outputs = ("loss", "logits")
    for keys, factors in ((outputs, {}), ([k for k in hi if k not in outputs], {"err_factor": 3, "rel_factor": 3})):
        llama_tests.assert_like_hf(*({k: d[k] for k in keys} for d in (got, hi, lo)), **factors)


def assert_within_fp8_of_peft(got: dict, hi: dict) -> None:
    """The fp8 MLP blocks' bar (:func:`test_llama.assert_within_fp8`) on every tensor a peft step gives."""
    assert set(got) == set(hi)
    llama_tests.assert_within_fp8(got, hi)


def truth(base: torch.nn.Module, targets: list[str] | str, data: tuple | None = None) -> tuple[dict, dict]:
    """:func:`step` of the unpatched peft model in fp32 and in bf16 (the same adapters)."""
    return (step(with_lora(copy.deepcopy(base).float(), targets), data),
            step(with_lora(copy.deepcopy(base).bfloat16(), targets), data))


@pytest.mark.parametrize(("family", "targets", "flags"), [
    ("Llama", ["q_proj", "v_proj"], {}),  # peft's default targets for LLaMA
    ("Llama", ATTENTION, {}),
    ("Llama", ATTENTION, {"rope": False}),
    ("Llama", ATTENTION, {"rms_norm": False, "swiglu": False}),
    ("Llama", "all-linear", {"swiglu": False}),  # the MLP stays peft's, its adapters train there
    ("Qwen3", ATTENTION, {}),  # q/k norms between the projections and RoPE
    ("Phi3", ["qkv_proj", "o_proj"], {}),  # q, k and v in one projection
    ("Mistral", ["k_proj", "o_proj"], {}),  # k without q: its rotated term alone
    ("Ernie4_5", ["q_proj", "k_proj"], {}),  # interleaved pairs: the rotated terms in HF's column order
    ("HunYuanDenseV1", ATTENTION, {}),  # q/k norms after RoPE: the terms join before both
], ids=["llama-qv", "llama-attention", "llama-hf-rope", "llama-hf-norm", "llama-all-linear", "qwen3", "phi3",
        "mistral-k-o", "ernie4_5-interleaved", "hunyuan"])
def test_a_lora_fine_tune_of_a_patched_model_trains_like_peft(family, targets, flags):
    base = tiny_llama() if family == "Llama" else tiny(family)
    hi, lo = truth(base, targets)
    model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base).bfloat16(), targets), **flags)
    assert isinstance(model, peft.PeftModel)
    with launch_ledger() as launched:
        got = step(model)
    assert "add_residual" in {launch.name for launch in launched}  # the kernels ran, adapters beside them
    assert any(k.startswith("d ") and "lora_A" in k for k in got)
    assert not any(k.startswith("d ") and "lora_" not in k for k in got)  # the base stays frozen
    assert_like_peft(got, hi, lo)


@pytest.mark.parametrize(("family", "targets", "flags", "overrides"), [
    ("gpt2", ["c_attn"], {}, {}),  # peft's default target for GPT-2
    ("gpt2", ["c_attn", "c_proj"], {"mlp": False}, {}),  # c_proj names the MLP's too: it stays peft's
    ("gpt2", ["c_attn"], {"layer_norm": False, "mlp": False}, {}),  # HF's LayerNorm and peft's own LoRA forward
    ("gpt_neox", ["query_key_value", "dense"], {}, {}),  # the parallel residual
    ("gpt_neox", ["query_key_value", "dense"], {}, {"use_parallel_residual": False}),
], ids=["gpt2-c_attn", "gpt2-attention", "gpt2-hf-norm", "neox-parallel", "neox-sequential"])
def test_lora_on_the_gpt2_suite_s_drop_ins_trains_like_peft(family, targets, flags, overrides):
    """apply_to_gpt2 and apply_to_gpt_neox: the QKV projection's term joins the ln_qkv kernel's
    output, the output projection's the residual its epilogue adds (GPT-2's Conv1D adapters
    included, which peft runs with fan_in_fan_out)."""
    drop_in = MODELS[family]
    base, data = drop_in.build(**overrides), drop_in.tests.batch()
    hi, lo = truth(base, targets, data)
    model = drop_in.patch(with_lora(copy.deepcopy(base).bfloat16(), targets), **flags)
    with launch_ledger() as launched:
        got = step(model, data)
    assert launched and any(k.startswith("d ") and "lora_A" in k for k in got)
    assert_like_peft(got, hi, lo)


TARGETS = {"llama": ATTENTION, "gpt2": ["c_attn", "c_proj"], "gpt_neox": ["query_key_value", "dense"],
           "olmo2": ATTENTION}


@pytest.mark.parametrize("family", MODELS)
def test_a_lora_fine_tune_in_the_trainer_saves_an_adapter_peft_loads(tmp_path, family):
    """LoRA supervised fine-tuning as it usually runs: the peft model in transformers' Trainer with
    ``bf16=True`` (fp32 master weights, accelerate's autocast).  Patched, it trains the losses the
    unpatched peft model trains, and its checkpoint is peft's adapter, which loads onto an
    unpatched model with the weights it trained."""
    pytest.importorskip("accelerate")
    from test_trainer import fit

    drop_in, targets = MODELS[family], TARGETS[family]
    flags = {"mlp": False} if family == "gpt2" else {}  # GPT-2's c_proj names its MLP's too
    base = drop_in.build()
    _, want = fit(with_lora(copy.deepcopy(base), targets), str(tmp_path / "peft"), 3)
    patched = drop_in.patch(with_lora(copy.deepcopy(base), targets), **flags)
    _, got = fit(patched, str(tmp_path / "coda"), 3)
    assert len(got) == len(want) == 3 and max(abs(a - b) for a, b in zip(got, want)) < 0.03, (got, want)
    loaded = peft.PeftModel.from_pretrained(drop_in.build(seed=1), tmp_path / "coda" / "checkpoint-3")
    trained = {k: v for k, v in patched.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
    assert any(not torch.equal(v, with_lora(copy.deepcopy(base), targets).state_dict()[k])
               for k, v in trained.items())  # the adapter trained


def test_mixed_precision_lora_trains_like_peft():
    """fp32 master weights under bf16 autocast, the adapters fp32 too."""
    base = tiny_llama()
    hi = step(with_lora(copy.deepcopy(base).float(), ATTENTION))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lo = step(with_lora(copy.deepcopy(base).float(), ATTENTION))
        model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base).float(), ATTENTION))
        got = step(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_like_peft(got, hi, lo)


@pytest.mark.parametrize("fp8_mlp", [False, True], ids=["bf16", "fp8_mlp"])
def test_the_frozen_base_s_weight_gradients_are_not_computed(fp8_mlp):
    """LoRA freezes the base: no weight-gradient GEMM of a base weight runs, four a layer fewer
    than the same model fully trained (the fused QKV's, whose backward is the drop-in's, the
    output projection's and the MLP block's two, whose programs are asked only for the
    activations' gradients, ``needs``), and the LM head's (its loss runs lm_head_xent_frozen);
    and the first layer's fused QKV has no backward at all, since below it only frozen
    embeddings wait (its LoRA terms run in PyTorch).  In fp8 (mlp_block_fp8) the backward also
    quantizes its two gradients per token only: the per-feature copies that ``quantize_both``
    writes feed only the weight gradients."""
    base = tiny_llama().bfloat16()
    layers = base.config.num_hidden_layers
    ids, labels = batch()
    counts = []
    for model in (coda_agent.apply_to_llama(copy.deepcopy(base), fp8_mlp=fp8_mlp),
                  coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION), fp8_mlp=fp8_mlp)):
        with launch_ledger() as launched:
            model(input_ids=ids, labels=labels).loss.backward()
        counts.append({kind: sum(launch.kind == "gemm" if kind == "gemm" else launch.name == kind
                                 for launch in launched) for kind in ("gemm", "quantize_both")})
    assert counts[1]["gemm"] == counts[0]["gemm"] - 4 * layers - 1 - 1
    assert (counts[0]["quantize_both"], counts[1]["quantize_both"]) == ((4 * layers, 2 * layers) if fp8_mlp
                                                                        else (0, 0))


def test_an_fp8_lora_fine_tune_trains_within_fp8_error():
    """LoRA over the fp8 MLP blocks (``fp8_mlp=True``; the adapters on the attention projections,
    so the blocks' backwards are asked for dh alone): the loss, the logits and the adapters'
    gradients within the fp8 task's own error of the fp32 peft model."""
    base = tiny_llama()
    hi, _ = truth(base, ATTENTION)
    got = step(coda_agent.apply_to_llama(with_lora(copy.deepcopy(base).bfloat16(), ATTENTION), fp8_mlp=True))
    assert_within_fp8_of_peft(got, hi)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_of_a_lora_model_changes_nothing(reentrant):
    """Gradient checkpointing, as LoRA fine-tunes run it (the reentrant kind needs inputs that
    require grad: peft's ``enable_input_require_grads``), recomputes the kernels and the adapters'
    terms to the same step, bit for bit."""
    base = tiny_llama().bfloat16()
    want = step(coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION)))
    model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    got = step(model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_lora_model_compiles_whole():
    """torch.compile(fullgraph=True) traces the patched peft model, adapters included (AOTAutograd,
    no code generation): the same loss as eager, the adapters' gradients within bf16 rounding."""
    model = coda_agent.apply_to_llama(with_lora(tiny_llama().bfloat16(), ATTENTION))
    ids, labels = batch()
    model.train()
    eager = model(input_ids=ids, labels=labels).loss
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=labels).loss
    compiled.backward()
    assert torch.equal(compiled, eager)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert (p.grad - want[n]).abs().max() <= 2e-2 * want[n].abs().max() + 1e-4, n


@pytest.mark.parametrize(("family", "targets"), [("Llama", ATTENTION), ("Phi3", ["qkv_proj", "o_proj"])])
def test_the_adapter_saves_loads_and_switches_off_as_peft_s(tmp_path, family, targets):
    """The state dict keeps peft's keys and values (the fused rows split back into
    ``q_proj.base_layer.weight``, or Phi-3's ``qkv_proj.base_layer.weight``); the saved adapter
    loads onto an unpatched model, where it computes what it computed patched;
    ``disable_adapter`` runs the base model."""
    build = tiny_llama if family == "Llama" else lambda seed=0: tiny(family, seed=seed)
    base = build().bfloat16()
    plain = with_lora(copy.deepcopy(base), targets)
    model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), targets))
    want, got = plain.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert f"base_model.model.model.layers.0.self_attn.{targets[0]}.base_layer.weight" in got
    with torch.no_grad():  # train the adapter a little: a saved B of zeros would prove nothing
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    ids, _ = batch()
    for m in (model, loaded):
        m.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits.float(), loaded(input_ids=ids).logits.float()
        with model.disable_adapter():
            off = model(input_ids=ids).logits.float()
        bare = base.eval()(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (off - bare).abs().max() < 0.05 * bare.abs().max() and (a - off).abs().max() > 0.1 * bare.abs().max()
    fresh = coda_agent.apply_to_llama(with_lora(build(seed=7).bfloat16(), targets, seed=9))
    fresh.load_state_dict(got)
    assert all(torch.equal(v, got[k]) for k, v in fresh.state_dict().items())


def test_what_the_split_cannot_follow_is_refused_with_the_fix():
    base = tiny_llama().bfloat16()
    with pytest.raises(KernelError, match=r"layers.0.mlp.gate_proj has LoRA adapters \(default\), and the MLP "
                                          r"block kernel runs the whole MLP \(swiglu=True\): pass swiglu=False"):
        coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ["q_proj", "gate_proj"]))
    with pytest.raises(KernelError, match=r"lm_head has LoRA adapters .* pass fused_linear_cross_entropy=False"):
        coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ["q_proj", "lm_head"]))
    with pytest.raises(KernelError, match=r"h.0.mlp.c_proj has LoRA adapters .*\(mlp=True\): pass mlp=False"):
        coda_agent.apply_to_gpt2(with_lora(MODELS["gpt2"].build().bfloat16(), ["c_attn", "c_proj"]))
    with pytest.raises(KernelError, match=r"layers.0.mlp.dense_h_to_4h has LoRA .*\(mlp=True\): pass mlp=False"):
        coda_agent.apply_to_gpt_neox(with_lora(MODELS["gpt_neox"].build().bfloat16(), ["dense_h_to_4h"]))
    with pytest.raises(KernelError, match=r"lm_head has LoRA adapters .* pass fused_linear_cross_entropy=False"):
        coda_agent.apply_to_gpt_neox(with_lora(MODELS["gpt_neox"].build().bfloat16(), ["lm_head"]))
    with pytest.raises(KernelError, match=r"a LoRA variant \(DoRA or another\).*\(use_dora=False\)"):
        coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION, use_dora=True))
    merged = with_lora(copy.deepcopy(base), ATTENTION)
    merged.merge_adapter()
    with pytest.raises(KernelError, match=r"merged into the base weight; unmerge them"):
        coda_agent.apply_to_llama(merged)
    model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION))
    model.merge_adapter()  # into a copy of the fused rows: the patched model must not run on as if merged
    with pytest.raises(KernelError, match=r"merged after apply_to_\*"):
        model(input_ids=batch()[0])
    model = coda_agent.apply_to_llama(with_lora(copy.deepcopy(base), ATTENTION)).eval()
    with pytest.raises(KernelError, match=r"adapter_names"):
        model(input_ids=batch()[0], adapter_names=["default", "__base__"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize(("family", "targets", "flags"), [
    ("llama", ATTENTION, {}), ("llama", ATTENTION, {"fp8_mlp": True}), ("gpt2", ["c_attn"], {}),
    ("gpt_neox", ["query_key_value", "dense"], {})], ids=["llama", "llama-fp8_mlp", "gpt2", "gpt_neox"])
def test_a_lora_fine_tune_trains_like_peft_on_the_gpu(monkeypatch, family, targets, flags):
    """The cute lowering: LoRA on the attention projections (LLaMA's with RoPE in the QKV
    epilogue), every drop-in's kernels on by default; with ``fp8_mlp`` the MLP blocks' fp8
    GEMMs, within the fp8 task's error."""
    drop_in = MODELS[family]
    for module in (llama_tests, drop_in.tests):
        monkeypatch.setattr(module, "DEVICE", "cuda")
    base, data = drop_in.build(), drop_in.tests.batch()
    hi, lo = truth(base, targets, data)
    got = step(drop_in.patch(with_lora(copy.deepcopy(base).bfloat16(), targets), **flags), data)
    if flags.get("fp8_mlp"):
        assert_within_fp8_of_peft(got, hi)
    else:
        assert_like_peft(got, hi, lo)
