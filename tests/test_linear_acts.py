"""coda_agent.apply_to_model on a linear and the activation a module's code applies to it at once
(kernels/linear_acts.py): BERT's intermediate and the encoders that copy it, and the decoder layers
that run their MLP inline (OPT with ReLU, BioGPT and XGLM with the exact GELU), at tiny widths (CPU,
the reference lowering), held to test_llama.py's bar: the loss, the logits and every gradient
against the unpatched model in fp32, within twice HF's own bf16 error.  The pair runs as the GPT-2
suite's linear_gelu, linear_gelu_tanh or linear_relu; the rest of the model stays HF's.  Then the
rule itself, on modules written here: what it takes and what it must pass by."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from test_llama import assert_compiles_like_eager, assert_like_hf, train_and_eval, with_biases  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError, linear_acts  # noqa: E402
from coda_agent.kernels.dropin import GPT2_SUITE, suite_kernel  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

WIDTHS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=512,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              embedding_size=128, is_decoder=True)
# The decoders' names for the same widths, dropouts off
DECODER_WIDTHS = dict(vocab_size=512, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0)
GELU, RELU = ("linear_gelu", ("bias_gelu", "dgelu")), ("linear_relu", ("bias_relu", "drelu"))


def layers(site: str, *more: str) -> list[str]:
    return [site.format(i) for i in range(2)] + list(more)


# family -> (its model class, its config's widths, the linears of its sites, its kernel, the
#            kernel's forward and derivative launches).  BERT's and ELECTRA's prediction heads
#            (dense, then the activation, then LayerNorm) are sites too.
FAMILIES = {
    "Bert": ("BertLMHeadModel", WIDTHS, layers("bert.encoder.layer.{}.intermediate.dense",
                                               "cls.predictions.transform.dense"), *GELU),
    "Roberta": ("RobertaForMaskedLM", WIDTHS, layers("roberta.encoder.layer.{}.intermediate.dense"), *GELU),
    "Electra": ("ElectraForCausalLM", WIDTHS, layers("electra.encoder.layer.{}.intermediate.dense",
                                                     "generator_predictions.dense"), *GELU),
    "OPT": ("OPTForCausalLM", dict(DECODER_WIDTHS, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   ffn_dim=256, word_embed_proj_dim=128), layers("model.decoder.layers.{}.fc1"),
            *RELU),
    "BioGpt": ("BioGptForCausalLM", dict(WIDTHS, is_decoder=False), layers("biogpt.layers.{}.fc1"), *GELU),
    # ALBERT: one layer's module shared by every layer, its pair in ff_chunk, GELU's tanh form
    "Albert": ("AlbertForMaskedLM", dict(WIDTHS, hidden_act="gelu_new"), ["albert.encoder.albert_layer_groups.0."
                                                                         "albert_layers.0.ffn", "predictions.dense"],
               "linear_gelu_tanh", ("bias_gelu_tanh", "dgelu_tanh")),
    # an encoder-decoder: its encoder's and decoder's layers, trained on labels
    "Bart": ("BartForConditionalGeneration", dict(DECODER_WIDTHS, d_model=128, encoder_layers=1, decoder_layers=1,
                                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                                  encoder_ffn_dim=256, decoder_ffn_dim=256),
             ["model.decoder.layers.0.fc1", "model.encoder.layers.0.fc1"], *GELU),
    "XGLM": ("XGLMForCausalLM", dict(DECODER_WIDTHS, d_model=128, num_layers=2, attention_heads=4, ffn_dim=256),
             layers("model.layers.{}.fc1"), *GELU),
}

# How many times a forward runs a family's sites, where it is not once each: ALBERT's one layer
# runs num_hidden_layers times, then its head once
RUNS = {"Albert": 3}


def tiny(family: str, **overrides) -> nn.Module:
    import transformers

    cls, widths = FAMILIES[family][:2]
    config = getattr(transformers, f"{family}Config")(**{**widths, **overrides})
    if family == "Roberta":
        config.is_decoder = False  # a masked LM: the encoder as it is pretrained
    torch.manual_seed(0)
    return with_biases(getattr(transformers, cls)(config))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def comparable(got: dict, hi: dict, lo: dict) -> tuple[dict, dict, dict]:
    """The three results without the tensors no bar can rank: the key biases' gradients, zero in
    exact arithmetic (softmax ignores a shift that every key shares), so both bf16 runs hold only
    rounding there, and a tensor whose truth is zero throughout (BART's final_logits_bias, which
    gets no gradient)."""
    keep = [k for k in hi if not k.endswith(("k_proj.bias", "key.bias")) and hi[k].any()]
    return tuple({k: r[k] for k in keep} for r in (got, hi, lo))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_linear_and_its_activation_train_like_hf(family):
    _, _, sites, task, (fwd, bwd) = FAMILIES[family]
    base = tiny(family)
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data()) for dtype in (torch.float32, torch.bfloat16))
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16(), fused_linear_cross_entropy=False)
    assert model.coda_flags[task] == sites
    assert not any(v for k, v in model.coda_flags.items() if k != task)
    assert model.state_dict().keys() == base.state_dict().keys()  # the activation stays a module: same keys
    with launch_ledger() as launched:
        got = train_and_eval(model, data())
    assert_like_hf(*comparable(got, hi, lo))
    names = [launch.name for launch in launched]
    # every site: forward in the training step and the eval pass, its derivative's pass once
    runs = RUNS.get(family, len(sites))
    assert names.count(fwd) == 2 * runs and names.count(bwd) == runs


def test_each_activation_picks_its_kernel_and_another_is_passed_by_with_why():
    tanh = coda_agent.apply_to_model(tiny("Bert", hidden_act="gelu_new").bfloat16())
    assert tanh.coda_flags["linear_gelu_tanh"] == FAMILIES["Bert"][2] and not tanh.coda_flags["linear_gelu"]
    with pytest.raises(KernelError, match=r"found none of MLPs or the LM head and loss in BertLMHeadModel .*"
                                          r"BertIntermediate applies intermediate_act_fn \(SiLUActivation\) to "
                                          r"dense, which is none of the exact GELU, GELU's tanh form, ReLU"):
        coda_agent.apply_to_model(tiny("Bert", hidden_act="silu").bfloat16())


def test_no_bias_gets_zeros_and_no_token_the_empty_result():
    model = coda_agent.apply_to_model(tiny("OPT").bfloat16(), fused_linear_cross_entropy=False)
    layer = model.model.decoder.layers[0]
    assert isinstance(layer.activation_fn, nn.Identity)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    want = torch.relu(x.float() @ layer.fc1.weight.float().t() + layer.fc1.bias.float())
    torch.testing.assert_close(layer.fc1(x).float(), want, rtol=2e-2, atol=2e-2)
    layer.fc1.bias = None
    torch.testing.assert_close(layer.fc1(x).float(), torch.relu(x.float() @ layer.fc1.weight.float().t()),
                               rtol=2e-2, atol=2e-2)
    assert layer.fc1(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 256)


def test_a_deep_copy_is_patched_with_its_own_linears():
    """An EMA or reference copy runs its own weights through the kernel, and trains like the original."""
    model = coda_agent.apply_to_model(tiny("OPT").bfloat16(), fused_linear_cross_entropy=False)
    twin = copy.deepcopy(model)
    fc1 = twin.model.decoder.layers[0].fc1
    assert fc1.forward.module is fc1 and fc1.coda_mlp is model.model.decoder.layers[0].fc1.coda_mlp
    a, b = train_and_eval(model, data()), train_and_eval(twin, data())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_patched_model_compiles_whole_like_eager():
    """torch.compile(fullgraph=True) traces BERT with its patched linears and identity activations:
    no graph break, the loss and gradients of eager.  (OPT's, BioGPT's and XGLM's own LayerDrop
    branches on a random draw in training, which no full graph traces, patched or not.)"""
    model = coda_agent.apply_to_model(tiny("Bert").bfloat16(), fused_linear_cross_entropy=False)
    model.loss_type = "ForCausalLM"  # BERT's config names none, and HF's warning about it breaks the graph
    assert_compiles_like_eager(model, *data())


def test_a_lora_linear_is_refused_with_the_fix():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny("Bert").bfloat16(), peft.LoraConfig(r=4, target_modules=["intermediate.dense"]))
    with pytest.raises(KernelError, match=r"intermediate.dense has LoRA adapters, and the linear_gelu kernel runs "
                                          r"dense with its activation; pass mlp=False"):
        coda_agent.apply_to_model(model)


# --------------------------------------------------------------------------- the rule


class Inline(nn.Module):
    """OPT's shape of code: the pair as two statements, the pre-activation overwritten."""

    def __init__(self, act: nn.Module | None = None):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(16, 32), nn.Linear(32, 16), act or nn.GELU()

    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return self.fc2(h)


