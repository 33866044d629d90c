"""coda_agent.apply_to_gpt_neox on a real transformers GPTNeoXForCausalLM (tiny config, CPU, the
reference lowering).

As in tests/test_gpt2_dropin.py: truth is the unpatched model in fp32, HF's own bf16 model sets
the noise floor, and every tensor training sees (the loss, the eval logits, the gradient of every
parameter in HF's layout) must be within test_llama's ``assert_like_hf`` bounds of it, for both
residual forms, both GELUs and RoPE on part of each head or all of it.  Which GELU each kernel
computes is pinned in tests/test_gpt2_dropin.py; here, that the drop-in picks the model's.
"""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
import test_llama as llama_tests  # noqa: E402
from test_llama import assert_compiles_like_eager, assert_like_hf  # noqa: E402
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import Kernel, KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402
from coda_agent.tasks import SUITES  # noqa: E402

GPT2 = SUITES["gpt2"]
CONFIG = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=512, vocab_size=512,
              max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, rotary_pct=0.25,
              bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
DEVICE = "cpu"


def off_defaults(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its LayerNorm weights moved away from 1 and its biases away from 0 (HF's
    initial values), so that a dropped gamma, beta or bias shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "layernorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def tiny_neox(seed: int = 0, head: type = GPTNeoXForCausalLM, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return off_defaults(head(GPTNeoXConfig(**{**CONFIG, **overrides})).to(DEVICE))


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions (a prompt), as HF's loss skips them
    labels[1, -3:] = -100  # and padding at the end
    return ids.to(DEVICE), labels.to(DEVICE)


def train_and_eval(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return llama_tests.train_and_eval(model, batch())


def truth_of(base: torch.nn.Module) -> tuple[dict, dict]:
    return llama_tests.truth_of(base, batch())


@pytest.fixture(scope="module")
def truth():
    base = tiny_neox()
    return (base, *truth_of(base))


@pytest.mark.parametrize("flags", [{}, {"fused_linear_cross_entropy": False}, {"mlp": False},
                                   {"layer_norm": False, "mlp": False}], ids=str)
def test_patched_gpt_neox_trains_like_hf(truth, flags):
    base, hi, lo = truth
    model = coda_agent.apply_to_gpt_neox(copy.deepcopy(base).bfloat16(), **flags)
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    names = {launch.name for launch in launched}
    on = {"layer_norm": True, "mlp": True, "fused_linear_cross_entropy": True, **flags}
    assert "bias_grad" in names  # out_proj_residual's bias gradient, every patched layer
    assert ("ln_rank1" in names) == on["layer_norm"] and ("ln_grad_stats" in names) == on["layer_norm"]
    assert ("ln_fc_gelu" in names) == on["mlp"] and ("dgelu_stats" in names) == on["mlp"]
    assert ("logits_lse" in names) == on["fused_linear_cross_entropy"]


@pytest.mark.parametrize(("residual", "activation", "rotary_pct"),
                         list(itertools.product(["parallel", "sequential"], ["gelu", "gelu_fast"], [0.25, 1.0])))
def test_residuals_gelus_and_partial_rope_train_like_hf(residual, activation, rotary_pct):
    """Both residual forms (Pythia's parallel one, GPT-2's sequential one), both GELUs (Pythia's
    exact one, GPT-NeoX-20B's gelu_fast), RoPE on a quarter of each head (Pythia's) or all of it."""
    base = tiny_neox(use_parallel_residual=residual == "parallel", hidden_act=activation, rotary_pct=rotary_pct)
    assert base.gpt_neox.layers[0].attention.rotary_ndims == int(32 * rotary_pct)
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_gpt_neox(copy.deepcopy(base).bfloat16())
    task = "mlp_block" if activation == "gelu" else "mlp_block_tanh"
    assert {layer.coda_plan.mlp_block.name for layer in model.gpt_neox.layers} == {task}
    assert_like_hf(train_and_eval(model), hi, lo)


@pytest.mark.parametrize(("activation", "task"), [("gelu_new", "mlp_block_tanh"),
                                                  ("gelu_pytorch_tanh", "mlp_block_tanh"),
                                                  ("gelu_fast", "mlp_block_tanh"), ("gelu", "mlp_block")])
def test_the_mlp_kernel_follows_the_models_gelu(activation, task):
    model = coda_agent.apply_to_gpt_neox(tiny_neox(hidden_act=activation).bfloat16())
    assert {layer.coda_plan.mlp_block.name for layer in model.gpt_neox.layers} == {task}
    assert model.gpt_neox.coda_flags["gelu"] == ("tanh" if task.endswith("tanh") else "exact")


@pytest.mark.parametrize("overrides", [dict(attention_bias=False), dict(tie_word_embeddings=True),
                                       dict(attn_implementation="eager")], ids=str)
def test_config_variants_train_like_hf(overrides):
    """attention_bias=False: the kernels add a zero bias (the state dict gains no key); a tied
    head: the kernel's dW adds to the embedding's own gradient; eager attention: the module's."""
    base = tiny_neox(**overrides)
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_gpt_neox(copy.deepcopy(base).bfloat16())
    assert_like_hf(train_and_eval(model), hi, lo)
    assert model.state_dict().keys() == base.state_dict().keys()
    if overrides.get("attention_bias") is False:
        assert model.gpt_neox.layers[0].attention.query_key_value.bias is None
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.gpt_neox.embed_in.weight


def test_the_fused_loss_leaves_no_logits_and_matches_hfs_reductions(truth):
    base, hi, lo = truth
    model = coda_agent.apply_to_gpt_neox(copy.deepcopy(base).bfloat16())
    ids, labels = batch()
    model.train()
    out = model(ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    hf = copy.deepcopy(base).float().train()
    # gradient accumulation's sum over num_items_in_batch, and labels HF has shifted already
    n = torch.tensor(37)
    got = model(ids, labels=labels, num_items_in_batch=n).loss
    want = hf(ids, labels=labels, num_items_in_batch=n).loss
    assert abs(got.item() - want.item()) < 0.02 * abs(want.item())
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    got = model(ids, shift_labels=shifted).loss
    assert model(ids, shift_labels=shifted).logits is None
    assert abs(got.item() - hi["loss"].item()) < 0.02 * hi["loss"].item()


def test_state_dict_save_pretrained_and_parameters_stay_hfs(tmp_path):
    hf = tiny_neox().bfloat16()
    before = list(hf.parameters())
    model = coda_agent.apply_to_gpt_neox(hf)
    assert all(a is b for a, b in zip(model.parameters(), before))  # an optimizer built before still trains it
    want = tiny_neox().bfloat16().state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    other = tiny_neox(seed=5).bfloat16()  # an HF checkpoint loads into the patched model ...
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    model.save_pretrained(tmp_path)  # ... and the patched model's checkpoint into an unpatched one
    fresh = GPTNeoXForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    ids, _ = batch()
    model.eval()
    fresh.eval()
    with torch.no_grad():
        a, b = model(ids).logits.float(), fresh(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_the_decoder_stack_alone_is_patched():
    stack = tiny_neox(head=GPTNeoXModel)
    ids, _ = batch()
    with torch.no_grad():
        want = copy.deepcopy(stack).float().eval()(ids).last_hidden_state
        lo = copy.deepcopy(stack).bfloat16().eval()(ids).last_hidden_state.float()
        got = coda_agent.apply_to_gpt_neox(stack.bfloat16()).eval()(ids).last_hidden_state.float()
    assert (got - want).abs().max() <= 2 * (lo - want).abs().max() + want.abs().max() / 256


def test_kv_cache_decoding_copies_and_checkpointing():
    model = coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16())
    llama_tests.assert_decodes_copies_and_checkpoints(model, lambda m: m.gpt_neox.layers, "mlp_block", batch())
    saved = pickle.loads(pickle.dumps(model))  # torch.save of the whole model loads back patched
    assert saved.gpt_neox.layers[1].forward.module is saved.gpt_neox.layers[1]
    a, c = train_and_eval(model), train_and_eval(saved)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_patched_gpt_neox_compiles_whole():
    """No graph break: torch.compile(fullgraph=True) traces the patched layers (both residual
    forms) and the fused loss (AOTAutograd, as tests/test_gpt2_dropin.py compiles a GPT-2)."""
    assert_compiles_like_eager(coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16()), *batch())
    assert_compiles_like_eager(coda_agent.apply_to_gpt_neox(tiny_neox(use_parallel_residual=False,
                                                                      attention_bias=False).bfloat16()), *batch())


def test_swapping_in_another_program_for_a_task():
    mine = Kernel.from_files(GPT2 / "experts" / "mlp_block_tanh.py", GPT2 / "mlp_block_tanh.yaml")
    model = coda_agent.apply_to_gpt_neox(tiny_neox(hidden_act="gelu_fast").bfloat16(), kernels={"mlp_block": mine})
    assert model.gpt_neox.layers[1].coda_plan.mlp_block is mine
    with pytest.raises(KernelError, match="kernels\\['mlp_block'\\] solves 'mlp_block_tanh', whose GELU is not this "
                       "model's \\(exact, task 'mlp_block'\\)"):
        coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16(), kernels={"mlp_block": mine})
    with pytest.raises(KernelError, match="kernels\\['ln_qkv'\\] solves task 'mlp_block_tanh', whose contract is "
                       "not that of 'ln_qkv': inputs"):
        coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16(), kernels={"ln_qkv": mine})
    with pytest.raises(KernelError, match="'gelu_fwd' is not a task the drop-in runs"):
        coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16(), kernels={"gelu_fwd": mine})


