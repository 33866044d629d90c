"""apply_to_llama on the model families beyond LLaMA (transformers models built from tiny
configs, CPU, the reference lowering), held to test_llama.py's bar: the loss, the logits and
every gradient against the unpatched model in fp32, within twice HF's own bf16 error.  Each
family's difference from LLaMA is exercised where it lives (a sliding window, q/k norms, biases,
fused projections, partial rotary, multipliers, a (1 + w) RMSNorm, wide heads), and a model that
differs where the patch cannot follow is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from test_llama import CONFIG, assert_like_hf, tiny, tiny_llama, train_and_eval, with_biases  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding_window=8"])
def test_a_mistral_model_trains_like_hf(window):
    """Mistral is LLaMA's modules under other names plus a sliding window (24 tokens here, so a
    window of 8 changes the attention): patched, it trains like the unpatched model."""
    base = tiny("Mistral", sliding_window=window)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    assert model.model.layers[0].coda_attention.window == window
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"norm_rope", "add_residual", "norm_swiglu", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)
    if window is not None:  # the window matters: the full-attention model's loss is another
        assert abs(train_and_eval(tiny("Mistral").bfloat16())["loss"] - hi["loss"]) > 1e-3


@pytest.mark.parametrize("flags", [{}, {"rope": False}], ids=["rope-in-epilogue", "hf-rope"])
def test_a_smollm3_model_with_layers_that_skip_rope_trains_like_hf(flags):
    """SmolLM3 leaves RoPE out of some layers (``no_rope_layers``): those layers' QKV epilogue
    rotates nothing, and with HF's RoPE they skip HF's rotation too."""
    base = tiny("SmolLM3", no_rope_layers=[1, 0], use_sliding_window=False)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    assert [layer.coda_attention.rotates for layer in model.model.layers] == [True, False]
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert ("norm_rope" in {launch.name for launch in launched}) is not ("rope" in flags)
    assert "scale_rows" in {launch.name for launch in launched}  # the layer without RoPE
    assert_like_hf(got, hi, lo)


def test_a_ministral_model_trains_like_hf():
    """Ministral: no family of its own, its modules are another family's code (its sliding window
    per layer included); recognised by that code, it trains like the unpatched model."""
    base = tiny("Ministral", sliding_window=8)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    assert [layer.coda_attention.window for layer in model.model.layers] == [8, 8]
    assert model.model.coda_flags["rope"] is True
    assert_like_hf(train_and_eval(model), hi, lo)


@pytest.mark.parametrize("family", ["Mistral", "Qwen3", "Qwen2", "Phi3", "HunYuanDenseV1"])
def test_other_families_keep_their_hf_state_dict(family):
    """Qwen3's q/k norm weights, Qwen2's q/k/v biases, Phi-3's projections (fused by HF in another
    layout under the same keys) and every fused projection come back under HF's keys and values,
    and load back into a patched model."""
    hf = tiny(family).bfloat16()
    if family == "Qwen2":  # HF initializes the biases to zero: make a permutation show
        with torch.no_grad():
            for p in (p for n, p in hf.named_parameters() if n.endswith("proj.bias")):
                p.normal_()
    want, got = hf.state_dict(), coda_agent.apply_to_llama(copy.deepcopy(hf)).state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = coda_agent.apply_to_llama(tiny(family, seed=1).bfloat16())
    fresh.load_state_dict(want)
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize(("family", "overrides"), [
    ("Qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("Llama", {"attention_bias": True}),
], ids=["qwen2", "llama_attention_bias"])
def test_a_model_with_projection_biases_trains_like_hf(family, overrides):
    """Qwen2 (biases on q, k and v; here a sliding window on its second layer) and LLaMA with
    ``attention_bias`` (on q, k, v and o): the QKV epilogue adds the bias before RoPE, and the
    loss, logits and every gradient, the biases' included, match the unpatched model."""
    base = with_biases(tiny(family, **overrides) if family != "Llama" else tiny_llama(**overrides))
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    assert any(k.endswith("v_proj.bias") for k in hi) and hi["d model.layers.0.self_attn.q_proj.bias"].abs().max() > 0
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"norm_bias_rope", "row_dot_bias", "rmsnorm_dx", "add_residual", "norm_swiglu"} <= {
        launch.name for launch in launched}
    assert_like_hf(got, hi, lo)
    # HF's RoPE after the fused GEMM (the epilogue without RMSNorm or RoPE is the op test's).
    with launch_ledger() as launched:
        got = train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), rope=False))
    assert "scale_rows_bias" in {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


def test_a_qwen3_model_trains_like_hf():
    """Qwen3 adds per-head RMSNorms of q and k before RoPE, and here a sliding window on its
    second layer: the norms and RoPE stay HF's (RoPE cannot ride in the GEMM past the norms),
    the rest is the suite's kernels, and it trains like the unpatched model."""
    base = tiny("Qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [layer.self_attn.sliding_window for layer in base.model.layers] == [None, 8]
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    plans = [layer.coda_attention for layer in model.model.layers]
    assert [(p.qk_norm, p.window) for p in plans] == [(True, None), (True, 8)]
    assert all(p.rotary is apply_rotary_pos_emb for p in plans)  # the rotation Qwen3's attention calls
    assert model.model.coda_flags["rope"] is False  # HF's, after the norms
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"scale_rows", "add_residual", "norm_swiglu", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


PARTIAL_ROTARY = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


@pytest.mark.parametrize(("overrides", "flags", "qkv"), [
    ({}, {}, "norm_rope"),
    (PARTIAL_ROTARY, {}, "scale_rows"),
    ({"sliding_window": 8}, {"swiglu": False}, "norm_rope"),
], ids=["full-rotary", "partial-rotary", "sliding-hf-mlp"])
def test_a_phi3_model_trains_like_hf(overrides, flags, qkv):
    """Phi-3 (and Phi-3.5, Phi-4): q, k and v in one projection and gate and up in another, as
    halves; the patch re-lays them out as the suite's kernels read them.  Where RoPE turns part of
    each head (Phi-4-mini's partial_rotary_factor) it stays HF's, after the fused GEMM."""
    base = tiny("Phi3", **overrides)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    assert model.model.coda_flags["rope"] is (qkv == "norm_rope")
    assert model.model.layers[0].coda_attention.window == overrides.get("sliding_window")
    with launch_ledger() as launched:
        got = train_and_eval(model)
    names = {launch.name for launch in launched}
    assert {qkv, "add_residual", "rmsnorm_dx", "logits_lse"} <= names
    assert ("norm_swiglu" in names) is not ("swiglu" in flags)
    assert_like_hf(got, hi, lo)


GRANITE = dict(residual_multiplier=0.22, logits_scaling=8.0, embedding_multiplier=12.0, attention_multiplier=0.0625)


@pytest.mark.parametrize(("overrides", "flags"), [({}, {}), ({"attention_bias": True}, {"swiglu": False}),
                                                  ({"tie_word_embeddings": True}, {})],
                         ids=["plain", "biases-hf-mlp", "tied"])
def test_a_granite_model_trains_like_hf(overrides, flags):
    """Granite is LLaMA's attention and MLP with multipliers: each sublayer's output scaled
    before the residual add (folded into the weights whose products the epilogues add), the logits
    divided (the LM head's input divided instead), the embeddings and attention scaled by HF's own
    code."""
    base = tiny("Granite", **GRANITE, **overrides)
    if overrides.get("attention_bias"):
        base = with_biases(base)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    assert model.model.layers[0].coda_attention.residual_scale == pytest.approx(0.22)
    assert model.coda_logits_scale == 8.0
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"add_residual", "rmsnorm_dx", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


@pytest.mark.parametrize(("overrides", "flags"), [({}, {}), ({"attention_out_bias": True}, {"rope": False})],
                         ids=["plain", "out-bias-hf-rope"])
def test_a_seed_oss_model_without_residual_dropout_trains_like_hf(overrides, flags):
    """Seed-OSS is LLaMA's modules with q/k/v biases and a dropout on what its attention and its
    MLP add to the residual stream: with that dropout off (``residual_dropout=0.0``) it is
    patched and trains like the unpatched model; with it on, refused by name (above)."""
    base = with_biases(tiny("SeedOss", residual_dropout=0.0, attention_dropout=0.0, attention_bias=True, **overrides))
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    assert model.model.coda_flags["rope"] is ("rope" not in flags)
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"row_dot_bias", "add_residual", "norm_swiglu", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


@pytest.mark.parametrize("swiglu", [True, False])
def test_a_gemma_model_trains_like_hf(swiglu):
    """Gemma's RMSNorm scales by 1 + w (in fp32) and its MLP is GeGLU: the input norm folds into
    the QKV GEMM with that scale, RoPE and the output projection are the suite's; the MLP block
    kernel's norm scales by w, so the MLP runs alone as the geglu_mlp kernel between HF's norm and
    residual add, and swiglu=False keeps HF's MLP."""
    base = tiny("Gemma")
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), swiglu=swiglu)
    assert model.model.layers[0].coda_plan.norm_offset == 1.0
    assert model.model.coda_flags["mlp_alone"] is swiglu
    assert set(model.state_dict()) == set(base.state_dict())  # HF's keys, gate and up apart
    with launch_ledger() as launched:
        got = train_and_eval(model)
    names = {launch.name for launch in launched}
    assert {"norm_rope", "rmsnorm_dx", "add_residual", "logits_lse"} <= names
    assert ({"geglu", "dgeglu"} <= names) is swiglu and "norm_swiglu" not in names
    assert_like_hf(got, hi, lo)
    with pytest.raises(KernelError, match=r"MLP block kernels \(mlp_block, mlp_block_fp8\) do not take: .* "
                                          r"drop fp8_mlp .* or pass swiglu=False"):
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), fp8_mlp=True)


