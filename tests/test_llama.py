"""coda_agent.apply_to_llama on a real transformers LlamaForCausalLM (tiny config, CPU,
the reference lowering).

Truth is the unpatched model in fp32; HF's own bf16 model sets the noise floor.
Every tensor that training sees (the loss, the logits, the gradient of every
parameter, read back in HF's layout through the patched state dict) is held to
:mod:`coda_agent.kernels.like_hf`'s bar: within twice HF's bf16 error (plus a
floor of 1/256 of the tensor's largest value), its relative norm error within
1.5x HF's plus 1e-3.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import Kernel, KernelError, like_hf  # noqa: E402
from coda_agent.primitives import launch_ledger, tuning  # noqa: E402
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


def train_and_eval(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The loss, the eval logits and every gradient (HF's layout) of one training step of ``model``
    on ``data`` (ids, labels; this file's :func:`batch` by default)."""
    ids, labels = data or batch()
    model.train()
    model.zero_grad()
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = hf_layout(model)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    return {"loss": out.loss.detach(), "logits": logits, **{f"d {k}": v for k, v in grads.items()}}


def truth_of(base: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """:func:`train_and_eval` of the unpatched ``base`` in fp32 (the truth) and in bf16 (the noise floor)."""
    return train_and_eval(copy.deepcopy(base).float(), data), train_and_eval(copy.deepcopy(base).bfloat16(), data)


@pytest.fixture(scope="module")
def truth():
    base = tiny_llama()
    return (base, *truth_of(base))


def assert_decodes_copies_and_checkpoints(model: torch.nn.Module, layers: Any, slot: str,
                                          data: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """A patched ``model`` (its decoder layers: ``layers(model)``): one decoding step on the KV cache
    equals the last row of a full forward; a deep copy (an EMA or reference model) is patched too,
    its layers' forwards bound to its own layers and the plan's kernel ``slot`` shared; and gradient
    checkpointing changes nothing of a training step on ``data``."""
    ids, _ = data or batch()
    model.eval()
    with torch.no_grad():  # one decoding step on the cache = the last row of a full forward
        full = model(ids[:, :9]).logits[:, -1].float()
        past = model(ids[:, :8], use_cache=True).past_key_values
        step = model(ids[:, 8:9], past_key_values=past, use_cache=True).logits[:, -1].float()
    assert (step - full).abs().max() < 0.05 * full.abs().max()
    twin = copy.deepcopy(model)  # an EMA / reference copy is patched too, with its own weights
    assert layers(twin)[0].forward.module is layers(twin)[0]
    assert getattr(layers(twin)[0].coda_plan, slot) is getattr(layers(model)[0].coda_plan, slot)
    a = train_and_eval(model, data)
    twin.gradient_checkpointing_enable()
    b = train_and_eval(twin, data)
    assert all(torch.equal(a[k], b[k]) for k in a)


def assert_compiles_like_eager(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """torch.compile(fullgraph=True) traces the patched ``model`` with no graph break (AOTAutograd,
    no code generation): the same loss as eager, and gradients within bf16 rounding of eager's."""
    model.train()
    eager = model(ids, labels=labels).loss
    eager.backward()
    want = hf_layout(model)
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, labels=labels).loss
    compiled.backward()
    got = hf_layout(model)
    assert torch.equal(compiled, eager)
    for k in want:  # AOTAutograd decomposes HF's own ops (SDPA, the norms): bf16 rounding differs there
        assert (got[k].float() - want[k].float()).abs().max() <= 2e-2 * want[k].float().abs().max() + 1e-3, k


def assert_like_hf(got: dict, hi: dict, lo: dict, err_factor: float = 2, rel_factor: float = 1.5, few: int = 0
                   ) -> None:
    """Each tensor of ``got`` against the truth ``hi`` within the bar of :mod:`coda_agent.kernels.like_hf`
    (the module docstring's): its largest error at ``err_factor`` times HF's bf16 error (``lo``), its
    relative norm error at ``rel_factor`` (not for tensors of fewer than ``few`` elements)."""
    assert set(got) == set(hi)
    missed = like_hf.misses(got, hi, lo, err_factor=err_factor, rel_factor=rel_factor, few=few)
    assert not missed, f"past the bar (tensor, times the bar): {missed}"


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


def test_a_fused_parts_name_reads_its_rows_and_refuses_to_run():
    """``self_attn.q_proj`` and ``mlp.gate_proj`` stay as names (torch.distributed.checkpoint walks
    each state-dict key to its module): they own no parameters and read their rows of the fused
    weight, which the optimizer steps."""
    hf = tiny_llama().bfloat16()
    model = coda_agent.apply_to_llama(copy.deepcopy(hf))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layer = hf.model.layers[0]
    for part, want in ((attn.q_proj, layer.self_attn.q_proj), (attn.v_proj, layer.self_attn.v_proj),
                       (mlp.up_proj, layer.mlp.up_proj)):
        assert list(part.parameters()) == [] and torch.equal(part.weight, want.weight) and part.bias is None
    assert not any(".q_proj." in n or ".gate_proj." in n for n, _ in model.named_parameters())
    with torch.no_grad():
        mlp.gate_up_proj.weight.mul_(2)
    assert torch.equal(mlp.gate_proj.weight, 2 * layer.mlp.gate_proj.weight)
    with pytest.raises(RuntimeError, match="one part of the fused 'qkv_proj'"):
        attn.k_proj(torch.zeros(1, hf.config.hidden_size, dtype=torch.bfloat16))


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
        coda_agent.apply_to_llama(tiny_llama().half())  # fp32 master weights train under autocast
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


def with_biases(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its projection biases drawn at the weights' scale (HF initializes them to
    zero, where a bias that is dropped, misplaced or given no gradient would not show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def test_tied_embeddings_train_like_hf():
    """LLaMA-3.2-1B (and small Qwen3s) tie the LM head to the embedding: the fused loss's dW and
    the embedding's gradient land on one parameter, as in the unpatched model."""
    base = tiny_llama(tie_word_embeddings=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    assert_like_hf(train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16())), hi, lo)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("tile", [str(c) for c in tuning.WIDE_CANDIDATES if c not in tuning.CANDIDATES])
def test_patched_model_trains_like_hf_at_each_tile_of_the_wide_pool(monkeypatch, tile):
    """A tile the wide pool adds, as a tuning-cache hit would give it to every tunable GEMM of
    the step (the tuner times tiles, it does not check them): the model still trains like HF's,
    with partial tiles on every edge (48 tokens, 128-wide rows)."""
    import importlib

    cfg = next(c for c in tuning.WIDE_CANDIDATES if str(c) == tile)
    monkeypatch.setitem(globals(), "DEVICE", "cuda")
    gemm_module = importlib.import_module("coda_agent.primitives.gemm")

    def hit(epi, m, n, k, dtype, device, operands):
        whole = tuning._whole_heads(cfg, tuning._head_dims(epi, operands))
        return cfg if tuning.tunable(epi) and whole else None

    monkeypatch.setattr(gemm_module, "lookup", hit)
    base = tiny_llama()
    hi, lo = train_and_eval(copy.deepcopy(base).float()), train_and_eval(copy.deepcopy(base).bfloat16())
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        got = train_and_eval(coda_agent.apply_to_llama(copy.deepcopy(base).bfloat16()))
    assert_like_hf(got, hi, lo)
    at_tile = {launch.name for launch in launched if launch.config == tile}
    assert {"norm_swiglu", "dswiglu", "rmsnorm_dx", "logits_lse", "add_residual"} <= at_tile, at_tile


def test_kv_cache_decoding_copies_and_checkpointing():
    model = coda_agent.apply_to_llama(tiny_llama().bfloat16())
    assert_decodes_copies_and_checkpoints(model, lambda m: m.model.layers, "mlp")
