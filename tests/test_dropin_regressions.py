"""What ``bench/hf_sweep.py`` (every transformers causal LM, tiny, through every drop-in, held to
test_llama.py's bar) found wrong or crashing, each on a real transformers model at a tiny config on
the CPU (the reference lowering): the loss, the logits and every gradient against the unpatched
model in fp32, within twice HF's own bf16 error, or the refusal with its fix.

- Activations that agree with a kernel's near zero and clip further out: ReLU6 (ReLU up to 6) and
  transformers' ``gelu_10`` (the exact GELU up to 10) passed the activation probe on [-6, 6] and ran
  as ``linear_relu`` and ``gelu_mlp``, unclipped.  The MLPs' first GEMMs are scaled here
  (:func:`loud`) so that the pre-activations reach past the clip, as a trained model's do.
- An activation with parameters (``hidden_act="prelu"``: nn.PReLU, its slope trains) crashed the
  probe (an fp64 input against its fp32 weight) in every drop-in; it computes no fixed form, so it
  is passed by (``apply_to_model``) or refused with the flag (``apply_to_gpt2``).
- BLOOM's MLP with ``pretraining_tp > 1`` and ``slow_but_exact`` sums the projection's slices with
  no bias: the kernel added ``dense_4h_to_h.bias`` all the same.
- Refusals by a drop-in of whole layers that did not name the way on: a decoder layer without
  ``self_attn`` (JetMoE, the hybrids), a norm that is not LLaMA's (Nemotron's LayerNorm1P), and
  GPT-BigCode under ``apply_to_gpt2``, which said "keep this model unpatched" where
  ``apply_to_model`` patches its MLPs and head.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_llama import assert_like_hf, batch, hf_layout, train_and_eval, truth_of  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.kernels import dropin, linear_acts, plain_mlps  # noqa: E402

LOUD = 50.0  # pre-activations of std ~8: well past ReLU6's 6 and the clipped GELU's 10
WIDTHS = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=512)
# (causal LM class, its config beyond the widths): an inline MLP (OPT's fc1 and activation, the
# linear_acts rule), an MLP module (GPT-Neo's, the plain_mlps rule)
MODELS = {"OPT": ("OPTForCausalLM", dict(ffn_dim=256, word_embed_proj_dim=128, dropout=0.0)),
          "GPT-Neo": ("GPTNeoForCausalLM", dict(intermediate_size=256, num_heads=4, num_layers=2,
                                                attention_types=[[["global"], 2]], resid_dropout=0.0,
                                                embed_dropout=0.0, attention_dropout=0.0))}


def tiny_model(cls_name: str, seed: int = 0, **config) -> torch.nn.Module:
    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    return cls(cls.config_class(**{**WIDTHS, **config}))


def loud(model: torch.nn.Module) -> torch.nn.Module:
    """The MLPs' first GEMMs (each nn.Linear that widens, the LM head aside) scaled by LOUD."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings() \
                    and m.out_features > m.in_features:
                m.weight.mul_(LOUD)
    return model


@pytest.mark.parametrize(("family", "act"), [("OPT", "relu6"), ("GPT-Neo", "gelu_10"), ("GPT-Neo", "relu6")])
def test_an_activation_that_clips_past_the_probe_stays_hfs(family, act):
    cls_name, config = MODELS[family]
    base = loud(tiny_model(cls_name, activation_function=act, **config))
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert [task for task, names in model.coda_flags.items() if names and task != "fused_linear_cross_entropy"] == []
    assert_like_hf(train_and_eval(model), hi, lo)


