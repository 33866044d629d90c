"""coda_agent.apply_to_gpt2 on a real transformers GPT2LMHeadModel (tiny config, CPU, the
reference lowering).

As in tests/test_llama.py: truth is the unpatched model in fp32, HF's own bf16 model sets the
noise floor, and every tensor training sees (the loss, the eval logits, the gradient of every
parameter in HF's layout) must be within test_llama's ``assert_like_hf`` bounds of it.  The
two GELUs are within bf16's resolution of each other on a whole model, so which one a kernel
computes is pinned where bf16 resolves it: on GELU's negative tail
(``test_each_gelu_kernel_computes_its_own_gelu``).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
import test_llama as llama_tests  # noqa: E402
from test_llama import assert_compiles_like_eager, assert_like_hf  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import Kernel, KernelError  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402
from coda_agent.tasks import SUITES  # noqa: E402

GPT2 = SUITES["gpt2"]
CONFIG = dict(n_embd=128, n_head=4, n_layer=2, vocab_size=512, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
DEVICE = "cpu"


def off_defaults(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its LayerNorm weights moved away from 1 and its biases away from 0 (HF's
    initial values), so that a dropped gamma, beta or bias shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def tiny_gpt2(seed: int = 0, head: type = GPT2LMHeadModel, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return off_defaults(head(GPT2Config(**{**CONFIG, **overrides})).to(DEVICE))


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions (a prompt), as HF's loss skips them
    return ids.to(DEVICE), labels.to(DEVICE)


def train_and_eval(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return llama_tests.train_and_eval(model, batch())


def truth_of(base: torch.nn.Module) -> tuple[dict, dict]:
    return llama_tests.truth_of(base, batch())


@pytest.fixture(scope="module")
def truth():
    base = tiny_gpt2()
    return (base, *truth_of(base))


@pytest.mark.parametrize("flags", [{}, {"fused_linear_cross_entropy": False}, {"mlp": False},
                                   {"layer_norm": False, "mlp": False}], ids=str)
def test_patched_gpt2_trains_like_hf(truth, flags):
    base, hi, lo = truth
    model = coda_agent.apply_to_gpt2(copy.deepcopy(base).bfloat16(), **flags)
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    names = {launch.name for launch in launched}
    on = {"layer_norm": True, "mlp": True, "fused_linear_cross_entropy": True, **flags}
    assert "bias_grad" in names  # out_proj_residual's bias gradient, every patched block
    assert ("ln_rank1" in names) == on["layer_norm"] and ("ln_grad_stats" in names) == on["layer_norm"]
    assert ("ln_fc_gelu" in names) == on["mlp"] and ("dgelu_stats" in names) == on["mlp"]
    assert ("logits_lse" in names) == on["fused_linear_cross_entropy"]


def test_the_fused_loss_leaves_no_logits_and_trains_the_tied_embedding(truth):
    base, hi, lo = truth
    model = coda_agent.apply_to_gpt2(copy.deepcopy(base).bfloat16())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as HF ties them
    ids, labels = batch()
    model.train()
    out = model(ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    # wte's gradient is the embedding's plus the head's: both must be there, as in HF.
    out.loss.backward()
    got = model.transformer.wte.weight.grad.float()
    assert ((got - hi["d transformer.wte.weight"]).norm() / hi["d transformer.wte.weight"].norm()) < 0.02
    head_only = got.clone()
    head_only[ids.unique()] = 0  # rows of tokens never embedded get the head's gradient alone
    assert head_only.abs().sum() > 0


@pytest.mark.parametrize(("activation", "task"), [("gelu_new", "mlp_block_tanh"),
                                                  ("gelu_pytorch_tanh", "mlp_block_tanh"),
                                                  ("gelu_fast", "mlp_block_tanh"), ("gelu", "mlp_block")])
def test_the_mlp_kernel_follows_the_models_gelu(activation, task):
    base = tiny_gpt2(activation_function=activation)
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_gpt2(copy.deepcopy(base).bfloat16())
    assert {b.coda_plan.mlp_block.name for b in model.transformer.h} == {task}
    assert model.transformer.coda_flags["gelu"] == ("tanh" if task.endswith("tanh") else "exact")
    assert_like_hf(train_and_eval(model), hi, lo)


@pytest.mark.parametrize("task", ["mlp_block", "mlp_block_tanh"])
def test_each_gelu_kernel_computes_its_own_gelu(task):
    """With gamma = beta = 0 the LayerNorm gives 0, so pre = b_fc; w_proj = [I | 0] and h = 0
    make y[:, j] = gelu(b_fc[j]).  On GELU's negative tail the two forms differ by 5-20%, which
    bf16 resolves: the kernel must give its own GELU there, rounded to bf16, and not the other."""
    from coda_agent.kernels.dropin import suite_kernel

    kernel = suite_kernel(task, GPT2)
    t, dim, inner = 16, 64, 256
    bf = dict(dtype=torch.bfloat16)
    pre = torch.linspace(-4.0, 4.0, dim).to(**bf)
    w_proj = torch.zeros(dim, inner, **bf)
    w_proj[:, :dim] = torch.eye(dim)
    b_fc = torch.cat((pre, torch.zeros(inner - dim, **bf)))
    y = kernel(torch.zeros(t, dim, **bf), torch.zeros(dim, **bf), torch.zeros(dim, **bf),
               torch.randn(inner, dim, **bf), b_fc, w_proj, torch.zeros(dim, **bf))["y"].float()
    own, other = ("tanh", "none") if task.endswith("tanh") else ("none", "tanh")
    want = torch.nn.functional.gelu(pre.double(), approximate=own)
    wrong = torch.nn.functional.gelu(pre.double(), approximate=other)
    tail = pre < -2.5
    assert torch.allclose(y[0].double(), want, rtol=2 ** -7, atol=1e-6), (y[0], want)
    assert ((y[0].double() - wrong)[tail].abs() > 2 ** -6 * wrong[tail].abs()).all()


def test_attention_settings_stay_hfs():
    """Eager attention with GPT-2's upcast-and-reorder path and per-layer scaling: the patched
    block calls the module's own attention and scaling."""
    base = tiny_gpt2(attn_implementation="eager", reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)
    hi, lo = truth_of(base)
    assert_like_hf(train_and_eval(coda_agent.apply_to_gpt2(copy.deepcopy(base).bfloat16())), hi, lo)


