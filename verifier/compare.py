"""Compare a program's tensors with the reference and say *where* they differ.

The rule is CODA's: max|out - ref_hi| <= factor * max|ref_lo - ref_hi| + floor,
where ref_hi is the reference with inputs upcast (fp64 on CPU, fp32 on GPU) and
ref_lo the reference in the inputs' dtype: the reference's own rounding noise
sets the bar.  Plus a scale-relative norm check ||out - ref_hi|| / ||ref_hi||
<= max(rel_norm, factor * ||ref_lo - ref_hi|| / ||ref_hi||), which catches a
wrong result hiding under a noisy max (on edge rows, where the reference
itself is noisier than rel_norm, its own noise sets this bar too).  And a
bias check: the mean signed error |mean(out - ref_hi)| may not exceed the
largest of factor * |mean(ref_lo - ref_hi)| (the reference's own bias),
BIAS_Z standard errors of the mean of the reference's noise and ``tol.bias`` *
rms(ref_hi), plus the floor: an offset of a fraction of the reference's error
passes the max rule on every element, but on a million elements it stands many
standard errors clear of rounding.  (A task may give the norm and bias rules a
factor of their own, ``norm_factor``: a gradient through a kink widens the max
rule alone, Tolerance says why.)  The standard error is the reference's own
(never the program's, which could widen it) and allows for rounding errors that
a whole row or column shares: the largest of rms / sqrt(n) and the spread of
the row means and of the column means over sqrt(rows) and sqrt(columns).  A
weight gradient dW = dY^T X shows why: one rounding of a row of dY moves a
whole row of dW, so its errors' mean averages over the rows, not the elements
(gpt2_block's dw_proj: 5x the independent-error estimate).

Both rules are per tensor, so where rows stand at very different scales (the
edge draw: norms from 2^-12 to 2^5 in one tensor) the largest, often the most
ill-conditioned, set the bar for all: a softmax row at 32 times its scale
rounds its logits by whole units, and its gradient's reference errs by percent
of the tensor's largest value, while a row at twice its scale that a program
leaves out (zero, or the gradient of a token it skips) errs by a few percent
of the same value and passes. So ``rows=True`` (a result of the edge draw's
rows, tokens: ``calls.edge_rows``; a weight gradient sums over them, and an
honest one errs by much of a row that nearly cancels) adds the whole-row rule:
a row of the last axis may not err by more than ROW_SHARE of its own norm
unless the reference's own noise on that row (second look included) reaches
``factor * SIGMAS`` of that error: a row lost whole fails it at every scale,
while rows whose reference is itself ill-conditioned (a cancellation:
gradients along the output, a token predicted at near certainty) pass on their
own noise.  (A result through a kink has neither that rule nor the dense rules on
the edge draw: ``calls.judged_by`` says why.)

A result whose max rule is widened (a kink's flips, ``factor: 1000``) keeps a typical-error rule
(:func:`_typical`): its median element's relative error within 4x the reference's.  A flip moves a
few elements; a value kept in fewer bits (fp8's, under a 6% norm rule) moves them all.

Where one element carries most of a tensor's noise (a weight gradient's
column fed by an outlier channel), the reference's error there is one sample,
and the max rule is a coin toss; a result that fails by the size of its
errors alone is judged again with more samples of that noise (:mod:`.noise`).
There the norm rule over a few elements (a scalar gradient) widens toward the max
rule's bar (:func:`few`): a norm of one sample is as noisy as the sample.

The pattern (odd columns, ragged last rows, NaN...) is the most useful thing in
the feedback: it points at the pairing, the masking or the unwritten tile.
"""

from __future__ import annotations

import torch

from coda_agent.tasks.spec import Tolerance
from coda_agent.verifier.noise import SIGMAS, Noise
from coda_agent.verifier.report import Mismatch