class Nested(Inline):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class KeepsPre(Inline):
    def forward(self, x):
        pre = self.fc1(x)
        h = self.act(pre)
        return self.fc2(h) + pre.sum()  # the pre-activation is read again


class ReadsTwice(Inline):
    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return self.fc2(h) + self.fc1.bias.sum()


class CallsElsewhere(Inline):
    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return self.fc2(h)

    def probe(self, x):  # another method runs the linear alone
        return self.fc1(x)


class ByName(Inline):
    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return self.fc2(h) * getattr(self, "act")(torch.ones(()))


class Between(Inline):
    def forward(self, x):
        h = self.fc1(x)
        h = h * 2.0  # something runs between the linear and the activation
        h = self.act(h)
        return self.fc2(h)


class InHelper(Inline):
    """ALBERT's shape of code: the pair in a helper that the forward calls."""

    def forward(self, x):
        return self.fc2(self.ff(x))

    def ff(self, x):
        h = self.fc1(x)
        h = self.act(h)
        return h


class Reassigns(Inline):
    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h)
        self.act = nn.ReLU()  # the forward swaps its activation: the identity would not stay
        return self.fc2(h)


class CallsSuper(Inline):
    def forward(self, x):
        return super().forward(x) + self.fc1.bias.sum()  # the parent's pair and one more read