def test_state_dict_save_pretrained_and_parameters_stay_hfs(tmp_path):
    hf = tiny_gpt2().bfloat16()
    before = list(hf.parameters())
    model = coda_agent.apply_to_gpt2(hf)
    assert all(a is b for a, b in zip(model.parameters(), before))  # an optimizer built before still trains it
    convs = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    # each weight the kernels read is column-major, its gradient lands in that layout, no copy between
    assert len(convs) == 8 and all(c.weight.t().is_contiguous() for c in convs)
    ids, labels = batch()
    model.train()
    model(ids, labels=labels).loss.backward()
    assert all(c.weight.grad.stride() == c.weight.stride() for c in convs)
    model.zero_grad(set_to_none=True)
    want = tiny_gpt2().bfloat16().state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    other = tiny_gpt2(seed=5).bfloat16()  # an HF checkpoint loads into the patched model ...
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    model.save_pretrained(tmp_path)  # ... and the patched model's checkpoint into an unpatched one
    fresh = GPT2LMHeadModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    ids, _ = batch()
    model.eval()
    fresh.eval()
    with torch.no_grad():
        a, b = model(ids).logits.float(), fresh(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_the_decoder_stack_alone_is_patched():
    stack = tiny_gpt2(head=GPT2Model)
    ids, _ = batch()
    with torch.no_grad():
        want = copy.deepcopy(stack).float().eval()(ids).last_hidden_state
        lo = copy.deepcopy(stack).bfloat16().eval()(ids).last_hidden_state.float()
        got = coda_agent.apply_to_gpt2(stack.bfloat16()).eval()(ids).last_hidden_state.float()
    assert (got - want).abs().max() <= 2 * (lo - want).abs().max() + want.abs().max() / 256


def test_kv_cache_decoding_copies_and_checkpointing():
    model = coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16())
    llama_tests.assert_decodes_copies_and_checkpoints(model, lambda m: m.transformer.h, "mlp_block", batch())