def test_a_gemma_mlp_the_kernel_does_not_take_is_refused_before_anything_is_patched():
    """The last layer's gate frozen apart from its up: refused with the flag that keeps HF's MLP,
    and no layer is left patched."""
    model = copy.deepcopy(tiny("Gemma")).bfloat16()
    model.model.layers[-1].mlp.gate_proj.weight.requires_grad_(False)
    with pytest.raises(KernelError, match=r"layers.1.mlp: requires_grad differs .* or pass swiglu=False"):
        coda_agent.apply_to_llama(model)
    assert not any(hasattr(m, "coda_flags") or hasattr(m, "coda_plan") for m in model.modules())
    assert coda_agent.apply_to_llama(model, swiglu=False).model.coda_flags["mlp_alone"] is False


# Every expert routed (top-k = all): a top-2 choice can flip between bf16 runs at a near tie, which
# would test bf16 noise instead of the patch.  The router's load-balancing loss is on.
MOE = {"Mixtral": dict(num_local_experts=4, num_experts_per_tok=4),
       "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64, decoder_sparse_step=1),
       "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64)}


@pytest.mark.parametrize("family", list(MOE))
def test_a_mixture_of_experts_trains_like_hf_with_its_experts_kept(family):
    """Mixtral, Qwen3-MoE and Qwen2-MoE: with swiglu=False the experts (and Qwen2-MoE's shared
    expert) stay HF's, the attention side and the LM head are the suite's, and the loss adds the
    router's load-balancing loss as HF's does; with the MLP kernel asked for, refused by name."""
    base = tiny(family, **MOE[family], output_router_logits=True, router_aux_loss_coef=0.5)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), swiglu=False)
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"add_residual", "rmsnorm_dx", "logits_lse"} <= {launch.name for launch in launched}
    assert "norm_swiglu" not in {launch.name for launch in launched}
    # The routers' (E, H) gates are 512 numbers whose gradient a few tokens' routing terms make:
    # their norm is a few numbers' max rule (Qwen2-MoE's gate at 1.8x HF's relative error on this
    # machine's BLAS, within it on CI's), so they keep the max rule alone.
    assert_like_hf(got, hi, lo, few=1024)
    ids = torch.randint(0, 512, (2, 24))  # in training (the patched loss path), beside HF's own
    out = model.train()(ids, labels=ids)
    want = copy.deepcopy(base).bfloat16().train()(ids, labels=ids)
    assert out.logits is None and out.aux_loss is not None  # the fused LM head: no logits
    assert torch.allclose(out.aux_loss.float(), want.aux_loss.float(), rtol=0.02)
    assert len(out.router_logits) == base.config.num_hidden_layers
    without = copy.deepcopy(base).bfloat16()
    without.config.output_router_logits = False
    plain = coda_agent.apply_to_llama(without, swiglu=False).train()(ids, labels=ids)
    assert plain.aux_loss is None and abs(plain.loss.item() - out.loss.item()) > 1e-3
    with pytest.raises(KernelError, match="pass swiglu=False to keep"):
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_heads_wider_than_the_model_train_like_hf(family):
    """heads * head_dim past hidden_size (Qwen3-0.6B: 16 x 128 for 1024; Gemma's widths): the
    QKV GEMM is wider and the output projection (K, H) is not square, which the
    out_proj_residual task declares and verifies (its wide-heads set)."""
    wide = {"head_dim": 64}  # 4 heads x 64 = 256 for hidden_size 128
    base = tiny_llama(**wide) if family == "Llama" else tiny(family, **wide)
    assert base.model.layers[0].self_attn.o_proj.weight.shape == (128, 256)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    with launch_ledger() as launched:
        got = train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16()))
    assert {"add_residual", "rmsnorm_dx", "norm_swiglu"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


@pytest.mark.parametrize(("family", "overrides", "refusal"), [
    ("Cohere", {}, r"CohereAttention.forward is not LLaMA's, Mistral's"),
    ("Olmo2", {}, r"Olmo2Attention.forward is not LLaMA's, Mistral's, Ministral 3's, Qwen3's, Qwen2's, SmolLM3's, "
                  r"Phi-3's, Hunyuan's or Seed-OSS's attention"),
    ("Gemma2", {"hidden_act": "silu"}, r"Gemma2Attention.forward is not"),
    ("Phi3", {"resid_pdrop": 0.1}, r"layers.0.resid_attn_dropout drops with p = 0.1: .* resid_pdrop=0.0"),
    ("SeedOss", {"residual_dropout": 0.1}, r"layers.0.self_attn.residual_dropout = 0.1: .* residual_dropout=0.0"),
    # LLaMA's attention and a partial interleaved rotation (kept HF's), but a LayerNorm and a ReLU^2 MLP
    ("Nemotron", {}, r"NemotronMLP differs from LLaMA's mlp in \['gate_proj'\]: .* pass swiglu=False"),
], ids=["Cohere", "Olmo2", "Gemma2", "Phi3-dropout", "SeedOss-dropout", "Nemotron"])
def test_a_model_that_is_not_llama_s_modules_is_refused_by_what_differs(family, overrides, refusal):
    """Every module the patch replaces must compute what LLaMA's does, read from its code: a model
    with a (1 + w) RMSNorm, logit scaling, softcapped or post-normed attention would
    otherwise train silently wrong."""
    model = tiny(family, **overrides).bfloat16()
    with pytest.raises(KernelError, match=refusal):
        coda_agent.apply_to_llama(model)


@pytest.mark.parametrize(("family", "patch"), [("Phi", "apply_to_llama"), ("Phi", "apply_to_gpt2"),
                                           ("Phi", "apply_to_gpt_neox"), ("Olmo2", "apply_to_llama"),
                                           ("Cohere", "apply_to_llama")])
def test_a_model_no_drop_in_patches_is_refused_with_the_way_on(family, patch):
    """A model no drop-in patches (Phi-2's parallel block, OLMo-2's post-norms, Cohere's LayerNorms)
    is refused by what differs, and the refusal says what to do instead."""
    with pytest.raises(KernelError, match=r"; coda_agent.apply_to_model\(model\) patches the modules of it that "
                                          r"are a kernel's code \(MLPs gated or not, LLaMA's or Gemma-2's LM head and loss\), if any; "
                                          r"else train it unpatched, or write tasks for its blocks \(README, \"Write "
                                          r"your own task\"\) and run the accepted kernels with "
                                          r"coda_agent.kernels.load_kernel$"):
        getattr(coda_agent, patch)(tiny(family).bfloat16())


@pytest.mark.parametrize("patch", ["apply_to_gpt2", "apply_to_gpt_neox"])
def test_a_refusal_sends_a_model_on_only_to_a_drop_in_that_takes_it(patch):
    """StableLM holds LLaMA's decoder stack but not its modules: the other drop-ins' refusals say
    that apply_to_llama refuses it too, and why, instead of sending the user there; a LLaMA is
    sent there."""
    with pytest.raises(KernelError, match=r"it is built like LLaMA, but coda_agent.apply_to_llama refuses it too "
                                          r"\(StableLmAttention.forward is not LLaMA's, .*\); .*train it unpatched"):
        getattr(coda_agent, patch)(tiny("StableLm").bfloat16())
    with pytest.raises(KernelError, match=r"it is built like LLaMA: coda_agent.apply_to_llama\(model\) patches those$"):
        getattr(coda_agent, patch)(tiny_llama().bfloat16())


class AdapterLinear(torch.nn.Linear):
    """A projection with an adapter beside its weight that is not peft's LoRA (which runs beside the
    kernels: test_lora.py)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.lora_a = torch.nn.Linear(linear.in_features, 2, bias=False)


def test_a_wrapped_projection_or_a_compiled_model_is_refused_with_the_fix():
    """What would lose its meaning inside the fused weights (an adapter, a quantized layer) is
    refused, and so is torch.compile's wrapper (patch first, then compile)."""
    model = tiny_llama().bfloat16()
    attn = model.model.layers[1].self_attn
    attn.v_proj = AdapterLinear(attn.v_proj).bfloat16()
    with pytest.raises(KernelError, match=r"layers.1.self_attn.v_proj is AdapterLinear, not nn.Linear: .* "
                       "merge such adapters into the weights first"):
        coda_agent.apply_to_llama(model)
    with pytest.raises(KernelError, match=r"wrapped by torch.compile; patch the model itself first"):
        coda_agent.apply_to_llama(torch.compile(tiny_llama().bfloat16()))



def test_what_fusing_or_the_fused_head_would_change_is_refused_with_the_fix():
    """Parts of one fused weight frozen apart (the fused Parameter has one requires_grad, so k and
    v would freeze with q, or a frozen q train with k and v), an LM head with a bias (the fused
    loss reads its weight alone) and a vocabulary the fused loss's logits rows cannot hold (a
    multiple of 8, as every drop-in's) are refused at patch time, not at the first step; a
    classification head or a DataParallel wrapper is pointed at what to patch."""
    import transformers

    model = tiny_llama().bfloat16()
    model.model.layers[1].self_attn.q_proj.weight.requires_grad_(False)
    with pytest.raises(KernelError, match=r"layers.1.self_attn: requires_grad differs across the weights of q_proj, "
                       r"k_proj, v_proj .* freeze or unfreeze them together"):
        coda_agent.apply_to_llama(model)
    model = tiny_llama().bfloat16()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    with pytest.raises(KernelError, match=r"layers.0.mlp: requires_grad differs .* pass swiglu=False"):
        coda_agent.apply_to_llama(model)
    assert coda_agent.apply_to_llama(model, swiglu=False).model.layers[0].mlp.up_proj.weight.requires_grad is False
    model = tiny_llama().bfloat16()
    model.lm_head = torch.nn.Linear(128, 512, bias=True).bfloat16()
    with pytest.raises(KernelError, match=r"lm_head has a bias: .* pass fused_linear_cross_entropy=False"):
        coda_agent.apply_to_llama(model)
    coda_agent.apply_to_llama(model, fused_linear_cross_entropy=False)
    with pytest.raises(KernelError, match=r"the vocabulary has 509 tokens, not a multiple of 8: .* pass "
                                          r"fused_linear_cross_entropy=False"):
        coda_agent.apply_to_llama(tiny_llama(vocab_size=509).bfloat16())
    coda_agent.apply_to_llama(tiny_llama(vocab_size=509).bfloat16(), fused_linear_cross_entropy=False)
    torch.manual_seed(0)
    classifier = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**CONFIG)).bfloat16()
    with pytest.raises(KernelError, match=r"got LlamaForSequenceClassification; .* apply_to_llama\(model.model\)"):
        coda_agent.apply_to_llama(classifier)
    with pytest.raises(KernelError, match=r"got DataParallel; it wraps the model \(model.module\)"):
        coda_agent.apply_to_llama(torch.nn.DataParallel(tiny_llama().bfloat16()))


