"""coda_agent.apply_to_model on transformers models that no drop-in of whole layers takes (tiny
configs, CPU, the reference lowering), held to test_llama.py's bar: the loss, the logits and every
gradient against the unpatched model in fp32, within twice HF's own bf16 error.

The models differ from LLaMA where the layer drop-ins cannot follow (OLMo-2's post-norms and
full-width q/k norms, Cohere's parallel block and LayerNorm, StableLM's LayerNorms and partial
RoPE, Exaone 4's mix of norms, Gemma-2's sandwich norms and soft-caps), while their MLPs (and some
LM heads) are LLaMA's code: those run as kernels (SwiGLU's, or Gemma's GeGLU), everything else
stays HF's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from test_llama import assert_like_hf, batch, tiny, tiny_llama, train_and_eval, truth_of  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

# family -> its MLPs' kernel, and its LM head's logits epilogue: the head and loss run fused where the
# causal LM's forward is LLaMA's code, Gemma-2's (which soft-caps the logits), or code of its own that
# passes the head probe (Cohere's scales the logits, StableLM's is its own copy of LLaMA's)
FAMILIES = {"Olmo2": ("swiglu_mlp", "logits_lse"), "Cohere": ("swiglu_mlp", "logits_lse"),
            "StableLm": ("swiglu_mlp", "logits_lse"),
            "Exaone4": ("swiglu_mlp", "logits_lse"), "Gemma2": ("geglu_mlp", "capped_logits")}
DEVICE = "cpu"


def tiny_olmo2(seed: int = 0, **overrides) -> torch.nn.Module:
    """OLMo-2 at the tiny LLaMA config's widths: post-norm layers, so apply_to_llama refuses it."""
    return tiny("Olmo2", seed, **overrides).to(DEVICE)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_no_layer_drop_in_takes_trains_like_hf(family):
    base = tiny(family)
    with pytest.raises(KernelError):  # the whole-layer drop-in refuses it: that is this one's use
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    layers = base.config.num_hidden_layers
    task, head = FAMILIES[family]
    assert model.coda_flags == {"swiglu_mlp": [], "geglu_mlp": [], "swiglu_clamp_mlp": [], "gelu_mlp": [],
                                "gelu_tanh_mlp": [], "relu_mlp": [], "relu2_mlp": [],
                                "linear_gelu": [], "linear_gelu_tanh": [], "linear_relu": [], task: [f"model.layers.{i}.mlp" for i in range(layers)],
                                "fused_linear_cross_entropy": head is not None}
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    names = [launch.name for launch in launched]
    # every MLP: forward in the training step and the eval pass, backward once
    act = task.split("_")[0]
    assert names.count(act) == 2 * layers and names.count(f"d{act}") == layers
    assert [n for n in names if n in ("logits_lse", "capped_logits")] == ([head] if head else [])


@pytest.mark.parametrize("cap", [5.0, None])
def test_gemma2s_soft_capped_logits_train_like_hf(cap):
    """Gemma-2's head soft-caps the logits by ``final_logit_softcapping``, the fused head's ``cap``
    (the tied head scaled up so that the logits reach beyond the cap: uncapped, the loss is 73,
    capped at 5, 8.9); without a cap its head is LLaMA's, the plain kernel."""
    def bent(model: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)
        return model

    base = bent(tiny("Gemma2", final_logit_softcapping=cap))
    hi, lo = truth_of(base)
    # the cap bends these logits: uncapped they reach 85
    assert hi["logits"].abs().max() > 50 if cap is None else hi["logits"].abs().max() <= cap
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert model.coda_softcap == cap
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    assert ("capped_logits" if cap else "logits_lse") in {launch.name for launch in launched}


