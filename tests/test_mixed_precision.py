"""Mixed precision as training scripts run it: fp32 master weights, the step inside
``torch.autocast(dtype=torch.bfloat16)`` (HF Trainer's ``bf16=True``, accelerate's mixed precision).
A patched model with fp32 parameters runs as its bf16 copy (``dropin.PatchedForward``), so it must
land within the bf16 model's noise of the fp32 truth, keep fp32 parameters and gradients, refuse to
run outside bf16 autocast with the fix, and a kernel called directly lowers its fp32 inputs as
autocast lowers a matmul's (``kernel.autocast_inputs``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
import test_llama as llama_tests  # noqa: E402
from dropin_models import MODELS  # noqa: E402
from test_llama import assert_like_hf  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import KernelError  # noqa: E402
from coda_agent.kernels.dropin import suite_kernel  # noqa: E402
from coda_agent.tasks.expr import eval_expr  # noqa: E402


def autocast():
    return torch.autocast(llama_tests.DEVICE, dtype=torch.bfloat16)


@pytest.mark.parametrize("flags", [{}, {"fused_linear_cross_entropy": False}], ids=["fused loss", "HF's loss"])
@pytest.mark.parametrize("family", MODELS)
def test_fp32_master_weights_train_under_bf16_autocast_like_the_bf16_model(family, flags):
    tests, build, patch = MODELS[family].tests, MODELS[family].build, MODELS[family].patch
    base = build()
    hi, lo = tests.truth_of(base)  # the fp32 truth, and the bf16 model's distance from it
    model = patch(copy.deepcopy(base).float(), **flags)
    with autocast():
        got = tests.train_and_eval(model)
    assert_like_hf(got, hi, lo)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    trained = [p for p in model.parameters() if p.grad is not None]
    assert len(trained) == len(list(model.parameters()))  # the casts carry every gradient back


@pytest.mark.parametrize("family", MODELS)
def test_a_mixed_precision_model_compiles_whole(family):
    """torch.compile(fullgraph=True) traces the casts and the parameter swap of the mixed path: no
    graph break, the eager loss, and the gradients on the fp32 parameters."""
    tests, build, patch = MODELS[family].tests, MODELS[family].build, MODELS[family].patch
    model = patch(build().float())
    ids, labels = tests.batch()
    with autocast():
        llama_tests.assert_compiles_like_eager(model, ids, labels)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("family", MODELS)
def test_fp32_weights_outside_autocast_are_refused_with_the_fix(family):
    tests, build, patch = MODELS[family].tests, MODELS[family].build, MODELS[family].patch
    model = patch(build().float())
    ids, labels = tests.batch()
    with pytest.raises(KernelError, match=r"fp32 parameters and runs outside torch.autocast\('cpu', "
                                          r"dtype=torch.bfloat16\).*or call model.to\(torch.bfloat16\)"):
        model(ids, labels=labels)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(KernelError, match="outside torch.autocast"):
        model(ids, labels=labels)


def test_fp16_models_are_refused_at_patch_time():
    with pytest.raises(KernelError, match=r"parameters are \['torch.float16'\].*train under "
                                          r"torch.autocast\(dtype=torch.bfloat16\)"):
        coda_agent.apply_to_llama(llama_tests.tiny_llama().half())


def test_a_kernel_lowers_fp32_inputs_under_autocast_and_names_autocast_outside():
    kernel = suite_kernel("out_proj_residual")
    g = torch.Generator().manual_seed(0)
    env = {k: float(v) for k, v in kernel.spec.shapes["small"].items()}
    inputs = {n: torch.randn(*(int(eval_expr(e, env)) for e in t.shape), generator=g) / 4
              for n, t in kernel.spec.inputs.items()}
    want = kernel(**{n: v.bfloat16() for n, v in inputs.items()})
    leaves = {n: v.clone().requires_grad_(True) for n, v in inputs.items()}
    with autocast():
        got = kernel(**leaves)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    next(iter(got.values())).float().sum().backward()
    assert all(v.grad is not None and v.grad.dtype == torch.float32 for v in leaves.values())
    with pytest.raises(KernelError, match=r"is torch.float32; the kernel was verified for bf16 .*or run it under "
                                          r"torch.autocast\('cpu', dtype=torch.bfloat16\)"):
        kernel(**inputs)


def test_the_fused_loss_lowers_an_fp32_hidden_state_under_autocast():
    """CUDA autocast runs layer_norm in fp32, so a final nn.LayerNorm (GPT-2's ln_f, GPT-NeoX's
    final_layer_norm) hands the fused LM loss an fp32 hidden state: under autocast the loss takes
    it as autocast takes a matmul's operand, at the bf16 result, the gradient back in fp32."""
    from coda_agent.kernels.llama_ops import causal_lm_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 128, generator=g)
    w = (torch.randn(512, 128, generator=g) / 12).bfloat16()
    labels = torch.randint(0, 512, (2, 12), generator=g)
    kernel = suite_kernel("lm_head_xent")
    want = causal_lm_loss(hidden.bfloat16(), w, labels, None, kernel)
    leaf = hidden.clone().requires_grad_(True)
    with autocast():
        got = causal_lm_loss(leaf, w, labels, None, kernel)
    assert torch.equal(got, want)
    got.backward()
    assert leaf.grad.dtype == torch.float32 and leaf.grad.abs().sum() > 0
    with pytest.raises(KernelError, match=r"input 'x' is torch.float32; .* torch.autocast\('cpu'"):
        causal_lm_loss(hidden, w, labels, None, kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("family", MODELS)
def test_fp32_master_weights_train_under_cuda_autocast(monkeypatch, family):
    """The cute lowering under torch.autocast('cuda'): the fp32 model patched, against the fp32
    truth with the bf16 model's noise."""
    tests, build, patch = MODELS[family].tests, MODELS[family].build, MODELS[family].patch
    for module in (llama_tests, tests):
        monkeypatch.setattr(module, "DEVICE", "cuda")
    base = build()
    hi, lo = tests.truth_of(base)
    model = patch(copy.deepcopy(base).float())
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.set_multithreading_enabled(False):
        got = tests.train_and_eval(model)
    assert_like_hf(got, hi, lo)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