def tiny_other(family: str, head: str = "ForCausalLM", **cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**cfg)
    return getattr(transformers, f"{family}{head}")(config)


class NotNeoXMLP(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h, self.act = mlp.dense_h_to_4h, mlp.dense_4h_to_h, mlp.act

    def forward(self, h):  # squared activation: not GPT-NeoX's MLP
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(h)) ** 2)


class LoRALinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class OtherHead(GPTNeoXForCausalLM):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize(("family", "cfg", "match"), [
    ("GPT2", dict(head="LMHeadModel", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64),
     "got GPT2LMHeadModel; it is built like GPT-2: coda_agent.apply_to_gpt2\\(model\\)"),
    ("Llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=512),
     "got LlamaForCausalLM; it is built like LLaMA: coda_agent.apply_to_llama\\(model\\)"),
    ("GPTNeoXJapanese", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_multiple_size=2,
                             vocab_size=512, max_position_embeddings=64),
     "GPTNeoXJapaneseLayer.forward computes something other than GPT-NeoX's layer \\(GPTNeoXJapaneseForCausalLM is "
     "not GPT-NeoX\\)"),
], ids=["gpt2", "llama", "gpt_neox_japanese"])
def test_models_that_are_not_gpt_neox_are_refused(family, cfg, match):
    with pytest.raises(KernelError, match=match):
        coda_agent.apply_to_gpt_neox(tiny_other(family, **cfg).bfloat16())