def test_the_probe_reaches_past_the_clips_and_keeps_the_forms():
    from transformers.activations import ACT2FN

    forms = {name: dropin.activation_form(ACT2FN[name], plain_mlps.FORMS)
             for name in ("relu", "relu6", "relu2", "gelu", "gelu_10", "gelu_new", "gelu_pytorch_tanh", "prelu")}
    assert forms == {"relu": "relu", "relu6": None, "relu2": "relu2", "gelu": "exact", "gelu_10": None,
                     "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "prelu": None}
    assert dropin.activation_form(ACT2FN["relu6"], linear_acts.FORMS) is None
    assert dropin.gelu_form(ACT2FN["gelu_10"]) is None and dropin.gelu_form(torch.nn.GELU()) == "exact"


def test_an_activation_with_parameters_is_passed_by_or_refused_with_the_flag():
    base = tiny_model("LlamaForCausalLM", intermediate_size=256, hidden_act="prelu")
    hi, lo = truth_of(base)
    with pytest.warns(UserWarning, match=r"apply_to_llama\(model\) takes this model"):  # with swiglu=False
        model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())  # the head alone
    assert model.coda_flags["fused_linear_cross_entropy"] and not model.coda_flags["swiglu_mlp"]
    assert_like_hf(train_and_eval(model), hi, lo)
    gpt2 = tiny_model("GPT2LMHeadModel", n_embd=128, n_head=4, n_layer=2, activation_function="prelu",
                      resid_pdrop=0.0)
    with pytest.raises(KernelError, match=r"h\.0\.mlp\.act \(PReLU.*pass mlp=False"):
        coda_agent.apply_to_gpt2(gpt2.bfloat16())


def step_with_unused(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """test_llama's ``train_and_eval``, for a model with parameters its forward does not read (their
    gradients zeros)."""
    ids, labels = batch()
    model.train()
    model.zero_grad()
    out = model(ids, labels=labels)
    out.loss.backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = hf_layout(model)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    return {"loss": out.loss.detach(), "logits": logits, **{f"d {k}": v for k, v in grads.items()}}


def test_blooms_tensor_parallel_mlp_adds_no_projection_bias():
    base = tiny_model("BloomForCausalLM", n_head=4, n_layer=2, pretraining_tp=2, slow_but_exact=True,
                      hidden_dropout=0.0, attention_dropout=0.0)
    with torch.no_grad():  # biases at the weights' scale (HF's are zeros, where a stray one would not show)
        for name, p in base.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hi, lo = step_with_unused(copy.deepcopy(base).float()), step_with_unused(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert len(model.coda_flags["gelu_tanh_mlp"]) == 2
    got = step_with_unused(model)
    unread = [k for k in hi if k.startswith("d ") and not hi[k].any()]  # the dense biases the forward skips
    assert "d transformer.h.0.mlp.dense_4h_to_h.bias" in unread and not any(got[k].any() for k in unread)
    assert_like_hf(*({k: v for k, v in d.items() if k not in unread} for d in (got, hi, lo)))


@pytest.mark.parametrize(("drop_in", "cls_name", "config", "flags"), [
    ("apply_to_llama", "JetMoeForCausalLM", dict(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                                                 kv_channels=32), {}),
    ("apply_to_llama", "NemotronForCausalLM", dict(intermediate_size=256, num_key_value_heads=2), {"swiglu": False}),
    ("apply_to_gpt2", "GPTBigCodeForCausalLM", dict(n_embd=128, n_head=4, n_layer=2), {}),
    ("apply_to_gpt2", "GPTBigCodeForCausalLM", dict(n_embd=128, n_head=4, n_layer=2, multi_query=False), {})],
    ids=["JetMoE", "Nemotron", "GPT-BigCode", "GPT-BigCode-MHA"])
def test_a_layer_drop_ins_refusal_names_apply_to_model(drop_in, cls_name, config, flags):
    model = tiny_model(cls_name, **config).bfloat16()
    with pytest.raises(KernelError, match=r"coda_agent\.apply_to_model\(model\) patches the modules"):
        getattr(coda_agent, drop_in)(model, **flags)
    patched = coda_agent.apply_to_model(model)  # which does patch something of each
    assert any(v for k, v in patched.coda_flags.items())
