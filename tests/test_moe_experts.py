"""coda_agent.apply_to_model on a mixture of experts' experts kept as 3-D weights
(kernels/moe_experts.py): OLMoE, Qwen2-MoE, Mixtral and Granite-MoE at tiny widths (CPU, the
reference lowering), each expert run as swiglu_mlp, and GPT-OSS's and DeepSeek-V4's clamped
experts as swiglu_clamp_mlp, held to test_llama.py's bar against the unpatched model.  Routing is
discrete: a router logit that rounds across its neighbour sends a token elsewhere, in HF's own bf16
model and in the patched one at different tokens, so the whole-model comparisons route every token
to every expert (top-k = all), and top-2 routing is judged on the experts module itself, given the
same routing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from test_llama import assert_like_hf, hf_layout, train_and_eval  # noqa: E402
from test_plain_mlps import data  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import moe_experts  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

# family -> where its layers' experts are
FAMILIES = {"Olmoe": "model.layers.{}.mlp.experts", "Qwen2Moe": "model.layers.{}.mlp.experts",
            "Mixtral": "model.layers.{}.mlp.experts", "GraniteMoe": "model.layers.{}.block_sparse_moe.experts"}


def tiny_moe(family: str, top_k: int = 4, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' ``<family>`` causal LM at tiny widths with four experts, its 3-D expert
    weights drawn at a trained model's scale (HF's init leaves some at zero here)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, num_experts=4, num_local_experts=4, num_experts_per_tok=top_k,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0.0, 0.05)
    return model


def patched(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Mixtral's: apply_to_llama takes its layers too
        return coda_agent.apply_to_model(model, fused_linear_cross_entropy=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_train_like_hf(family):
    base = tiny_moe(family)
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data()) for dtype in (torch.float32, torch.bfloat16))
    model = patched(copy.deepcopy(base).bfloat16())
    assert [FAMILIES[family].format(i) for i in range(2)] == [n for n in model.coda_flags["swiglu_mlp"]
                                                              if n.endswith("experts")]
    with launch_ledger() as launched:
        got = train_and_eval(model, data())
    assert_like_hf(got, hi, lo)  # the experts' gradients in HF's layout, through the state dict
    names = [launch.name for launch in launched]
    assert names.count("dswiglu") >= 2 * 4  # every expert of both layers, backward


def test_top2_routing_runs_each_expert_on_its_tokens_as_hf_does():
    """The experts module given HF's routing (top 2 of 4, one expert left without a token): its
    output and every gradient against HF's module in fp32, within twice HF's own bf16 error."""
    base = tiny_moe("Olmoe", top_k=2).model.layers[0].mlp.experts
    hi, lo = (_routed_run(copy.deepcopy(base), dtype, 3) for dtype in (torch.float32, torch.bfloat16))
    module = copy.deepcopy(base).bfloat16()
    moe_experts.patch(module, None, "swiglu_mlp", coda_agent.kernels.dropin.suite_kernel("swiglu_mlp"))
    got = _routed_run(module, torch.bfloat16, 3)
    assert_like_hf(got, hi, lo)
    assert not got["d down_proj"][3].any()  # the expert no token was routed to: no gradient


def test_the_state_dict_keeps_hf_s_layout_both_ways():
    base = tiny_moe("Olmoe").bfloat16()
    model = patched(copy.deepcopy(base))
    experts = model.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, base.model.layers[0].mlp.experts.gate_up_proj)  # interleaved
    saved = model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in base.state_dict().items())
    trained = tiny_moe("Olmoe", seed=1).bfloat16()
    model.load_state_dict(trained.state_dict())
    ids = data()[0]
    torch.testing.assert_close(model(ids).logits, patched(copy.deepcopy(trained))(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["Mixtral", "Qwen2Moe"])
def test_apply_to_llama_runs_the_experts_with_swiglu_off(family):
    """A mixture that apply_to_llama takes keeps its sparse block HF's (swiglu=False) and runs its
    experts as kernels; experts=False keeps them HF's too."""
    base = tiny_moe(family)
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data()) for dtype in (torch.float32, torch.bfloat16))
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), swiglu=False)
    assert model.model.coda_flags["experts"] == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert_like_hf(train_and_eval(model, data()), hi, lo)
    kept = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), swiglu=False, experts=False)
    assert kept.model.coda_flags["experts"] == [] and not hasattr(kept.model.layers[0].mlp.experts, "coda_mlp")


def test_experts_no_kernel_computes_are_passed_by_with_why():
    relu = tiny_moe("Olmoe", hidden_act="relu").bfloat16()
    is_experts, task, why = moe_experts.recognised(relu.model.layers[0].mlp.experts)
    assert is_experts and task is None and "OlmoeExperts's experts apply ReLU" in why
    after_act = deepseek_v4_experts()  # Step-3.7's gate: the clamp after SiLU, not before it
    after_act._apply_gate = lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0]).clamp(max=10.0) * gu.chunk(
        2, -1)[1].clamp(-10.0, 10.0)
    is_experts, task, why = moe_experts.recognised(after_act)
    assert is_experts and task is None and "DeepseekV4Experts._apply_gate is not min(g, 10.0)" in why, why
    no_limit = deepseek_v4_experts()
    no_limit.limit = None
    assert moe_experts.recognised(no_limit) == (True, None, "DeepseekV4Experts has no finite clamp limit (limit "
                                                            "or swiglu_limit): not the clamped SwiGLU")


def gpt_oss(layers: int = 2, top_k: int = 4, seed: int = 0) -> torch.nn.Module:
    """GPT-OSS's causal LM at tiny widths with four experts (top-k of them), its experts' weights
    and biases at a trained model's scale."""
    import transformers

    config = transformers.GptOssConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                                       num_local_experts=4, num_experts_per_tok=top_k, pad_token_id=None,
                                       bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.05 if p.dim() == 3 else 0.5)
    return model