def test_a_patched_gpt2_compiles_whole():
    """No graph break: torch.compile(fullgraph=True) traces the patched blocks and the fused loss
    (AOTAutograd, as tests/test_primitives_ops.py compiles a patched LLaMA)."""
    assert_compiles_like_eager(coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16()), *batch())


def test_swapping_in_another_program_for_a_task():
    mine = Kernel.from_files(GPT2 / "experts" / "mlp_block_tanh.py", GPT2 / "mlp_block_tanh.yaml")
    model = coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16(), kernels={"mlp_block": mine})
    assert model.transformer.h[1].coda_plan.mlp_block is mine
    exact = Kernel.from_files(GPT2 / "experts" / "mlp_block.py", GPT2 / "mlp_block.yaml")
    with pytest.raises(KernelError, match="kernels\\['mlp_block'\\] solves 'mlp_block', whose GELU is not this "
                       "model's \\(tanh, task 'mlp_block_tanh'\\)"):
        coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16(), kernels={"mlp_block": exact})
    with pytest.raises(KernelError, match="kernels\\['ln_qkv'\\] solves task 'mlp_block_tanh', whose contract is "
                       "not that of 'ln_qkv': inputs"):
        coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16(), kernels={"ln_qkv": mine})
    with pytest.raises(KernelError, match="'gelu_fwd' is not a task the drop-in runs"):
        coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16(), kernels={"gelu_fwd": mine})


def tiny_other(family: str, **cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**cfg)
    return getattr(transformers, f"{family}ForCausalLM")(config)


@pytest.mark.parametrize(("family", "cfg", "match"), [
    ("GPTNeo", dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    vocab_size=512, max_position_embeddings=64),
     "GPTNeoBlock.forward computes something other than GPT-2's block \\(GPTNeoForCausalLM is not GPT-2\\)"),
    ("GPTJ", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=512, n_positions=64),
     "got GPTJForCausalLM; its decoder stack has no wpe"),
    ("OPT", dict(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4, vocab_size=512,
                 max_position_embeddings=64), "got OPTForCausalLM"),
    ("Bloom", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512), "got BloomForCausalLM; its decoder stack "
     "has no wte, wpe"),
    ("Llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=512),
     "it is built like LLaMA: coda_agent.apply_to_llama\\(model\\)"),
    ("GPTBigCode", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64),
     "GPTBigCode .*multi-query c_attn is \\(H \\+ 2 \\* head_dim, H\\), and the ln_qkv kernel's task declares "
     "\\(3H, H\\)"),
    ("GPTBigCode", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64, multi_query=False),
     "GPTBigCode with multi_query=False: GPT-2's widths, but its own attention and nn.Linear projections"),
], ids=["gpt_neo", "gptj", "opt", "bloom", "llama", "gpt_bigcode", "gpt_bigcode_multi_head"])
def test_models_that_are_not_gpt2_are_refused(family, cfg, match):
    with pytest.raises(KernelError, match=match):
        coda_agent.apply_to_gpt2(tiny_other(family, **cfg).bfloat16())


