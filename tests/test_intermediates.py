"""coda_agent.apply_to_model on encoders' intermediates (kernels/intermediates.py): BERT's
``act(dense(x))`` and the encoders that copy its code (RoBERTa, ELECTRA, ...), at tiny widths
(CPU, the reference lowering), held to test_llama.py's bar: the loss, the logits and every
gradient against the unpatched model in fp32, within twice HF's own bf16 error.  The
intermediates run as the GPT-2 suite's linear_gelu; the rest of the model stays HF's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from test_llama import assert_like_hf, train_and_eval, with_biases  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402

WIDTHS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=512,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              embedding_size=128, is_decoder=True)
# family -> (its model class, where its layers' intermediates are)
FAMILIES = {
    "Bert": ("BertLMHeadModel", "bert.encoder.layer.{}.intermediate"),
    "Roberta": ("RobertaForMaskedLM", "roberta.encoder.layer.{}.intermediate"),
    "Electra": ("ElectraForCausalLM", "electra.encoder.layer.{}.intermediate"),
}


def tiny(family: str, **overrides) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**WIDTHS, **overrides})
    if family == "Roberta":
        config.is_decoder = False  # a masked LM: the encoder as it is pretrained
    torch.manual_seed(0)
    return with_biases(getattr(transformers, FAMILIES[family][0])(config))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, WIDTHS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


@pytest.mark.parametrize("family", FAMILIES)
def test_an_encoder_s_intermediate_trains_like_hf(family):
    base = tiny(family)
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data()) for dtype in (torch.float32, torch.bfloat16))
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16())
    assert model.coda_flags["linear_gelu"] == [FAMILIES[family][1].format(i) for i in range(2)]
    assert not any(v for k, v in model.coda_flags.items() if k != "linear_gelu")
    with launch_ledger() as launched:
        got = train_and_eval(model, data())
    assert_like_hf(got, hi, lo)
    names = [launch.name for launch in launched]
    # every intermediate: forward in the training step and the eval pass, its dGELU pass once
    assert names.count("bias_gelu") == 4 and names.count("dgelu") == 2


def test_an_intermediate_without_the_exact_gelu_is_passed_by_with_why():
    with pytest.raises(KernelError, match=r"found none of MLPs or the LM head and loss in BertLMHeadModel .*"
                                          r"BertIntermediate is BERT's intermediate code with NewGELUActivation, "
                                          r"not the exact GELU"):
        coda_agent.apply_to_model(tiny("Bert", hidden_act="gelu_new").bfloat16())


def test_no_bias_gets_zeros_and_no_token_the_empty_result():
    model = coda_agent.apply_to_model(tiny("Bert").bfloat16())
    inter = model.bert.encoder.layer[0].intermediate
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    with_bias = inter(x)
    want = torch.nn.functional.gelu(x.float() @ inter.dense.weight.float().t() + inter.dense.bias.float())
    torch.testing.assert_close(with_bias.float(), want, rtol=2e-2, atol=2e-2)
    inter.dense.bias = None
    torch.testing.assert_close(inter(x).float(), torch.nn.functional.gelu(x.float() @ inter.dense.weight.float().t()),
                               rtol=2e-2, atol=2e-2)
    empty = inter(torch.zeros(0, 128, dtype=torch.bfloat16))
    assert empty.shape == (0, 256)


def test_a_lora_dense_layer_is_refused_with_the_fix():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny("Bert").bfloat16(), peft.LoraConfig(r=4, target_modules=["intermediate.dense"]))
    with pytest.raises(KernelError, match=r"intermediate.dense has LoRA adapters, and the linear_gelu kernel runs "
                                          r"the dense layer with its GELU; pass mlp=False"):
        coda_agent.apply_to_model(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_an_encoder_s_intermediate_trains_like_hf_on_gpu():
    """The cute lowering: linear_gelu's GEMM and dGELU pass inside BERT's layers on the GPU."""
    base = tiny("Bert").cuda()
    batch = tuple(t.cuda() for t in data())
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), batch) for dtype in (torch.float32, torch.bfloat16))
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_model(copy.deepcopy(base).bfloat16()), batch)
    assert_like_hf(got, hi, lo)
    assert {"bias_gelu", "dgelu"} <= {launch.name for launch in launched}
