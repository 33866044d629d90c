"""coda_agent.apply_to_llama on a real transformers LlamaForCausalLM (tiny config, CPU,
the reference lowering).

Truth is the unpatched model in fp32; HF's own bf16 model sets the noise floor.
Every tensor that training sees (the loss, the logits, the gradient of every
parameter, read back in HF's layout through the patched state dict) must be
within twice HF's bf16 error plus a floor of 1/256 of the tensor's largest
value (about one bf16 rounding step at that scale: a loss that is right to
bf16 precision must not fail because HF's own bf16 loss was luckily close),
and its relative norm error within 1.5x HF's plus 1e-3.  A kernel wired wrong
(a permutation, a missing residual, a wrong mean) misses by orders of magnitude.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import Kernel, KernelError  # noqa: E402
from coda_agent.kernels.llama import AttentionPlan  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402
from coda_agent.tasks import SUITE_DIR  # noqa: E402

CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=512, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              rope_theta=10000.0, attn_implementation="sdpa")


DEVICE = "cpu"


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return with_norms_off_one(LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).to(DEVICE))


def with_norms_off_one(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its norm weights moved away from 1, so a dropped gamma shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions (a prompt), as HF's loss skips them
    return ids.to(DEVICE), labels.to(DEVICE)


def hf_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients as the state dict lays out the weights (HF's keys and layout)."""
    with torch.no_grad():
        data = {n: p.data for n, p in model.named_parameters()}
        for p in model.parameters():
            p.data = p.grad
        try:
            return {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            for n, p in model.named_parameters():
                p.data = data[n]


def train_and_eval(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    ids, labels = batch()
    model.train()
    model.zero_grad()
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = hf_layout(model)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    return {"loss": out.loss.detach(), "logits": logits, **{f"d {k}": v for k, v in grads.items()}}


@pytest.fixture(scope="module")
def truth():
    base = tiny_llama()
    return base, train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())


def assert_like_hf(got: dict, hi: dict, lo: dict) -> None:
    assert set(got) == set(hi)
    for k in hi:
        g, h, l_ = got[k].float(), hi[k].float(), lo[k].float()
        err, noise = (g - h).abs().max().item(), (l_ - h).abs().max().item()
        assert err <= 2 * noise + h.abs().max().item() / 256, (k, err, noise)
        rel, rel_lo = ((g - h).norm() / h.norm()).item(), ((l_ - h).norm() / h.norm()).item()
        assert rel <= 1.5 * rel_lo + 1e-3, (k, rel, rel_lo)


@pytest.mark.parametrize("flags", [{}, {"rope": False}, {"swiglu": False}, {"fused_linear_cross_entropy": False},
                                   {"rms_norm": False, "swiglu": False}], ids=str)
def test_patched_model_trains_like_hf(truth, flags):
    base, hi, lo = truth
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), **flags)
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    names = {launch.name for launch in launched}
    on = {**{"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}, **flags}
    assert "add_residual" in names  # out_proj_residual, every patched layer
    assert ("norm_swiglu" in names) == on["swiglu"] and ("dswiglu" in names) == on["swiglu"]
    assert ("logits_lse" in names) == on["fused_linear_cross_entropy"]
    qkv_epilogue = {(True, True): "norm_rope", (True, False): "scale_rows", (False, True): "rope"}
    assert qkv_epilogue[on["rms_norm"], on["rope"]] in names
    assert ("rmsnorm_dx" in names) == on["rms_norm"]


def test_state_dict_keeps_hf_keys_and_values():
    hf = tiny_llama().bfloat16()
    model = coda_agent.apply_to_llama(copy.deepcopy(hf))
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(model.named_parameters())
    want, got = hf.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    other = tiny_llama(seed=5).bfloat16()  # an HF checkpoint loads into the patched model ...
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    fresh = tiny_llama(seed=9).bfloat16()  # ... and the patched model's into an unpatched one
    fresh.load_state_dict(model.state_dict())
    ids, _ = batch()
    model.eval()
    fresh.eval()
    with torch.no_grad():
        a, b = model(ids).logits.float(), fresh(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def assert_within_fp8(got: dict, hi: dict) -> None:
    for k in hi:
        rel = ((got[k].float() - hi[k].float()).norm() / hi[k].float().norm()).item()
        assert rel <= 0.12, (k, rel)
    assert abs(got["loss"].item() - hi["loss"].item()) <= 0.01 * hi["loss"].item()


def test_fp8_mlp_trains_within_fp8_error(truth):
    """The MLP blocks in fp8 (mlp_block_fp8): every tensor training sees stays within the
    task's own fp8 error (3-9% relative, tasks/llama3_fp8/mlp_block_fp8.yaml) of the fp32
    model; a block wired wrong misses by orders of magnitude."""
    base, hi, _ = truth
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), fp8_mlp=True)
    assert model.model.coda_flags["fp8_mlp"] and model.model.layers[0].coda_plan.mlp.name == "mlp_block_fp8"
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"quantize_rows", "norm_swiglu", "dswiglu"} <= {launch.name for launch in launched}
    assert_within_fp8(got, hi)
    with pytest.raises(KernelError, match="fp8_mlp=True and kernels\\['mlp_block'\\] both choose"):
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), fp8_mlp=True,
                                  kernels={"mlp_block": model.model.layers[0].coda_plan.mlp})
    with pytest.raises(KernelError, match="needs swiglu=True"):
        coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), fp8_mlp=True, swiglu=False)