def test_what_the_kernels_do_not_cover_gets_a_clear_error():
    with pytest.raises(KernelError, match=r"call model.to\(torch.bfloat16\) before apply_to_gpt2"):
        coda_agent.apply_to_gpt2(tiny_gpt2().half())
    with pytest.raises(KernelError, match=r"h.0.attn.resid_dropout drops with p = 0.1 \(resid_pdrop; GPT-2's config "
                       r"defaults to 0.1\).*resid_pdrop=0.0"):
        coda_agent.apply_to_gpt2(tiny_gpt2(resid_pdrop=0.1).bfloat16())
    coda_agent.apply_to_gpt2(tiny_gpt2(embd_pdrop=0.1, attn_pdrop=0.1).bfloat16())  # HF's own dropouts: fine
    with pytest.raises(KernelError, match=r"h.0.mlp.act \(ReLU, activation_function 'relu'\) is neither the exact "
                       r"GELU nor its tanh approximation.*pass mlp=False"):
        coda_agent.apply_to_gpt2(tiny_gpt2(activation_function="relu").bfloat16())
    coda_agent.apply_to_gpt2(tiny_gpt2(activation_function="relu").bfloat16(), mlp=False)  # HF's MLP
    with pytest.raises(KernelError, match=r"h.0 has cross-attention \(add_cross_attention=True\)"):
        coda_agent.apply_to_gpt2(tiny_gpt2(add_cross_attention=True).bfloat16())
    with pytest.raises(KernelError, match=r"the vocabulary has 509 tokens, not a multiple of 8.*"
                       r"pad_to_multiple_of=64.*fused_linear_cross_entropy=False"):
        coda_agent.apply_to_gpt2(tiny_gpt2(vocab_size=509).bfloat16())
    with pytest.raises(KernelError, match="needs layer_norm=True"):
        coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16(), layer_norm=False)
    lora = tiny_gpt2().bfloat16()
    lora.transformer.h[1].attn.c_attn = torch.nn.Linear(128, 384, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match=r"h.1.attn.c_attn is Linear, not GPT-2's Conv1D with a bias"):
        coda_agent.apply_to_gpt2(lora)
    model = coda_agent.apply_to_gpt2(tiny_gpt2().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_gpt2(model)
    with pytest.raises(KernelError, match=r"wrapped by torch.compile; patch the model itself first"):
        coda_agent.apply_to_gpt2(torch.compile(tiny_gpt2().bfloat16()))
    with pytest.raises(KernelError, match=r"GPT2ForSequenceClassification; its head is not a causal LM's lm_head: "
                       r"patch its decoder stack, apply_to_gpt2\(model.transformer\)"):
        coda_agent.apply_to_gpt2(tiny_gpt2(head=transformers.GPT2ForSequenceClassification).bfloat16())
    with pytest.raises(KernelError, match=r"GPT2DoubleHeadsModel.forward is not GPT2LMHeadModel's"):
        coda_agent.apply_to_gpt2(tiny_gpt2(head=transformers.GPT2DoubleHeadsModel).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_patched_gpt2_trains_like_hf_on_gpu(monkeypatch, activation):
    """The cute lowering inside the model: quack's GEMMs with the GPT-2 suite's epilogues over the
    Conv1D weights' transposed views, SDPA flash, the fused loss with the tied embedding."""
    monkeypatch.setitem(globals(), "DEVICE", "cuda")
    base = tiny_gpt2(activation_function=activation)
    hi, lo = truth_of(base)
    # the backward on the calling thread: autograd's CUDA device threads do not see the ledger
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_gpt2(copy.deepcopy(base).bfloat16()))
    assert_like_hf(got, hi, lo)
    assert {"ln_rank1", "ln_grad_stats", "bias_grad", "ln_fc_gelu", "dgelu_stats", "logits_lse"} <= {
        launch.name for launch in launched}


def test_apply_to_llama_points_a_gpt2_at_apply_to_gpt2():
    for model in (tiny_gpt2().bfloat16(), tiny_gpt2().bfloat16().transformer):
        with pytest.raises(KernelError, match=r"got GPT2(LMHead)?Model; it is built like GPT-2: "
                           r"coda_agent.apply_to_gpt2\(model\)"):
            coda_agent.apply_to_llama(model)
