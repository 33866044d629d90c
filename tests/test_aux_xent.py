"""``xent_grad_``: the PyTorch path (CPU: the reference lowering and CI) and the
Triton kernel (CUDA tensors) compute the same thing,
``logits <- (softmax(logits) - onehot(target)) * scale`` in place (the softmax
of the stored logits, ``exp(logits - m)`` over its row sum, ``m`` the row's maximum), with
``scale = dloss`` (0 on ``ignore_index`` rows) and no one-hot for a target
outside [0, V).

The Triton kernel itself is also checked on the CPU through Triton's
interpreter (in a subprocess: ``TRITON_INTERPRET`` is read when the kernel is
decorated); the interpreter truncates to bf16 where the GPU rounds, so bf16 is
compared to one bf16 ulp there and exactly-rounded fp16 to fp32 rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.overrides import TorchFunctionMode

from coda_agent.primitives import aux, launch_ledger, lowering


def _case(rows, vocab, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    lse = torch.logsumexp(logits.float(), 1)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[0] = -100                  # ignored: the row becomes 0
    target[1] = vocab + 3             # out of range: no one-hot
    target[2] = -7                    # negative but not ignore_index: no one-hot, scaled
    target[3] = vocab - 1             # the last column
    dloss = torch.randn(rows, generator=g)
    return [t.to(device) for t in (logits, lse, target, dloss)]


def _expected(logits, lse, target, dloss, ignore_index=-100):
    rows, vocab = logits.shape
    x = logits.float()
    p = torch.exp(x - x.amax(1, keepdim=True))
    p = p / p.sum(1, keepdim=True)
    for r in range(rows):
        t = int(target[r])
        if 0 <= t < vocab:
            p[r, t] -= 1.0
    scale = torch.where(target == ignore_index, 0.0, dloss.float())
    return p * scale[:, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(6, 50), (37, 300), (9, 5000)])
def test_torch_path_semantics(rows, vocab, dtype):
    logits, lse, target, dloss = _case(rows, vocab, dtype)
    buf = logits.clone()
    got = aux.xent_grad_(buf, lse, target, dloss)
    assert got is buf and got.dtype == dtype  # in place, in the logits' dtype
    want = _expected(logits, lse, target, dloss)
    # One rounding to the logits' dtype from the fp32 value.
    torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=0)
    assert torch.all(got[0] == 0)


def test_the_probabilities_of_rounded_large_logits_sum_to_one():
    """lse comes from the fp32 accumulator, the logits are stored rounded: at logits near 100
    a bf16 rounding moves exp(x - lse) by a quarter, so the kernel renormalises by the row sum."""
    g = torch.Generator().manual_seed(5)
    exact = torch.randn(8, 1000, generator=g) * 40
    lse = torch.logsumexp(exact, 1)  # as the GEMM epilogue's online lse sees the accumulator
    target = torch.randint(0, 1000, (8,), generator=g)
    got = aux.xent_grad_(exact.to(torch.bfloat16), lse, target, torch.ones(8)).float()
    got[torch.arange(8), target] += 1.0  # back to the probabilities
    torch.testing.assert_close(got.sum(1), torch.ones(8), atol=0.02, rtol=0)
    assert (torch.exp(exact.to(torch.bfloat16).float() - lse[:, None]).sum(1) - 1).abs().max() > 0.1


def test_logits_past_exps_range_give_probabilities_not_nan():
    """Past logits of about 2^14 a bf16 rounding moves a stored logit above the accumulator's lse by
    more than exp's range (exp(x - lse) overflows to inf, and inf / inf is NaN): the softmax is
    taken against the stored row's maximum instead."""
    g = torch.Generator().manual_seed(7)
    exact = torch.randn(8, 1000, generator=g) * 2.0 ** 17
    lse = torch.logsumexp(exact, 1)
    stored = exact.to(torch.bfloat16)
    assert (stored.float() - lse[:, None]).amax() > 88  # fp32's exp overflows past 88.7
    target = torch.randint(0, 1000, (8,), generator=g)
    got = aux.xent_grad_(stored, lse, target, torch.ones(8)).float()
    assert torch.isfinite(got).all()
    got[torch.arange(8), target] += 1.0
    torch.testing.assert_close(got.sum(1), torch.ones(8), atol=0.02, rtol=0)