def test_what_the_kernels_do_not_cover_gets_a_clear_error():
    with pytest.raises(KernelError, match=r"call model.to\(torch.bfloat16\) before apply_to_gpt_neox"):
        coda_agent.apply_to_gpt_neox(tiny_neox().half())
    with pytest.raises(KernelError, match=r"layers.0.post_attention_dropout drops with p = 0.1 \(hidden_dropout\).*"
                       r"hidden_dropout=0.0"):
        coda_agent.apply_to_gpt_neox(tiny_neox(hidden_dropout=0.1).bfloat16())
    coda_agent.apply_to_gpt_neox(tiny_neox(attention_dropout=0.1).bfloat16())  # HF's own attention dropout: fine
    with pytest.raises(KernelError, match=r"layers.0.mlp.act \(ReLU, hidden_act 'relu'\) is neither the exact GELU "
                       r"nor its tanh approximation.*pass mlp=False"):
        coda_agent.apply_to_gpt_neox(tiny_neox(hidden_act="relu").bfloat16())
    coda_agent.apply_to_gpt_neox(tiny_neox(hidden_act="relu").bfloat16(), mlp=False)  # HF's MLP
    mixed = tiny_neox(hidden_act="gelu_fast").bfloat16()
    mixed.gpt_neox.layers[1].mlp.act = torch.nn.GELU()
    with pytest.raises(KernelError, match="the layers mix the exact GELU and its tanh approximation; "
                       "apply_to_gpt_neox runs one MLP kernel"):
        coda_agent.apply_to_gpt_neox(mixed)
    with pytest.raises(KernelError, match=r"the vocabulary has 509 tokens, not a multiple of 8.*"
                       r"pad_to_multiple_of=64.*fused_linear_cross_entropy=False"):
        coda_agent.apply_to_gpt_neox(tiny_neox(vocab_size=509).bfloat16())
    coda_agent.apply_to_gpt_neox(tiny_neox(vocab_size=509).bfloat16(), fused_linear_cross_entropy=False)
    with pytest.raises(KernelError, match="needs layer_norm=True"):
        coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16(), layer_norm=False)
    for part, proj in (("attention", "query_key_value"), ("attention", "dense"), ("mlp", "dense_4h_to_h")):
        lora = tiny_neox().bfloat16()
        old = getattr(getattr(lora.gpt_neox.layers[1], part), proj)
        setattr(getattr(lora.gpt_neox.layers[1], part), proj,
                LoRALinear(old.in_features, old.out_features, dtype=torch.bfloat16))
        with pytest.raises(KernelError, match=rf"layers.1.{part}.{proj} is LoRALinear, not nn.Linear.*"
                           "merge such adapters into the weights first"):
            coda_agent.apply_to_gpt_neox(lora)
    lora.gpt_neox.layers[1].mlp.dense_4h_to_h = old  # an adapter on query_key_value alone: HF's under layer_norm=False
    lora.gpt_neox.layers[1].attention.query_key_value = LoRALinear(128, 384, dtype=torch.bfloat16)
    coda_agent.apply_to_gpt_neox(lora, layer_norm=False, mlp=False)
    plain = tiny_neox().bfloat16()
    plain.gpt_neox.layers[0].post_attention_layernorm = torch.nn.LayerNorm(128, elementwise_affine=False)
    with pytest.raises(KernelError, match=r"layers.0.post_attention_layernorm is not an nn.LayerNorm with a weight "
                       "and a bias"):
        coda_agent.apply_to_gpt_neox(plain)
    biased = tiny_neox().bfloat16()
    biased.lm_head = torch.nn.Linear(128, 512, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match=r"lm_head has a bias.*fused_linear_cross_entropy=False"):
        coda_agent.apply_to_gpt_neox(biased)
    other_mlp = tiny_neox().bfloat16()
    other_mlp.gpt_neox.layers[0].mlp = NotNeoXMLP(other_mlp.gpt_neox.layers[0].mlp)
    with pytest.raises(KernelError, match=r"NotNeoXMLP.forward computes something other than GPT-NeoX's MLP"):
        coda_agent.apply_to_gpt_neox(other_mlp)
    coda_agent.apply_to_gpt_neox(other_mlp, mlp=False)  # the MLP stays the model's own
    extra = tiny_neox().bfloat16()
    extra.gpt_neox.layers[0].attention.q_norm = torch.nn.LayerNorm(32, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match=r"layers.0: GPTNeoXAttention differs from GPT-NeoX's attention in "
                       r"\['q_norm'\]"):
        coda_agent.apply_to_gpt_neox(extra)
    model = coda_agent.apply_to_gpt_neox(tiny_neox().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_gpt_neox(model)
    with pytest.raises(KernelError, match=r"wrapped by torch.compile; patch the model itself first"):
        coda_agent.apply_to_gpt_neox(torch.compile(tiny_neox().bfloat16()))
    with pytest.raises(KernelError, match=r"GPTNeoXForSequenceClassification's head is not a causal LM's lm_head: "
                       r"patch its decoder stack, apply_to_gpt_neox\(model.gpt_neox\)"):
        coda_agent.apply_to_gpt_neox(tiny_neox(head=transformers.GPTNeoXForSequenceClassification).bfloat16())
    coda_agent.apply_to_gpt_neox(tiny_neox(head=transformers.GPTNeoXForSequenceClassification).bfloat16().gpt_neox)
    with pytest.raises(KernelError, match=r"OtherHead.forward is not GPTNeoXForCausalLM's"):
        coda_agent.apply_to_gpt_neox(tiny_neox(head=OtherHead).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize(("activation", "parallel"), [("gelu", True), ("gelu_fast", False)])
def test_patched_gpt_neox_trains_like_hf_on_gpu(monkeypatch, activation, parallel):
    """The cute lowering inside the model: quack's GEMMs with the GPT-2 suite's epilogues over the
    nn.Linear weights, HF's partial RoPE, SDPA flash, the fused loss on the untied head."""
    monkeypatch.setitem(globals(), "DEVICE", "cuda")
    base = tiny_neox(hidden_act=activation, use_parallel_residual=parallel)
    hi, lo = truth_of(base)
    # the backward on the calling thread: autograd's CUDA device threads do not see the ledger
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_gpt_neox(copy.deepcopy(base).bfloat16()))
    assert_like_hf(got, hi, lo)
    assert {"ln_rank1", "ln_grad_stats", "bias_grad", "ln_fc_gelu", "dgelu_stats", "logits_lse"} <= {
        launch.name for launch in launched}


def test_the_other_drop_ins_point_a_gpt_neox_at_apply_to_gpt_neox():
    for model in (tiny_neox().bfloat16(), tiny_neox(head=GPTNeoXModel).bfloat16()):
        name = type(model).__name__
        with pytest.raises(KernelError, match=rf"got {name}; it is built like GPT-NeoX: "
                           r"coda_agent.apply_to_gpt_neox\(model\)"):
            coda_agent.apply_to_llama(model)
        with pytest.raises(KernelError, match=rf"got {name}; it is built like GPT-NeoX: "
                           r"coda_agent.apply_to_gpt_neox\(model\)"):
            coda_agent.apply_to_gpt2(model)


def test_apply_to_gpt_neox_points_a_gpt2_stack_at_apply_to_gpt2():
    with pytest.raises(KernelError, match=r"got GPT2Model; it is built like GPT-2: coda_agent.apply_to_gpt2"):
        coda_agent.apply_to_gpt_neox(tiny_other("GPT2", head="Model", n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                                                n_positions=64).bfloat16())