def tiny_gemma4(cls_name: str) -> torch.nn.Module:
    """Gemma-4 (or Gemma-4 Unified) at the tiny config's widths, a layer of each attention kind and a
    last layer reading the one before's keys and values (shared KV states), its logits capped at 5
    and its tied head scaled so that they reach past the cap."""
    import test_llama
    import transformers

    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    config = cls.config_class(**{**test_llama.CONFIG, "pad_token_id": None, "bos_token_id": None,
                                 "eos_token_id": None, "num_hidden_layers": 3, "num_kv_shared_layers": 1,
                                 "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                                 "sliding_window": 8, "hidden_size_per_layer_input": 16,
                                 "vocab_size_per_layer_input": test_llama.CONFIG["vocab_size"],
                                 "final_logit_softcapping": 5.0})
    base = test_llama.with_norms_off_one(cls(config).to(test_llama.DEVICE))
    with torch.no_grad():
        base.lm_head.weight.mul_(30.0)
    return base


def assert_gemma4_trains_like_hf(cls_name: str) -> None:
    base = tiny_gemma4(cls_name)
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert model.coda_softcap == 5.0 and model.coda_flags["fused_linear_cross_entropy"]
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    assert "capped_logits" in {launch.name for launch in launched}
    ids, labels = batch()
    out, hf = (m.train()(ids, labels=labels, return_shared_kv_states=True) for m in (model, base.bfloat16()))
    assert type(out) is type(hf) and out.logits is None
    assert set(out.shared_kv_states) == set(hf.shared_kv_states) != set()


@pytest.mark.parametrize("cls_name", ["Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM"])
def test_gemma4s_soft_capped_head_trains_like_hf_and_keeps_its_output(cls_name):
    """Gemma-4's causal LM code is its own (the decoder takes per-layer inputs and returns the
    shared KV states, in Gemma-4's output class) and soft-caps as Gemma-2's does: its head runs
    as the capped kernel, and the patched forward still returns the model's own output class with
    the decoder's fields."""
    assert_gemma4_trains_like_hf(cls_name)


def test_a_phi3_mlp_and_a_model_a_layer_drop_in_takes():
    """Phi-3's MLP keeps gate and up in one projection, in halves: fused into interleaved rows all
    the same.  apply_to_llama takes Phi-3 and fuses more, which apply_to_model says."""
    base = tiny("Phi3")
    hi, lo = truth_of(base)
    with pytest.warns(UserWarning, match=r"apply_to_llama\(model\) takes this model and also folds its norms"):
        model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert model.coda_flags["fused_linear_cross_entropy"] and len(model.coda_flags["swiglu_mlp"]) == 2
    assert_like_hf(train_and_eval(model), hi, lo)


