"""Gated MLPs found by their code's shape (kernels/gated_mlps.py): Llama 4's ``Llama4TextMLP``
(its dense layers' MLP and its mixture of experts' shared expert) computes LLaMA's MLP in other
code, and trains like HF through apply_to_model at tiny widths (CPU, the reference lowering, held
to test_llama.py's bar).  Then the rule on modules written here: what it takes and what it must
pass by."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from test_llama import CONFIG, assert_like_hf, batch, train_and_eval, truth_of, with_norms_off_one  # noqa: E402

import coda_agent  # noqa: E402
from coda_agent.kernels import gated_mlps  # noqa: E402
from coda_agent.primitives import launch_ledger  # noqa: E402


def tiny_llama4() -> nn.Module:
    """Llama 4 text at the tiny LLaMA widths: layer 0 dense, layer 1 a mixture of two experts and
    a shared expert (``interleave_moe_layer_step=2``)."""
    import transformers

    cfg = transformers.Llama4TextConfig(**{**CONFIG, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                                           "intermediate_size_mlp": 256, "num_local_experts": 2,
                                           "interleave_moe_layer_step": 2})
    torch.manual_seed(0)
    return with_norms_off_one(transformers.Llama4ForCausalLM(cfg))


def test_llama4s_mlps_train_like_hf():
    base = tiny_llama4()
    hi, lo = truth_of(base)
    model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16(), fused_linear_cross_entropy=False)
    assert model.coda_flags["swiglu_mlp"] == ["model.layers.0.feed_forward",
                                              "model.layers.1.feed_forward.shared_expert"]
    assert model.state_dict().keys() == base.state_dict().keys()  # gate and up fused, HF's keys kept
    with launch_ledger() as launched:
        got = train_and_eval(model)
    assert_like_hf(got, hi, lo)
    names = [launch.name for launch in launched]
    # both MLPs: forward in the training step and the eval pass, backward once
    assert names.count("swiglu") == 4 and names.count("dswiglu") == 2


# --------------------------------------------------------------------------- the rule


class Split(nn.Module):
    """Llama 4's shape: the product in a temporary, then the down projection."""

    def __init__(self, bias: bool = False, act: nn.Module | None = None):
        super().__init__()
        self.w_gate, self.w_up = nn.Linear(16, 32, bias=bias), nn.Linear(16, 32, bias=bias)
        self.w_down, self.act = nn.Linear(32, 16, bias=bias), act or nn.SiLU()

    def forward(self, x):
        h = self.act(self.w_gate(x)) * self.w_up(x)
        return self.w_down(h)


class Swapped(Split):
    def forward(self, x):
        return self.w_down(self.w_up(x) * self.act(self.w_gate(x)))


class ReadTwice(Split):
    def forward(self, x):
        h = self.act(self.w_gate(x)) * self.w_up(x)
        return self.w_down(h) + h.sum()


class TouchedElsewhere(Split):
    def forward(self, x):
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))

    def gate_only(self, x):
        return self.w_gate(x)


class OtherInput(Split):
    def forward(self, x, y):
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(y))


class Branches(Split):
    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2.0
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))


LAYOUT = gated_mlps.Layout(("w_gate", "w_up"), "w_down", "act")


@pytest.mark.parametrize("cls,layout", [(Split, LAYOUT), (Swapped, LAYOUT), (ReadTwice, None),
                                        (TouchedElsewhere, None), (OtherInput, None), (Branches, None)])
def test_the_rule_takes_a_gated_mlp_s_shape_and_nothing_else(cls, layout):
    assert gated_mlps.layout_by_rule(cls) == layout


def test_a_module_of_that_shape_runs_as_the_kernel_of_its_activation():
    torch.manual_seed(0)
    module = Split().bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    want = module(x)
    kind, layout, task = gated_mlps.recognised(module)
    assert (kind, layout, task) == (gated_mlps.BY_RULE, LAYOUT, "swiglu_mlp")
    gated_mlps.patch(module, layout, task, gated_mlps.suite_kernel(task))
    torch.testing.assert_close(module(x), want, rtol=2e-2, atol=2e-2)
    assert module.state_dict().keys() == Split().state_dict().keys()