def test_torch_path_on_a_row_slice_and_custom_ignore_index():
    logits, lse, target, dloss = _case(20, 128, torch.bfloat16, seed=3)
    target[5] = 7
    big = torch.zeros(24, 128, dtype=torch.bfloat16)
    big[2:22] = logits
    aux.xent_grad_(big[2:22], lse, target, dloss, ignore_index=7)
    want = _expected(logits, lse, target, dloss, ignore_index=7)
    torch.testing.assert_close(big[2:22], want.to(torch.bfloat16), atol=0, rtol=0)
    assert torch.all(big[5 + 2] == 0) and torch.all(big[:2] == 0) and torch.all(big[22:] == 0)


def test_torch_path_has_no_host_sync():
    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    logits, lse, target, dloss = _case(16, 64, torch.bfloat16)
    with Watch() as w:
        aux.xent_grad_(logits, lse, target, dloss)
    syncs = {"nonzero", "item", "tolist", "masked_select", "__bool__", "any", "all"} & set(w.names)
    assert not syncs, f"host-synchronising calls in the xent_grad_ CPU path: {sorted(syncs)}"


def test_one_aux_launch_in_the_ledger():
    logits, lse, target, dloss = _case(8, 40, torch.bfloat16)
    with lowering("reference"), launch_ledger() as ledger:
        aux.xent_grad_(logits, lse, target, dloss)
    assert [(l.kind, l.name) for l in ledger] == [("aux", "xent_grad_")]


_INTERPRET = textwrap.dedent("""
    import torch
    from coda_agent.primitives.aux import _xent_grad_torch
    from coda_agent.primitives.xent_triton import xent_grad_triton
    g = torch.Generator().manual_seed(0)
    for dt, scale in ((torch.bfloat16, 3.0), (torch.float16, 3.0), (torch.bfloat16, 2.0 ** 17)):
        for rows, vocab in ((37, 300), (5, 5000), (3, 4099)):
            x = (torch.randn(rows, vocab, generator=g) * scale).to(dt)  # 2^17: past exp's range from lse
            lse = torch.logsumexp(x.float(), 1)
            t = torch.randint(0, vocab, (rows,), generator=g)
            t[0] = -100
            t[-1] = vocab + 2
            d = torch.randn(rows, generator=g)
            a = xent_grad_triton(x.clone(), lse, t, d)
            b = _xent_grad_torch(x.clone(), lse, t, d)
            assert a.dtype == dt and bool((a[0] == 0).all()) and bool(torch.isfinite(a).all())
            tol = dict(atol=1e-6, rtol=2 ** -7) if dt == torch.bfloat16 else dict(atol=1e-7, rtol=2e-3)
            torch.testing.assert_close(a.float(), b.float(), **tol)
    print("ok")
""")


@pytest.mark.slow
def test_triton_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _INTERPRET], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-4000:]


@pytest.mark.gpu
def test_triton_matches_torch_path_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits, lse, target, dloss = _case(1024, 5000, torch.bfloat16, device="cuda")
    target[::97] = -100
    got = aux.xent_grad_(logits.clone(), lse, target, dloss)  # CUDA: the Triton kernel
    want = aux._xent_grad_torch(logits.clone(), lse, target, dloss)
    torch.cuda.synchronize()
    # Both round one fp32 value to bf16; exp may differ in the last fp32 bits.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -7)
    assert torch.all(got[target == -100] == 0)
    # A row slice of a larger buffer (the lm_head chunk is a view) is written in place.
    big = torch.zeros(1100, 5000, dtype=torch.bfloat16, device="cuda")
    big[10:1034] = logits
    aux.xent_grad_(big[10:1034], lse, target, dloss)
    torch.cuda.synchronize()
    torch.testing.assert_close(big[10:1034].float(), want.float(), atol=1e-6, rtol=2 ** -7)
    assert torch.all(big[:10] == 0) and torch.all(big[1034:] == 0)