def deepseek_v4_experts() -> torch.nn.Module:
    """DeepSeek-V4's experts module alone (clamped SiLU gate, gate/up in halves, no biases)."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    config = transformers.DeepseekV4Config(hidden_size=128, moe_intermediate_size=128, n_routed_experts=4,
                                           num_experts_per_tok=2)
    torch.manual_seed(0)
    module = DeepseekV4Experts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.05)
    return module


def test_gpt_oss_trains_like_hf():
    """GPT-OSS's experts (interleaved (E, H, 2I) weights, biases, the clamped SwiGLU with alpha
    1.702 and offset 1) as swiglu_clamp_mlp, every token to every expert.  The attention sinks'
    gradient (one value per head, a sum over every token) is four numbers: its relative norm error
    is the max rule's, which holds it."""
    base = gpt_oss()
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data()) for dtype in (torch.float32, torch.bfloat16))
    model = patched(copy.deepcopy(base).bfloat16())
    assert model.coda_flags["swiglu_clamp_mlp"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    assert experts.coda_variant.params == {"limit": 7.0, "alpha": 1.702, "offset": 1.0}
    assert experts.gate_up_proj[0].t().is_contiguous() and experts.down_proj[0].t().is_contiguous()
    with launch_ledger() as launched:
        got = train_and_eval(model, data())
    assert_like_hf(got, hi, lo, few=8)
    assert [launch.name for launch in launched].count("dclamp_swiglu") == 2 * 4
    assert all(torch.equal(v, base.bfloat16().state_dict()[k]) for k, v in patched(gpt_oss().bfloat16()).state_dict(
        ).items())  # values and keys as HF's: the column-major storage is a layout, not a change


def _routed_run(module: torch.nn.Module, dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """The experts module on HF's routing, top 2 of 4 with expert 3 left without a token: its
    output and every gradient (the routing weights' too)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, dout = torch.randn(40, 128, generator=gen), torch.randn(40, 128, generator=gen)
    index = torch.stack((torch.randint(0, 2, (40,), generator=gen), torch.full((40,), 2)), 1)
    weights = torch.softmax(torch.randn(40, 2, generator=gen), dim=1)
    module = module.to(device=device, dtype=dtype)
    h = hidden.to(device, dtype).requires_grad_(True)
    w = weights.to(device, dtype).requires_grad_(True)
    y = module(h, index.to(device), w)
    y.backward(dout.to(device, dtype))
    grads = {f"d {k}": v.float().cpu() for k, v in hf_layout(module).items()}
    return {"y": y.detach().float().cpu(), "dh": h.grad.float().cpu(), "dw": w.grad.float().cpu(), **grads}


@pytest.mark.parametrize("family", ["GptOss", "DeepseekV4"])
def test_clamped_experts_clamp_and_route_as_hf_does(family, device="cpu"):
    """With the limit at 1, about 7% of the pre-activations clamp: the module's output and every
    gradient against HF's module in fp32 within its bar on three routings, where the clamps' kinks
    move a gradient by a whole term wherever a rounding crosses a bound (so the max rule is 3x HF's
    bf16 error, as the task's kinked gradients are widened)."""
    base = gpt_oss(layers=1).model.layers[0].mlp.experts if family == "GptOss" else deepseek_v4_experts()
    base.limit = 1.0
    for seed in range(3):
        hi, lo = (_routed_run(copy.deepcopy(base), dtype, seed, device) for dtype in (torch.float32, torch.bfloat16))
        module = copy.deepcopy(base).bfloat16()
        moe_experts.patch(module, None, "swiglu_clamp_mlp", coda_agent.kernels.dropin.suite_kernel("swiglu_clamp_mlp"))
        assert module.coda_variant.params["limit"] == 1.0
        got = _routed_run(module, torch.bfloat16, seed, device)
        assert_like_hf(got, hi, lo, err_factor=3)
        assert not got["d down_proj"][3].any()  # the expert no token was routed to: no gradient


def test_lora_on_the_experts_weights_is_refused_with_the_fix():
    """peft's LoRA on the experts' parameters (target_parameters) parametrizes them for each forward,
    which a kernel reading the weights would bypass: refused, naming the flag that keeps them HF's."""
    peft = pytest.importorskip("peft")
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = peft.get_peft_model(tiny_moe("Olmoe").bfloat16(), peft.LoraConfig(r=4, target_modules=[],
                                                                                target_parameters=targets))
    with pytest.raises(coda_agent.kernels.KernelError, match=r"mlp.experts.base_layer.base_layer has LoRA adapters "
                                                            r"on its weights .* pass mlp=False"):
        coda_agent.apply_to_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = coda_agent.apply_to_model(model, mlp=False)
    assert kept.get_base_model().coda_flags["swiglu_mlp"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("family", ["GptOss", "DeepseekV4"])
def test_clamped_experts_clamp_and_route_as_hf_does_on_gpu(family):
    """The cute lowering: swiglu_clamp_mlp per expert, GPT-OSS's column-major slices included."""
    with torch.autograd.set_multithreading_enabled(False):
        test_clamped_experts_clamp_and_route_as_hf_does(family, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_experts_train_like_hf_on_gpu():
    """The cute lowering: swiglu_mlp per expert, on each expert's slice of the 3-D weights."""
    base = tiny_moe("Olmoe").cuda()
    batch = tuple(t.cuda() for t in data())
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), batch) for dtype in (torch.float32, torch.bfloat16))
    with torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(patched(copy.deepcopy(base).bfloat16()), batch)
    assert_like_hf(got, hi, lo)
