"""The drop-ins' bar against HF (coda_agent.kernels.like_hf): what passes, what misses and by how far."""

from __future__ import annotations

import torch

from coda_agent.kernels import like_hf


def _three(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    hi = {"w": torch.randn(64, 32, generator=g), "loss": torch.tensor(3.0)}
    lo = {k: v.bfloat16().float() for k, v in hi.items()}  # HF's bf16 error: one rounding
    return hi, lo


def test_a_result_within_hfs_rounding_passes_and_a_wrong_one_misses_by_far():
    hi, lo = _three()
    assert like_hf.misses(dict(lo), hi, lo) == []
    permuted = {**lo, "w": lo["w"].flip(0)}
    [(key, ratio)] = like_hf.misses(permuted, hi, lo)
    assert key == "w" and ratio > 50


def test_the_norm_rule_catches_what_the_max_rule_lets_through():
    hi, lo = _three()
    noise = (lo["w"] - hi["w"]).abs().max()
    drift = {**lo, "w": hi["w"] + 1.9 * noise * torch.sign(torch.randn_like(hi["w"]))}  # max rule: 0.95
    [(key, ratio)] = like_hf.misses(drift, hi, lo)
    assert key == "w" and ratio > 1
    assert like_hf.misses(drift, hi, lo, few=64 * 32 + 1) == []  # too few elements for the norm rule


def test_absent_misshapen_and_nonfinite_results_miss_by_infinity():
    hi, lo = _three()
    assert like_hf.misses({"loss": lo["loss"]}, hi, lo) == [("w", float("inf"))]
    assert like_hf.misses({**lo, "w": lo["w"].T}, hi, lo) == [("w", float("inf"))]
    nan = lo["w"].clone()
    nan[3, 4] = float("nan")
    assert like_hf.misses({**lo, "w": nan}, hi, lo) == [("w", float("inf"))]


def test_an_overflowed_truth_misses_unless_it_is_left_unjudged():
    hi, lo = _three()
    hi["w"][0, 0] = float("inf")
    assert like_hf.misses(dict(lo), hi, lo) == [("w", float("inf"))]
    assert like_hf.misses(dict(lo), hi, lo, overflowed_truth_unjudged=True) == []