def test_swapping_in_another_program_for_a_task():
    mine = Kernel.from_files(SUITE_DIR / "experts" / "mlp_block.py", SUITE_DIR / "mlp_block.yaml")
    model = coda_agent.apply_to_llama(tiny_llama().bfloat16(), kernels={"mlp_block": mine})
    assert model.model.layers[1].coda_plan.mlp is mine
    with pytest.raises(KernelError, match="kernels\\['out_proj_residual'\\] solves task 'mlp_block', whose "
                       "contract is not that of 'out_proj_residual': inputs"):
        coda_agent.apply_to_llama(tiny_llama().bfloat16(), kernels={"out_proj_residual": mine})
    with pytest.raises(KernelError, match="'rope_fwd' is not a task the drop-in runs"):
        coda_agent.apply_to_llama(tiny_llama().bfloat16(), kernels={"rope_fwd": mine})


def test_models_the_kernels_do_not_cover_get_a_clear_error():
    with pytest.raises(KernelError, match=r"call model.to\(torch.bfloat16\) before apply_to_llama"):
        coda_agent.apply_to_llama(tiny_llama())
    with pytest.raises(KernelError, match="needs rms_norm=True"):
        coda_agent.apply_to_llama(tiny_llama().bfloat16(), rms_norm=False)
    with pytest.raises(KernelError, match=r"layers.0.mlp.gate_proj.bias: MLP biases \(mlp_bias\) .* pass "
                       "swiglu=False"):
        coda_agent.apply_to_llama(tiny_llama(mlp_bias=True).bfloat16())
    partial = tiny_llama().bfloat16()
    partial.model.layers[1].self_attn.k_proj.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match=r"layers.1.self_attn: biases on some of q_proj, k_proj, v_proj"):
        coda_agent.apply_to_llama(partial)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    with pytest.raises(KernelError, match="pass rope=False"):
        coda_agent.apply_to_llama(tiny_llama(rope_parameters=yarn).bfloat16())
    model = coda_agent.apply_to_llama(tiny_llama().bfloat16())
    with pytest.raises(KernelError, match="already patched"):
        coda_agent.apply_to_llama(model)
    with pytest.raises(KernelError, match=r"LlamaForCausalLM or LlamaModel \(or a model family built from "
                       r"LLaMA's modules, such as Mistral or Qwen3\); got Linear"):
        coda_agent.apply_to_llama(torch.nn.Linear(2, 2))


def tiny(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A config-built transformers causal LM of ``family`` at the tiny LLaMA config's widths."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{family}Config")(**{**CONFIG, "pad_token_id": None, "bos_token_id": None,
                                                       "eos_token_id": None, **overrides})
    return with_norms_off_one(getattr(transformers, f"{family}ForCausalLM")(cfg).to(DEVICE))


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


@pytest.mark.parametrize("family", ["Mistral", "Qwen3", "Qwen2", "Phi3"])
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