TILE = 128  # rows/columns past the last full tile of this size are the "ragged edge"
BIAS_Z = 8.0  # standard errors of the mean that rounding noise may reach
ROW_SHARE = 0.5  # the whole-row rule: a row may not err by half its own norm, its noise aside
# What no rule asks of an element beyond its own value's last bits: 2^-20 of it (16 fp32 ulps, a
# thousandth of a bf16 ulp).  The GPU's reference is fp32, so a result that the reference computes
# wholly in fp32 (HF's ``x.float()`` before a row statistic or a loss) shows no rounding noise of
# its own there, and two honest fp32 computations of one value differ in their last bits.
RESOLUTION = 2.0 ** -20
TYPICAL_FACTOR = 4.0  # the typical-error rule (_typical): 4x the reference's median error...
TYPICAL_SAMPLE = 1 << 20  # ...over at most this many elements, drawn at random


# The most elements a norm casts to fp64 at a time: 128 MiB beside the judge's set.
NORM_SLICE = 1 << 24


def norm64(t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The 2-norm of ``t`` (with ``rows``: of each of its rows of ``rows`` elements), summed in
    fp64 a slice at a time.  In fp32 the squares of values past about 1e17 overflow a large set's
    sum (an fp8 GEMM's operands over the format's range, times spread scales, make products of
    1e18: an honest program's relative error came out inf / inf), and an fp64 copy of the whole
    set would not fit beside it."""
    # split() gives an empty tensor one empty slice, so an empty t needs no case of its own
    if rows is None:
        parts = [torch.linalg.vector_norm(c, dtype=torch.float64) for c in t.reshape(-1).split(NORM_SLICE)]
        return torch.linalg.vector_norm(torch.stack(parts))
    return torch.cat([torch.linalg.vector_norm(c, dim=1, dtype=torch.float64)
                      for c in t.reshape(-1, rows).split(max(1, NORM_SLICE // max(rows, 1)))])


def few(n: int, noise: Noise | None) -> float:
    """How much wider the norm rule's bar stands over ``n`` elements on the second look: SIGMAS /
    sqrt(n), at least 1.  The norm of n samples of noise spreads like a chi with n degrees of freedom:
    over many elements ``dense_factor`` times the noise's RMS norm is a wide margin, over one it is
    two of its sigmas, which an honest scalar (a trained slope's gradient, a sum over every token)
    exceeds by chance.  Over one element the bar is then ``dense_factor * SIGMAS`` of its noise, the
    max rule's at the default factor: the norm of a few elements asks no more than the max rule asks
    of each.  The first look, one sample of that noise, keeps its bar (a result that fails it is
    looked at again)."""
    return max(1.0, SIGMAS / max(n, 1) ** 0.5) if noise is not None else 1.0


def compare(name: str, shape_set: str, out, hi: torch.Tensor, lo: torch.Tensor, tol: Tolerance,
            poisoned: bool = False, noise: Noise | None = None, rows: bool = False) -> Mismatch | None:
    """None when ``out`` passes; else a Mismatch saying where it differs.  ``noise``: more
    samples of the reference's own noise (:mod:`.noise`, the second look): each element may
    also err by ``factor * SIGMAS`` of its own noise RMS, and the norm and bias rules take the
    samples' largest.  ``rows``: the whole-row rule too (module docstring)."""
    if not isinstance(out, torch.Tensor):
        return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=float("inf"), allowed=0.0,
                        pattern=f"not a tensor ({type(out).__name__})")
    if tuple(out.shape) != tuple(hi.shape):
        return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=float("inf"), allowed=0.0,
                        pattern=f"shape {list(out.shape)}, expected {list(hi.shape)}")
    if not hi.is_floating_point():
        bad = out.to(hi.device) != hi
        if not bad.any():
            return None
        diff = (out.to(hi.device).double() - hi.double()).abs()
        return _mismatch(name, shape_set, diff, bad, torch.zeros_like(bad), 0.0, None, out)
    work = torch.float64 if hi.device.type == "cpu" else torch.float32
    o = out.detach().to(hi.device, work)
    h = hi.to(work)
    lo_err = (lo.to(h.device, work) - h).abs()
    lo_err = lo_err[torch.isfinite(lo_err)]
    allowed = tol.factor * (float(lo_err.max()) if lo_err.numel() else 0.0) + tol.floor
    diff = (o - h).abs()
    nan = torch.isnan(o) & ~torch.isnan(h)
    diff = torch.where(torch.isnan(h) & torch.isnan(o), torch.zeros_like(diff), diff)
    bar = allowed if noise is None else torch.clamp_min(tol.factor * SIGMAS * noise.rms.to(h.device, work),
                                                        allowed)
    bad = (diff > bar) | nan
    if bad.any():  # RESOLUTION, looked at only where the bar fails: no temporary of a whole large set
        at = (bad & ~nan).nonzero(as_tuple=True)
        within = diff[at] <= h[at].abs() * RESOLUTION
        bad[tuple(i[within] for i in at)] = False
    hnorm = max(float(norm64(torch.nan_to_num(h))), 1e-30)
    rel = float(norm64(torch.nan_to_num(diff, nan=0.0, posinf=0.0))) / hnorm
    rel_lo = max(float(norm64(lo_err)), noise.norm if noise else 0.0) / hnorm
    if nan.any():
        rel = float("nan")
    if bad.any() or not rel <= max(tol.rel_norm, tol.dense_factor * rel_lo * few(h.numel(), noise)):
        return _mismatch(name, shape_set, diff, bad, nan, allowed, rel, o, poisoned=poisoned, ref=h)
    lo = lo.to(h.device, work)
    del diff, bad, nan, bar  # the whole-row rule's temporaries take their place on a large GPU set
    if rows and (lost := _rows(name, shape_set, o, h, lo, tol, rel, noise)):
        return lost
    if tol.factor > TYPICAL_FACTOR and (coarse := _typical(name, shape_set, o, h, lo, rel, noise)):
        return coarse
    return _bias(name, shape_set, o, h, lo, tol, rel, noise)


def _typical(name: str, shape_set: str, o: torch.Tensor, h: torch.Tensor, lo: torch.Tensor,
             rel: float, noise: Noise | None) -> Mismatch | None:
    """The typical-error rule, for a result whose max rule is widened (a kink's flips): the median
    relative error of its elements (those above 2^-10 of its RMS, up to TYPICAL_SAMPLE of them
    drawn at random) may not exceed TYPICAL_FACTOR times the bf16 reference's own, plus
    RESOLUTION.  A flip moves few elements and leaves the median where the rounding put it; a
    value rounded to fewer bits (fp8's 4, where bf16 keeps 8) moves every element, and passed
    a max rule 1000 times the reference's and a 6% norm rule.  Where flips are most of the noise (a
    sum over a few tokens, each flip moving a whole row of it), one sample of the reference's flips
    is luck; the second look's samples (``noise``: each element's noise RMS over nudged draws) then
    set the reference's typical error."""
    rms = noise.rms.to(h.device, h.dtype).reshape(-1) if noise is not None else None
    h, o, lo = h.reshape(-1), o.reshape(-1), lo.reshape(-1)
    if h.numel() > TYPICAL_SAMPLE:
        pick = torch.randint(0, h.numel(), (TYPICAL_SAMPLE,), device=h.device)
        h, o, lo, rms = h[pick], o[pick], lo[pick], None if rms is None else rms[pick]
    mag = h.abs()
    finite = torch.isfinite(h) & torch.isfinite(lo) & torch.isfinite(o)
    keep = finite & (mag > 2.0 ** -10 * float(norm64(torch.where(finite, h, 0.0))) / max(h.numel(), 1) ** 0.5)
    if int(keep.sum()) < 64:  # too few for a median to say anything
        return None
    ours = float(((o - h).abs() / mag)[keep].median())
    theirs = float(((lo - h).abs() / mag)[keep].median())
    if rms is not None:
        theirs = max(theirs, float((rms / mag)[keep].median()))
    if ours <= TYPICAL_FACTOR * theirs + RESOLUTION:
        return None
    return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=ours,
                    allowed=TYPICAL_FACTOR * theirs + RESOLUTION, rel_norm_err=rel,
                    pattern=f"the typical element errs by {ours:.3g} of its value, where the reference's own "
                            f"rounding errs by {theirs:.3g} (the median over elements; the error and its bar "
                            "below are these): computed in a lower precision than the task's, a value rounded "
                            "to fewer bits somewhere (an intermediate kept in 8 bits, a truncated product)")