@pytest.mark.parametrize("family", ["Llama", "Phi3"])
def test_a_patched_model_saves_with_save_pretrained_and_pickles(tmp_path, family):
    """save_pretrained writes HF's checkpoint (the split gate/up rows as tensors of their own: its
    shared-storage check reads each tensor through view(-1)), which an unpatched model loads;
    torch.save of the whole patched model (its state-dict hooks included) loads back patched."""
    import transformers

    hf = (tiny_llama() if family == "Llama" else tiny(family)).bfloat16()
    model = coda_agent.apply_to_llama(copy.deepcopy(hf))
    model.save_pretrained(tmp_path / "hf")
    loaded = getattr(transformers, f"{family}ForCausalLM").from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    want = hf.state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    assert again.model.layers[0].forward.module is again.model.layers[0]
    a, b = train_and_eval(model), train_and_eval(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize(("family", "overrides", "flags", "launches"), [
    ("Gemma", {}, {"swiglu": False}, {"norm_rope", "rmsnorm_dx", "add_residual"}),
    ("Granite", GRANITE, {}, {"norm_rope", "add_residual", "norm_swiglu", "dswiglu"}),
    ("SmolLM3", {"no_rope_layers": [1, 0], "use_sliding_window": False}, {}, {"norm_rope", "scale_rows"}),
    ("Qwen3", {"head_dim": 64}, {}, {"scale_rows", "add_residual", "rmsnorm_dx"}),
    ("Ministral", {"sliding_window": 8}, {}, {"norm_rope", "norm_swiglu"}),
    ("Ernie4_5", {}, {}, {"norm_rope", "norm_swiglu", "rope_inverse"}),
    ("Mixtral", {**MOE["Mixtral"], "output_router_logits": True}, {"swiglu": False},
     {"norm_rope", "add_residual", "rmsnorm_dx", "logits_lse"}),
], ids=["gemma", "granite", "smollm3", "qwen3-wide-heads", "ministral", "ernie4_5-interleaved", "mixtral"])
def test_families_train_like_hf_on_gpu(monkeypatch, family, overrides, flags, launches):
    """The families whose differences are PyTorch re-layouts and weight scales around the suite's
    kernels, on quack's GEMMs (the cute lowering): Gemma's (1 + w) norm in fp32, Granite's
    multipliers, SmolLM3's layers without RoPE, heads wider than the model, Ministral's window,
    Ernie 4.5's interleaved rotation in the QKV epilogue, Mixtral's experts kept HF's (with the
    router's loss)."""
    import test_llama

    monkeypatch.setattr(test_llama, "DEVICE", "cuda")
    base = tiny(family, **overrides)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    # the backward on the calling thread: autograd's CUDA device threads do not see the ledger
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags))
    assert launches <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)