def with_biases(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its projection biases drawn at the weights' scale (HF initializes them to
    zero, where a bias that is dropped, misplaced or given no gradient would not show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize(("norm", "rotate"), [(True, True), (True, False), (False, True), (False, False)],
                         ids=["norm_rope", "norm", "rope", "plain"])
def test_the_attention_input_with_a_bias_matches_fp32_autograd(norm, rotate, device):
    """The QKV op alone, at biases large against the GEMM's output (trained Qwen2 q/k biases are):
    the output and the gradients of h, gamma, W and the bias within bf16 rounding of fp32
    autograd through the same math (RMSNorm, GEMM, bias, RoPE on the leading columns); on CUDA,
    quack's GEMMs with the bias epilogues and the bias pass on the pass kernel."""
    from coda_agent.kernels.llama_ops import attention_input

    (h, gamma, w, bias), pos, freq, args = _attention_input_case(norm, rotate, device=device)
    dout = torch.randn(h.shape[0], w.shape[0]).to(device, torch.bfloat16)
    out = attention_input(*args)
    out.backward(dout)

    ref = [x.detach().float().requires_grad_() for x in (h, gamma, w, bias)]
    x = ref[0] * torch.rsqrt(ref[0].pow(2).mean(-1, keepdim=True) + 1e-5) * ref[1] if norm else ref[0]
    pre = x @ ref[2].t() + ref[3]
    if rotate:
        ang = pos[:, None] * freq[None, 0::2]
        e, o = pre[:, 0::2], pre[:, 1::2]
        pre = torch.stack((e * ang.cos() - o * ang.sin(), e * ang.sin() + o * ang.cos()), -1).flatten(1)
    pre.backward(dout.float())
    pairs = [("out", out, pre), ("dh", h.grad, ref[0].grad), ("dW", w.grad, ref[2].grad),
             ("dbias", bias.grad, ref[3].grad)] + ([("dgamma", gamma.grad, ref[1].grad)] if norm else [])
    for name, got, want in pairs:
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 6e-3, (name, rel)


def _attention_input_case(norm: bool, rotate: bool, bias_scale: float = 2.0, t: int = 48, dim: int = 128,
                          n: int = 256, rotated: int = 192, device: str = "cpu") -> tuple:
    """bf16 leaves (h, gamma, W, bias), positions, RoPE lanes and the op's arguments."""
    torch.manual_seed(0)
    leaves = [torch.randn(t, dim), 1 + 0.1 * torch.randn(dim), torch.randn(n, dim) / dim ** 0.5,
              bias_scale * torch.randn(n)]
    h, gamma, w, bias = (x.to(device, torch.bfloat16).requires_grad_() for x in leaves)
    pos = torch.arange(t, device=device).float() * 7  # angles past 2 pi
    freq = torch.cat(((1e4 ** -(torch.arange(0, rotated, 2) / rotated)).repeat_interleave(2),
                      torch.zeros(n - rotated))).to(device)
    args = (h, gamma if norm else None, w, bias, pos if rotate else None, freq if rotate else None, 1e-5, rotated)
    return (h, gamma, w, bias), pos, freq, args


@pytest.mark.slow
def test_the_bias_epilogues_compile_for_sm90a():
    """Every QKV epilogue with a bias and the backward's bias pass compile for sm_90a with
    warpgroup MMAs (the pass on the pass kernel), no spills and no slow-path calls."""
    from coda_agent.kernels.llama_ops import attention_input
    from coda_agent.primitives import compile_only

    with compile_only() as kernels:
        for norm, rotate in ((True, True), (True, False), (False, True), (False, False)):
            _, _, _, args = _attention_input_case(norm, rotate, t=256, dim=256, n=384, rotated=256)
            attention_input(*args).backward(torch.ones(256, 384, dtype=torch.bfloat16))
    compiled = {k.epilogue: k for k in kernels}
    assert {"norm_bias_rope", "scale_rows_bias", "bias_rope", "add_bias", "row_dot_bias"} <= set(compiled)
    for k in kernels:
        assert k.sass.sm90a and k.sass.spill_stores == 0 and k.sass.calls == 0, (k.epilogue, k.sass)
        assert (k.sass.hgmma > 0) == (k.kind == "gemm"), (k.epilogue, k.kind)


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


def test_tied_embeddings_train_like_hf():
    """LLaMA-3.2-1B (and small Qwen3s) tie the LM head to the embedding: the fused loss's dW and
    the embedding's gradient land on one parameter, as in the unpatched model."""
    base = tiny_llama(tie_word_embeddings=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    assert_like_hf(train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())), hi, lo)


def test_a_qwen3_model_trains_like_hf():
    """Qwen3 adds per-head RMSNorms of q and k before RoPE, and here a sliding window on its
    second layer: the norms and RoPE stay HF's (RoPE cannot ride in the GEMM past the norms),
    the rest is the suite's kernels, and it trains like the unpatched model."""
    base = tiny("Qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [layer.self_attn.sliding_window for layer in base.model.layers] == [None, 8]
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())
    assert [layer.coda_attention for layer in model.model.layers] == [
        AttentionPlan(qk_norm=True), AttentionPlan(qk_norm=True, window=8)]
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


