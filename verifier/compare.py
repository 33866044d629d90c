"""Compare a program's tensors with the reference and say *where* they differ.

The rule is CODA's: max|out - ref_hi| <= factor * max|ref_lo - ref_hi| + floor,
where ref_hi is the reference with inputs upcast (fp64 on CPU, fp32 on GPU) and
ref_lo the reference in the inputs' dtype: the reference's own rounding noise
sets the bar.  Plus a scale-relative norm check ||out - ref_hi|| / ||ref_hi||
<= rel_norm, which catches a wrong result hiding under a noisy max.

The pattern (odd columns, ragged last rows, NaN...) is the most useful thing in
the feedback: it points at the pairing, the masking or the unwritten tile.
"""

from __future__ import annotations

import torch

from coda_agent.tasks.spec import Tolerance
from coda_agent.verifier.report import Mismatch

TILE = 128  # rows/columns past the last full tile of this size are the "ragged edge"


def compare(name: str, shape_set: str, out, hi: torch.Tensor, lo: torch.Tensor, tol: Tolerance,
            poisoned: bool = False) -> Mismatch | None:
    """None when ``out`` passes; else a Mismatch saying where it differs."""
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
    bad = (diff > allowed) | nan
    hnorm = float(torch.linalg.vector_norm(torch.nan_to_num(h)))
    rel = float(torch.linalg.vector_norm(torch.nan_to_num(diff, nan=0.0, posinf=0.0))) / max(hnorm, 1e-30)
    if nan.any():
        rel = float("nan")
    if not bad.any() and rel <= tol.rel_norm:
        return None
    return _mismatch(name, shape_set, diff, bad, nan, allowed, rel, o, poisoned=poisoned, ref=h)


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
        what = "unwritten (NaN poison survived)" if poisoned else "NaN"
        return f"{what}: {where}"
    if ref is not None and out.is_floating_point():
        finite = out[torch.isfinite(out)]
        if finite.numel() == out.numel() and bool((finite == finite.flatten()[0]).all()) \
                and float(ref.max() - ref.min()) > 0:
            v = float(finite.flatten()[0])
            return "all zeros" if v == 0 else f"constant ({v:g}) where the reference varies"
    b = bad.reshape(-1, bad.shape[-1]) if bad.ndim >= 2 else bad.reshape(1, -1)
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
        if len(bad_cols) <= 4:
            return f"columns {bad_cols.tolist()}"
        return f"scattered ({frac:.1%} of elements)"
    return ", ".join(parts) + f" ({frac:.1%} of elements)"