def test_biases_another_activation_or_no_linears_are_passed_by():
    assert gated_mlps.recognised(Split(bias=True)) == (None, None, None)  # a vision tower's MLP: no site
    kind, layout, task = gated_mlps.recognised(Split(act=nn.GELU()))
    assert task is None and "is a gated MLP in its code's shape with GELU, neither SiLU nor GELU's tanh form" in \
        gated_mlps.why_not(Split(act=nn.GELU()), kind, layout)
    convs = Split()
    convs.w_up = nn.Conv1d(16, 32, 1)
    assert gated_mlps.recognised(convs) == (None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_llama4s_mlps_train_like_hf_on_gpu():
    """The cute lowering: swiglu_mlp's kernels in Llama 4's dense MLP and shared expert on the GPU."""
    base = tiny_llama4().cuda()
    data = tuple(t.cuda() for t in batch())
    hi, lo = (train_and_eval(copy.deepcopy(base).to(dtype), data) for dtype in (torch.float32, torch.bfloat16))
    with launch_ledger() as launched, torch.autograd.set_multithreading_enabled(False):
        model = coda_agent.apply_to_model(copy.deepcopy(base).bfloat16(), fused_linear_cross_entropy=False)
        got = train_and_eval(model, data)
    assert_like_hf(got, hi, lo)
    assert {"swiglu", "dswiglu"} <= {launch.name for launch in launched}


def clamped_mlp(family: str, bias: bool = False, **overrides) -> nn.Module:
    """A clamped SwiGLU MLP of ``family``'s code at tiny widths, its limit lowered to 1 so that about
    8% of the pre-activations clamp, its weights (and biases) at a trained model's scale."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLDenseMLP

    torch.manual_seed(0)
    if family == "DeepseekV4":
        module = DeepseekV4MLP(transformers.DeepseekV4Config(hidden_size=128, intermediate_size=256, mlp_bias=bias,
                                                             **overrides))
        module.limit = 1.0
    elif family == "Glm5Next":
        module = Glm5NextTextMLP(transformers.Glm5NextTextConfig(hidden_size=128, intermediate_size=256,
                                                                 num_attention_heads=4, num_key_value_heads=4))
        module.swiglu_limit = 1.0
    else:
        module = MiniMaxM3VLDenseMLP(transformers.MiniMaxM3VLTextConfig(hidden_size=128), intermediate_size=256)
        module.swiglu_limit = 1.0
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 0.05)
    return module


def _mlp_run(module: nn.Module, dtype: torch.dtype, seed: int, device: str) -> dict:
    from test_llama import hf_layout

    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(2, 24, 128, generator=gen), torch.randn(2, 24, 128, generator=gen)
    module = module.to(device=device, dtype=dtype)
    x = x.to(device, dtype).requires_grad_(True)
    y = module(x)
    y.backward(dy.to(device, dtype))
    return {"y": y.detach().float().cpu(), "dx": x.grad.float().cpu(),
            **{f"d {k}": v.float().cpu() for k, v in hf_layout(module).items()}}


@pytest.mark.parametrize("family,bias,params", [
    ("DeepseekV4", False, {"limit": 1.0, "alpha": 1.0, "offset": 0.0}),
    ("DeepseekV4", True, {"limit": 1.0, "alpha": 1.0, "offset": 0.0}),
    ("Glm5Next", False, {"limit": 1.0, "alpha": 1.0, "offset": 0.0}),
    ("MiniMaxM3VL", False, {"limit": 1.0, "alpha": 1.702, "offset": 1.0})])
def test_clamped_mlps_run_as_the_clamped_kernel(family, bias, params, device="cpu"):
    """DeepSeek-V4's and GLM-5's MLPs (shared experts, dense layers) and MiniMax-M3's dense MLP run as
    swiglu_clamp_mlp with the module's limit and alpha: the output and every gradient, biases
    included, against HF's module in fp32 within 3x HF's bf16 error (the clamps' kinks, as the
    task's kinked gradients are widened) on two draws, and HF's state-dict keys kept."""
    base = clamped_mlp(family, bias)
    kind, layout, task = gated_mlps.recognised(base)
    assert task == "swiglu_clamp_mlp", (kind, task)
    for seed in range(2):
        hi, lo = (_mlp_run(copy.deepcopy(base), dtype, seed, device) for dtype in (torch.float32, torch.bfloat16))
        module = copy.deepcopy(base).bfloat16()
        gated_mlps.check(module, "mlp", layout, task)
        gated_mlps.patch(module, layout, task, gated_mlps.suite_kernel(task))
        assert module.coda_params == params
        with launch_ledger() as launched:
            got = _mlp_run(module, torch.bfloat16, seed, device)
        assert_like_hf(got, hi, lo, err_factor=3)
        assert {"clamp_swiglu", "dclamp_swiglu"} <= {launch.name for launch in launched}
    assert module.state_dict().keys() == base.state_dict().keys()


def test_a_clamped_mlp_of_another_activation_is_passed_by_with_why():
    gelu = clamped_mlp("DeepseekV4", hidden_act="gelu")
    kind, layout, task = gated_mlps.recognised(gelu)
    assert kind == "DeepSeek-V4's" and task is None
    assert "is DeepSeek-V4's clamped MLP code with GELUActivation or no finite limit" in gated_mlps.why_not(
        gelu, kind, layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("family,bias,params", [("DeepseekV4", True, {"limit": 1.0, "alpha": 1.0, "offset": 0.0}),
                                                ("MiniMaxM3VL", False, {"limit": 1.0, "alpha": 1.702, "offset": 1.0})])
def test_clamped_mlps_run_as_the_clamped_kernel_on_gpu(family, bias, params):
    with torch.autograd.set_multithreading_enabled(False):
        test_clamped_mlps_run_as_the_clamped_kernel(family, bias, params, device="cuda")