def test_a_gemma_model_trains_like_hf_with_its_mlp_kept():
    """Gemma's RMSNorm scales by 1 + w (in fp32) and its MLP is GeGLU: the input norm folds into
    the QKV GEMM with that scale, RoPE and the output projection are the suite's, the MLP and
    its norm stay HF's (swiglu=False, which the refusal above asks for)."""
    base = tiny("Gemma")
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    model = coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), swiglu=False)
    assert model.model.layers[0].coda_plan.norm_offset == 1.0
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert {"norm_rope", "rmsnorm_dx", "add_residual", "logits_lse"} <= {launch.name for launch in launched}
    assert_like_hf(got, hi, lo)


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
    ("Gemma", {}, r"RMSNorms scale by \(1 \+ weight\) \(Gemma's\), which the MLP block kernel .* pass swiglu=False"),
    ("Granite", {}, r"GraniteForCausalLM.forward computes something other than LLaMA's causal LM"),
    ("Olmo2", {}, r"Olmo2Attention.forward is not LLaMA's, Mistral's, Qwen3's, Qwen2's or Phi-3's attention"),
    ("Gemma2", {"hidden_act": "silu"}, r"Gemma2Attention.forward is not"),
    ("Phi3", {"resid_pdrop": 0.1}, r"layers.0.resid_attn_dropout drops with p = 0.1: .* resid_pdrop=0.0"),
], ids=["Gemma", "Granite", "Olmo2", "Gemma2", "Phi3-dropout"])
def test_a_model_that_is_not_llama_s_modules_is_refused_by_what_differs(family, overrides, refusal):
    """Every module the patch replaces must compute what LLaMA's does, read from its code: a model
    with a (1 + w) RMSNorm, logit scaling, softcapped or post-normed attention would
    otherwise train silently wrong."""
    model = tiny(family, **overrides).bfloat16()
    with pytest.raises(KernelError, match=refusal):
        coda_agent.apply_to_llama(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize(("family", "fp8_mlp"), [("Llama", False), ("Llama", True), ("Mistral", False),
                                                  ("Qwen3", False), ("Qwen2", False), ("Phi3", False)],
                         ids=["bf16", "fp8_mlp", "mistral", "qwen3", "qwen2", "phi3"])
def test_patched_model_trains_like_hf_on_gpu(monkeypatch, family, fp8_mlp):
    """The cute lowering inside the model: quack's GEMMs with the suite's epilogues (fp8 ones
    for the MLP blocks with ``fp8_mlp``), SDPA flash; Mistral with a window shorter than the
    sequence, Qwen3 with its q/k norms, Qwen2 with its q/k/v biases, Phi-3 with its fused
    projections."""
    monkeypatch.setitem(globals(), "DEVICE", "cuda")
    window = {"sliding_window": 8} if family == "Mistral" else {}
    base = tiny_llama() if family == "Llama" else tiny(family, **window)
    if family == "Qwen2":
        base = with_biases(base)
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    # the backward on the calling thread: autograd's CUDA device threads do not see the ledger
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16(), fp8_mlp=fp8_mlp))
    if fp8_mlp:
        assert_within_fp8(got, hi)
    else:
        assert_like_hf(got, hi, lo)
    # Qwen3's RoPE stays HF's, after its q/k norms
    qkv = {"Qwen3": "scale_rows", "Qwen2": "norm_bias_rope"}.get(family, "norm_rope")
    assert {qkv, "rmsnorm_dx", "dswiglu", "logits_lse"} <= {launch.name for launch in launched}


def test_kv_cache_decoding_copies_and_checkpointing():
    model = coda_agent.apply_to_llama(tiny_llama().bfloat16())
    ids, labels = batch()
    model.eval()
    with torch.no_grad():  # one decoding step on the cache = the last row of a full forward
        full = model(ids[:, :9]).logits[:, -1].float()
        past = model(ids[:, :8], use_cache=True).past_key_values
        step = model(ids[:, 8:9], past_key_values=past, use_cache=True).logits[:, -1].float()
    assert (step - full).abs().max() < 0.05 * full.abs().max()
    twin = copy.deepcopy(model)  # an EMA / reference copy is patched too, with its own weights
    assert twin.model.layers[0].forward.module is twin.model.layers[0]
    assert twin.model.layers[0].coda_plan.mlp is model.model.layers[0].coda_plan.mlp
    a = train_and_eval(model)
    twin.gradient_checkpointing_enable()
    b = train_and_eval(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