def _rows(name: str, shape_set: str, o: torch.Tensor, h: torch.Tensor, lo: torch.Tensor, tol: Tolerance,
          rel: float, noise: Noise | None) -> Mismatch | None:
    """The whole-row rule (module docstring): each row of the last axis against its own norm and
    its own noise; a tensor of one axis or of one column has no rows to judge."""
    if h.dim() < 2 or h.shape[-1] < 2 or h.numel() == 0:
        return None
    cols = h.shape[-1]
    infinite = ~(torch.isfinite(h) & torch.isfinite(lo))

    def row_norms(t: torch.Tensor) -> torch.Tensor:  # t is a temporary: masked in place, one at a time
        return norm64(t.masked_fill_(infinite, 0.0), rows=cols)

    err, own, ref_noise = row_norms(o - h), row_norms(h.clone()), row_norms(lo - h)
    del infinite
    if noise is not None:
        sampled = norm64(noise.rms.to(h.device, h.dtype), rows=cols)
        ref_noise = torch.maximum(ref_noise, sampled)
    # the floor in norm, and a row of exact zeros may hold what fp32 leaves of a cancellation
    floor = tol.floor * cols ** 0.5 + 2.0 ** -20 * float(own.max())
    bar = torch.maximum(ROW_SHARE * own, tol.dense_factor * SIGMAS * ref_noise) + floor
    lost = err > bar
    if not lost.any():
        return None
    worst = int(torch.argmax(torch.where(lost, err / bar, 0.0)))
    count = int(lost.sum())
    return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=float(err[worst]), allowed=float(bar[worst]),
                    rel_norm_err=rel,
                    worst_index=[int(i) for i in torch.unravel_index(torch.tensor(worst), h.shape[:-1])],
                    pattern=f"{count} row{'s' if count > 1 else ''} of {own.shape[0]} wrong as a whole (the error "
                            f"and its bar below are row norms): row {worst} errs by {float(err[worst]):.3g} where "
                            f"its own norm is {float(own[worst]):.3g} and the reference's noise there "
                            f"{float(ref_noise[worst]):.3g}; a row left out, flushed or computed from other values, "
                            "hidden under the bar that the largest rows set")


