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