def test_state_dict_keeps_hf_keys_and_values():
    hf = tiny_olmo2().bfloat16()
    model = coda_agent.apply_to_model(copy.deepcopy(hf))
    assert "model.layers.0.mlp.gate_up_proj.weight" in dict(model.named_parameters())
    want, got = hf.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = tiny_olmo2(seed=5).bfloat16()  # an HF checkpoint loads into the patched model ...
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())
    fresh = tiny_olmo2(seed=9).bfloat16()  # ... and the patched model's into an unpatched one
    fresh.load_state_dict(model.state_dict())
    ids, _ = batch()
    with torch.no_grad():
        a, b = model.eval()(ids).logits.float(), fresh.eval()(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_frozen_mlps_skip_their_weight_gradient_gemms():
    """Frozen MLP weights (a fine-tune of the attention alone) compute no weight gradient: the MLP's
    backward is its dx alone, without the store only W_down's gradient reads."""
    from test_lora import step

    def frozen(model: torch.nn.Module) -> torch.nn.Module:
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." not in name)
        return model

    base = tiny_olmo2()
    hi, lo = step(frozen(copy.deepcopy(base).float())), step(frozen(copy.deepcopy(base).bfloat16()))
    model = coda_agent.apply_to_model(frozen(copy.deepcopy(base).bfloat16()))
    with launch_ledger() as launched:
        got = step(model)
    assert_like_hf(got, hi, lo)
    names = [launch.name for launch in launched]
    assert "dswiglu" not in names and names.count("dswiglu_frozen") == 2
    assert not any(".mlp." in k for k in got)


def test_an_mlp_no_token_reaches_returns_the_empty_result():
    """A mixture of experts calls an expert with the tokens routed to it, none at times."""
    model = coda_agent.apply_to_model(tiny_olmo2().bfloat16())
    mlp = model.model.layers[0].mlp
    x = torch.zeros(0, 128, dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x)
    assert y.shape == (0, 128)
    y.sum().backward()
    assert mlp.gate_up_proj.weight.grad is not None and not mlp.gate_up_proj.weight.grad.any()


def test_what_the_kernels_do_not_take_is_refused_with_the_fix():
    with pytest.raises(KernelError, match=r"found none of MLPs in CohereForCausalLM .*CohereMLP is LLaMA's MLP "
                                          r"code with GELUActivation, neither SiLU nor GELU's tanh form"):
        coda_agent.apply_to_model(tiny("Cohere", hidden_act="gelu").bfloat16(), fused_linear_cross_entropy=False)
    with pytest.raises(KernelError, match=r"mlp.gate_proj.bias: MLP biases are not in the swiglu_mlp kernel; "
                                          r"pass mlp=False"):
        coda_agent.apply_to_model(tiny_llama(mlp_bias=True).bfloat16())
    # a head of code no drop-in knows, which soft-caps its logits: with the MLPs off nothing is left
    with pytest.raises(KernelError, match=r"found none of the LM head and loss in OwnHeadLM .*OwnHeadLM.forward "
                                          r"is not LLaMA's.*and its forward maps the logits between the LM head and "
                                          r"the loss \(the (loss|logits) disagree"):
        coda_agent.apply_to_model(own_head("softcap").bfloat16(), mlp=False)
    parted = tiny_olmo2().bfloat16()
    parted.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    with pytest.raises(KernelError, match=r"model.layers.1.mlp: requires_grad differs across gate_proj, up_proj"):
        coda_agent.apply_to_model(parted)
    with pytest.raises(KernelError, match=r"kernels: 'mlp_block' is not a task the drop-in runs"):
        coda_agent.apply_to_model(tiny_olmo2().bfloat16(), kernels={"mlp_block": "runs/x"})


def own_head(post: str, loss: str = "hf", seed: int = 0) -> torch.nn.Module:
    """A causal LM of its own code (LLaMA's decoder inside, the tiny LLaMA's weights): what its forward
    does between the LM head and the loss is ``post``, and ``loss`` says whose loss it computes."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class OwnHeadLM(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=True, **kwargs):
            h = self.model(input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            logits = self.lm_head(h)
            if post == "scale":  # Cohere's logit_scale, by a number no power of two, and GPT-J's fp32 cast
                logits = (logits * 0.37).float()
            elif post == "softcap":
                logits = 3.0 * torch.tanh(logits / 3.0)
            out = None
            if labels is not None and loss == "hf":
                out = self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
            elif labels is not None:  # its own cross-entropy, not HF's loss function
                out = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            if not return_dict:
                return (out, logits)
            return CausalLMOutputWithPast(loss=out, logits=logits)

    base = tiny_llama(seed)
    model = OwnHeadLM(base.config)
    model.load_state_dict(base.state_dict())
    return model.to(base.device)


def test_a_head_of_any_code_runs_fused_where_its_forward_maps_the_logits_linearly():
    """A causal LM's forward of code no drop-in knows keeps running as it is: where the head probe finds
    only maps that commute with the head between it and HF's loss (a scale, a cast), the head's input
    reaches the loss, which runs the fused kernel; the logits are None in training, as with the known
    forwards, and a forward that bends the logits (a soft-cap) or computes its own loss keeps HF's head."""
    base = own_head("scale")
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert model.coda_flags["fused_linear_cross_entropy"] and len(model.coda_flags["swiglu_mlp"]) == 2
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    assert "logits_lse" in {launch.name for launch in launched}
    ids, labels = batch()
    model.train()
    assert model(ids, labels=labels).logits is None and model(ids).logits.shape[-1] == base.config.vocab_size
    loss, logits = model(ids, labels=labels, return_dict=False)
    assert logits is None and torch.allclose(loss.float(), got["loss"].float(), rtol=1e-2)
    assert "labels" in __import__("inspect").signature(model.forward).parameters  # HF's Trainer reads it
    for post, loss in (("softcap", "hf"), ("none", "own")):
        other = coda_agent.apply_to_model(own_head(post, loss).bfloat16())
        assert not other.coda_flags["fused_linear_cross_entropy"] and len(other.coda_flags["swiglu_mlp"]) == 2
        assert "_loss_function" not in other.__dict__ and "forward" not in other.lm_head.__dict__
    twin = copy.deepcopy(model)  # a deep copy defers its own head
    assert twin.loss_function.head is twin.lm_head and twin.lm_head.forward.head is twin.lm_head


def test_a_head_of_any_code_compiles_whole():
    """torch.compile(fullgraph=True) traces the probed head's deferral (the flag set and reset around
    the model's own forward) with no graph break."""
    from test_llama import assert_compiles_like_eager

    ids, labels = batch()
    assert_compiles_like_eager(coda_agent.apply_to_model(own_head("scale").bfloat16()), ids, labels)


def test_a_model_is_patched_once_by_any_drop_in():
    patched = coda_agent.apply_to_model(tiny_olmo2().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_model(patched)
    llama = coda_agent.apply_to_llama(tiny_llama().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_model(llama)
    with pytest.warns(UserWarning):
        llama = coda_agent.apply_to_model(tiny_llama().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_llama(llama)


def test_lora_on_the_attention_trains_and_on_the_mlp_is_refused():
    """The attention stays HF's, so peft's LoRA layers there train as they do unpatched; an adapter
    inside the MLP kernel is refused with the flag that keeps the MLPs HF's."""
    peft = pytest.importorskip("peft")
    from test_lora import assert_like_peft, step, truth, with_lora

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    base = tiny_olmo2()
    hi, lo = truth(base, targets, batch())
    got = step(coda_agent.apply_to_model(with_lora(copy.deepcopy(base).bfloat16(), targets)))
    assert any(k.startswith("d ") and "lora_A" in k for k in got)
    assert_like_peft(got, hi, lo)
    with pytest.raises(KernelError, match=r"mlp.gate_proj has LoRA adapters.*pass mlp=False"):
        coda_agent.apply_to_model(with_lora(tiny_olmo2().bfloat16(), ["gate_proj"]))
    assert peft


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_gemma4s_soft_capped_head_trains_like_hf_on_gpu(monkeypatch):
    """The cute lowering: Gemma-4's capped head and its GeGLU MLPs' GEMMs on the GPU."""
    import test_llama

    monkeypatch.setattr(test_llama, "DEVICE", "cuda")
    assert_gemma4_trains_like_hf("Gemma4ForCausalLM")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("family", ["Olmo2", "Cohere", "Gemma2"])
def test_a_model_no_layer_drop_in_takes_trains_like_hf_on_gpu(monkeypatch, family):
    """The cute lowering: the swiglu_mlp and geglu_mlp kernels' GEMMs (and OLMo-2's fused LM head)
    inside HF's layers on the GPU."""
    import test_llama

    monkeypatch.setattr(test_llama, "DEVICE", "cuda")
    base = tiny(family)
    hi, lo = truth_of(base)
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_model(copy.deepcopy(base).bfloat16()))
    assert_like_hf(got, hi, lo)
    act = FAMILIES[family][0].split("_")[0]
    assert {act, f"d{act}"} <= {launch.name for launch in launched}