SITE = (("fc1", "act"),)


@pytest.mark.parametrize("cls,sites", [(Inline, SITE), (Nested, (("act", "fc2"), *SITE)),
                                       (InHelper, (("ff", "fc2"), *SITE)),
                                       (KeepsPre, ()), (ReadsTwice, ()), (CallsElsewhere, ()), (ByName, ()),
                                       (Between, ()), (Reassigns, ()), (CallsSuper, ())])
def test_the_rule_takes_a_composition_that_nothing_else_reads(cls, sites):
    """A site needs the activation applied to the linear's output at once, the pre-activation dead,
    and no other read of either attribute in the class: else setting the activation to the identity
    would change what the module computes.  What the attributes hold is :func:`recognised`'s to
    judge (the activation applied to fc2 is no site: act is no linear)."""
    assert linear_acts.candidates(cls) == sites


@pytest.mark.parametrize("cls", [Inline, Nested])
def test_a_patched_site_computes_what_it_did(cls):
    torch.manual_seed(0)
    module = cls().bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    want = module(x)
    [(pair, task)], _ = linear_acts.recognised(module)
    assert (pair, task) == (("fc1", "act"), "linear_gelu")
    linear_acts.patch(module, pair, task, suite_kernel(task, GPT2_SUITE))
    torch.testing.assert_close(module(x), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("act,why", [(nn.SiLU(), r"\(SiLU\) to fc1, which is none of"),
                                     (nn.PReLU(init=0.0), r"\(PReLU\) to fc1, .*\(or has parameters\)")])
def test_an_activation_no_kernel_computes_is_passed_by(act, why):
    sites, reason = linear_acts.recognised(Inline(act))
    assert sites == [] and re.search(why, reason), reason


def test_a_linear_another_module_holds_too_is_passed_by():
    """A linear shared with code that runs it alone keeps HF's forward; a shared activation does not
    matter (only the site's own attribute becomes the identity)."""
    one, two = Inline(), Inline()
    two.fc1 = one.fc1
    model = nn.Sequential(one, two).bfloat16()
    sites, why = linear_acts.recognised(one, linear_acts.shared_modules(model))
    assert sites == [] and "another module holds that linear too" in why
    one, two = Inline(), Inline()
    two.act = one.act
    sites, _ = linear_acts.recognised(one, linear_acts.shared_modules(nn.Sequential(one, two)))
    assert sites == [(SITE[0], "linear_gelu")]


def test_a_module_s_own_activation_or_a_non_linear_is_no_site():
    class OwnGelu(nn.Module):  # defined by the model, not torch's or transformers' activations
        def forward(self, x):
            return torch.nn.functional.gelu(x)

    assert linear_acts.recognised(Inline(OwnGelu())) == ([], "")
    conv = Inline()
    conv.fc1 = nn.Conv1d(16, 32, 1)
    assert linear_acts.recognised(conv) == ([], "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("family", ["Bert", "OPT"])
def test_a_linear_and_its_activation_train_like_hf_on_gpu(family):
    """The cute lowering: the linear's GEMM and the derivative's pass inside the layers on the GPU."""
    fwd, bwd = FAMILIES[family][4]
    base = tiny(family).cuda()
    batch = tuple(t.cuda() for t in data())
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), batch) for dtype in (torch.float32, torch.bfloat16))
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_model(copy.deepcopy(base).bfloat16(),
                                                       fused_linear_cross_entropy=False), batch)
    assert_like_hf(*comparable(got, hi, lo))
    assert {fwd, bwd} <= {launch.name for launch in launched}
