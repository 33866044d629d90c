"""The drop-in's QKV op with a projection bias (kernels/llama_ops.py: ``attention_input``) on its
own: every epilogue variant against fp32 autograd through the same math, on the CPU's reference
lowering and (GPU tier) on quack's GEMMs and the pass kernel, and its kernels' sm_90a compile."""

from __future__ import annotations

import pytest
import torch

from coda_agent.kernels.llama_ops import attention_input
from coda_agent.primitives import compile_only, pass_kernel


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
    args = (h, gamma if norm else None, w, bias, pos if rotate else None, freq if rotate else None, 1e-5)
    return (h, gamma, w, bias), pos, freq, args


@pytest.mark.slow
def test_the_bias_epilogues_compile_for_sm90a():
    """Every QKV epilogue with a bias and the backward's bias pass compile for sm_90a with
    warpgroup MMAs (the pass on the pass kernel), no spills and no slow-path calls."""
    with compile_only() as kernels:
        for norm, rotate in ((True, True), (True, False), (False, True), (False, False)):
            _, _, _, args = _attention_input_case(norm, rotate, t=256, dim=256, n=384, rotated=256)
            attention_input(*args).backward(torch.ones(256, 384, dtype=torch.bfloat16))
    compiled = {k.epilogue: k for k in kernels}
    assert {"norm_bias_rope", "scale_rows_bias", "bias_rope", "add_bias", "row_dot_bias", "rope_inverse"} <= set(compiled)
    assert compiled["rope_inverse"].config == pass_kernel.CONFIG
    for k in kernels:
        assert k.sass.sm90a and k.sass.spill_stores == 0 and k.sass.calls == 0, (k.epilogue, k.sass)
        assert (k.sass.hgmma > 0) == (k.kind == "gemm"), (k.epilogue, k.kind)