def mean_noise(e: torch.Tensor, n: int) -> float:
    """The standard error of the mean of rounding errors ``e`` (n of them finite, the rest
    zero): independent errors give rms / sqrt(n); errors a row (or column) shares make the
    row (column) means spread more, and their spread over sqrt(rows) is the larger one."""
    se = float(norm64(e)) / n ** 0.5 / n ** 0.5
    if e.dim() >= 2 and e.shape[-1] > 1 and e.numel() // e.shape[-1] > 1:
        grid = e.reshape(-1, e.shape[-1])
        for axis in (0, 1):
            means = grid.mean(dim=1 - axis)
            se = max(se, float(means.std()) / means.numel() ** 0.5)
    return se


def _bias(name: str, shape_set: str, o: torch.Tensor, h: torch.Tensor, lo: torch.Tensor, tol: Tolerance,
          rel: float, noise: Noise | None = None) -> Mismatch | None:
    finite = torch.isfinite(h) & torch.isfinite(lo)
    n = int(finite.sum())
    if n == 0:
        return None
    zero = torch.zeros((), dtype=h.dtype, device=h.device)
    err = torch.where(finite, o - h, zero)
    ref_err = torch.where(finite, lo - h, zero)
    mean = float(err.sum()) / n
    scale = float(norm64(torch.where(finite, h, zero))) / n ** 0.5
    ref_mean, ref_se = abs(float(ref_err.sum()) / n), mean_noise(ref_err, n)
    if noise is not None:
        ref_mean, ref_se = max(ref_mean, noise.mean), max(ref_se, noise.se)
    allowed = max(tol.dense_factor * ref_mean, BIAS_Z * ref_se, tol.bias * scale) + tol.floor
    if abs(mean) <= allowed:
        return None
    return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=float(err.abs().max()), allowed=allowed,
                    rel_norm_err=rel, pattern=f"systematic bias: mean signed error {mean:.3g} over {n} "
                                              f"elements (allowed {allowed:.3g}): the errors lean one "
                                              "way, an offset or a rounding that goes one way more often "
                                              "than the other")


