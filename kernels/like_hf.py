"""The bar a patched model's results are held to against Hugging Face's own: the drop-in tests
(tests/test_llama.py and the families' tests) and the sweep over every transformers causal LM
(bench/hf_sweep.py) use this one definition.

Truth is the unpatched model in fp32 (``hi``); HF's own bf16 model (``lo``) sets the noise floor.
A tensor passes where its largest error is within ``err_factor`` times HF's bf16 error plus 1/256
of the truth's largest value (about one bf16 rounding step at that scale, so that a result right
to bf16 precision does not fail because HF's own bf16 result was luckily close), and its relative
norm error within ``rel_factor`` times HF's plus 1e-3.  A kernel wired wrong (a permutation, a
missing residual, a wrong mean) misses by orders of magnitude.
"""

from __future__ import annotations

import torch

ERR_FACTOR, REL_FACTOR = 2.0, 1.5


def misses(got: dict, hi: dict, lo: dict, *, err_factor: float = ERR_FACTOR, rel_factor: float = REL_FACTOR,
           few: int = 0, overflowed_truth_unjudged: bool = False) -> list[tuple[str, float]]:
    """[(key, how far past the bar)] for each tensor of ``hi`` that ``got`` misses, worst first.

    A tensor absent from ``got``, of another shape or not finite misses by infinity.  The norm rule
    skips tensors of fewer than ``few`` elements, whose norm is a few numbers' max rule.  A truth
    that is not finite (an fp32 model that overflows itself) misses by infinity too, unless
    ``overflowed_truth_unjudged``: then there is nothing to judge the tensor by and it is left out.
    """
    out = []
    for k in hi:
        g = got.get(k)
        if g is None or g.shape != hi[k].shape:
            out.append((k, float("inf")))
            continue
        g, h, l_ = g.float(), hi[k].float(), lo[k].float()
        if not torch.isfinite(h).all():
            if not overflowed_truth_unjudged:
                out.append((k, float("inf")))
            continue
        if not torch.isfinite(g).all():
            out.append((k, float("inf")))
            continue
        err, noise = (g - h).abs().max().item(), (l_ - h).abs().max().item()
        ratio = err / (err_factor * noise + h.abs().max().item() / 256 + 1e-30)
        norm = h.norm().item()
        if h.numel() >= few and norm > 0:
            rel, rel_lo = (g - h).norm().item() / norm, (l_ - h).norm().item() / norm
            ratio = max(ratio, rel / (rel_factor * rel_lo + 1e-3))
        if ratio > 1:
            out.append((k, ratio))
    return sorted(out, key=lambda kv: -kv[1])
