"""apply_to_llama on the families whose attention differs from LLaMA's around RoPE (transformers
models built from tiny configs, CPU, the reference lowering; test_llama.py's bar): a rotation of
another layout (Ernie 4.5's and Helium's interleaved pairs, fused in the QKV epilogue), q/k norms
after the rotation (Hunyuan's), q scaled per position after it (Ministral 3's); and how a copied
attention is told apart from its family's by the helpers it calls (``families.same_code``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from test_llama import assert_like_hf, tiny, tiny_llama, train_and_eval  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                   "llama_4_scaling_beta": 2.0}


def test_a_ministral3_model_with_a_query_scale_per_position_trains_like_hf():
    """Ministral 3 scales q after RoPE by 1 + beta * log(1 + floor(pos / n)) (LLaMA-4's attention
    scaling; n = 8 here, so the 24 tokens see three scales), and its YaRN RoPE stays HF's
    (``rope=False``, which its refusal names): patched, it trains like the unpatched model, and
    the scaling matters (the same model without it misses HF's bar)."""
    base = tiny("Ministral3", rope_parameters=MINISTRAL3_ROPE)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    with pytest.raises(KernelError, match=r"rope_type 'yarn' .* pass rope=False"):
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), rope=False)
    assert model.model.layers[0].coda_attention.query_scale is not None
    assert_like_hf(train_and_eval(model), hi, lo)
    unscaled = tiny("Ministral3", rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0})
    with pytest.raises(AssertionError):
        assert_like_hf(train_and_eval(unscaled.bfloat16()), hi, lo)


def test_a_hunyuan_model_with_q_k_norms_after_rope_trains_like_hf():
    """Hunyuan's dense models are LLaMA's modules whose attention normalizes q and k per head
    *after* RoPE (``query_layernorm``, ``key_layernorm``; weights off one here, so the order
    shows): RoPE and the norms stay HF's, in HF's order, and it trains like the unpatched model."""
    base = tiny("HunYuanDenseV1")
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    plan = model.model.layers[0].coda_attention
    assert (plan.qk_norm, plan.norm_after_rope, plan.qk_norms) == (True, True, ("query_layernorm", "key_layernorm"))
    assert model.model.coda_flags["rope"] is False
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"scale_rows", "add_residual", "norm_swiglu", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


def test_same_code_compares_the_helpers_a_function_calls():
    """Two functions of the same bytecode that call a module-level helper of the same name are the
    same code only if the helpers are (a copied forward may call a rotation of another layout)."""
    from coda_agent.kernels.families import same_code

    def make(helper_body: str):
        scope: dict = {}
        exec(f"def helper(x):\n    return {helper_body}\n\ndef forward(x):\n    return helper(x) + 1\n", scope)
        return scope["forward"]

    assert same_code(make("x * 2"), make("x * 2"))
    assert not same_code(make("x * 2"), make("x * 3"))
    assert same_code(make("x * 2"), make("x * 3"), frozenset({"helper"}))  # a name the caller binds itself


def test_an_attention_that_calls_another_helper_is_refused_by_that_helper():
    """A copy of LLaMA's attention whose module binds one of the helpers it calls to another
    function (here the eager attention) computes something else: refused, naming the helper; its
    rotation alone may differ (the patched layer calls it: test_an_interleaved_rotation_...)."""
    import types

    from transformers.models.llama.modeling_llama import LlamaAttention

    def other_attention(*args, **kwargs):
        raise AssertionError("never called: the model is refused")

    fwd = LlamaAttention.forward
    scope = {**fwd.__globals__, "eager_attention_forward": other_attention}
    copied = type("CopiedAttention", (LlamaAttention,), {"forward": types.FunctionType(
        fwd.__code__, scope, fwd.__name__, fwd.__defaults__, fwd.__closure__)})
    model = tiny_llama().bfloat16()
    for layer in model.model.layers:
        layer.self_attn.__class__ = copied
    with pytest.raises(KernelError, match=r"CopiedAttention.forward is the code of LLaMA's attention, but the "
                                          r"eager_attention_forward it calls \(transformers.models.llama."
                                          r"modeling_llama\) differs from LLaMA's"):
        coda_agent.apply_to_llama(model)


@pytest.mark.parametrize("family", ["Ernie4_5", "Helium"])
@pytest.mark.parametrize("flags", [{}, {"rope": False}], ids=["rope-in-epilogue", "hf-rope"])
def test_an_interleaved_rotation_trains_like_hf(family, flags):
    """Ernie 4.5 and Helium are LLaMA's modules whose attention rotates interleaved pairs (x[2i],
    x[2i + 1]; GPT-J's and GLM's layout), and Helium's RMSNorm scales in fp32: the QKV epilogue
    rotates those pairs with the fused rows in HF's order (LLaMA's halves are permuted), or HF's
    rotation runs (``rope=False``); either way the model trains like the unpatched one, and its
    state dict is HF's."""
    base = tiny(family)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    plan = model.model.layers[0].coda_plan
    assert (plan.rope, plan.permutes) == (not flags, False) and (flags or plan.rope_layout == "pairs")
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert ("norm_rope" in {launch.name for launch in launched}) is not flags
    assert_like_hf(got, hi, lo)
    want = base.bfloat16().state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items()) and set(want) == set(model.state_dict())