def _mismatch(name, shape_set, diff, bad, nan, allowed, rel, out, poisoned=False, ref=None) -> Mismatch:
    finite = torch.nan_to_num(diff, nan=float("inf"))
    flat = int(torch.argmax(torch.where(bad, finite, torch.zeros_like(finite)) if bad.any() else finite))
    worst = [int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)] if diff.ndim else []
    max_err = float(finite.max()) if finite.numel() else 0.0
    nan_count = int(nan.sum())
    return Mismatch(tensor=name, shape_set=shape_set, max_abs_err=max_err, allowed=allowed,
                    rel_norm_err=rel, nan_count=0 if poisoned else nan_count,
                    unwritten_count=nan_count if poisoned else 0, worst_index=worst,
                    pattern=pattern_of(bad, nan, out, ref, poisoned))


def pattern_of(bad: torch.Tensor, nan: torch.Tensor, out: torch.Tensor, ref: torch.Tensor | None,
               poisoned: bool) -> str:
    """A short phrase for where the errors are."""
    if bad.numel() == 0:
        return "empty"
    if nan.any():
        where = pattern_of(nan, torch.zeros_like(nan), out, None, False)
        if poisoned:
            return f"unwritten (NaN poison survived): {where}"
        return (f"NaN: {where} (where the reference has numbers: a buffer read after it went to a call's "
                "`out=`, which holds NaN once that call returns; or math outside its domain, 0/0, log or "
                "sqrt of a negative)")
    if ref is not None and out.is_floating_point():
        finite = out[torch.isfinite(out)]
        if finite.numel() == out.numel() and bool((finite == finite.flatten()[0]).all()) \
                and float(ref.max() - ref.min()) > 0:
            v = float(finite.flatten()[0])
            return "all zeros" if v == 0 else f"constant ({v:g}) where the reference varies"
    if not bad.any():
        return "every element within the limit, but together too far off (the relative norm error)"
    b = bad.reshape(-1, bad.shape[-1]) if bad.ndim >= 2 else bad.reshape(-1, 1)  # a vector: one value per row
    rows, cols = b.shape
    frac = float(b.float().mean())
    bad_rows = b.any(1).nonzero().flatten()
    bad_cols = b.any(0).nonzero().flatten()
    parts = []
    if cols > 1 and not b[:, 0::2].any():
        parts.append("odd columns")
    elif cols > 1 and not b[:, 1::2].any():
        parts.append("even columns")
    edge_r = rows - (rows % TILE or min(TILE, rows))
    edge_c = cols - (cols % TILE or min(TILE, cols))
    if rows > 1 and int(bad_rows.min()) >= edge_r > 0:
        parts.append("last rows (ragged edge)" if rows % TILE else "last rows")
    if cols > 1 and int(bad_cols.min()) >= edge_c > 0:
        parts.append("last columns (ragged edge)" if cols % TILE else "last columns")
    if not parts:
        if frac > 0.5:
            return "all" if frac > 0.9 else f"most elements ({frac:.0%})"
        if len(bad_rows) <= 4:
            return f"rows {bad_rows.tolist()}"
        if len(bad_cols) <= 4 and cols > 1:
            return f"columns {bad_cols.tolist()}"
        return f"scattered ({frac:.1%} of elements)"
    return ", ".join(parts) + f" ({frac:.1%} of elements)"
