"""The reference lowering: a PyTorch interpreter of epilogue programs.

It gives the same answers as the GPU lowering up to fp32 rounding, on any
device, so the verifier's first verdict (and CI) needs no GPU:

- the accumulator is the fp32 product ``A.float() @ B.float()`` (the kernel
  accumulates in fp32 too; summation order differs);
- the fn is called *once* on whole fp32 tensors instead of once per element:
  ``acc`` is (M, N), a RowVec is (1, N), a ColVec is (M, 1), a Tile is (M, N);
- pairs are adjacent columns: ``Pair(x[:, 0::2], x[:, 1::2])``; a paired D is
  interleaved back;
- every stored output is rounded to its dtype once, from fp32;
- reductions are exact over the real (M, N) extent, which is what the kernel's
  ragged-edge masking computes; ``col_sum(partials=True)`` splits columns into
  the kernel's N tiles (``config.tile_n`` accumulator columns each);
- ``select_col`` leaves rows whose target is outside [0, N) at 0.0, exactly as
  the GPU lowering (which pre-fills the buffer).
"""

from __future__ import annotations

from typing import Any

import torch
from quack.epilogue.math import Pair

from .epilogue import Epilogue
from .errors import CatalogueError


def _lanes(x: torch.Tensor) -> Pair:
    return Pair(x[..., 0::2], x[..., 1::2])


def _interleave(p: Pair, like: torch.Tensor | None = None) -> torch.Tensor:
    a, b = (torch.as_tensor(v, dtype=torch.float32) for v in p)
    if like is not None:
        a, b = a.expand_as(like), b.expand_as(like)
    return torch.stack(torch.broadcast_tensors(a, b), dim=-1).flatten(-2)


def fn_arguments(epi: Epilogue, acc: torch.Tensor, operands: dict[str, Any]) -> dict[str, Any]:
    """The fn's keyword arguments for a whole-tile call (acc is the fp32 (M, N) product)."""
    acc_pairs = epi.pairs == "acc"
    args: dict[str, Any] = {"acc": _lanes(acc) if acc_pairs else acc}
    for name, kind in epi.operands.items():
        v = operands[name]
        if kind.port == "head":
            r = head_rstd_values(acc, v, epi.head_stats[name].eps).repeat_interleave(v, dim=1)
            args[name] = _lanes(r) if acc_pairs else r
            continue
        if kind.port == "scalar":
            args[name] = float(v)
            continue
        v = v.float()
        if kind.port == "row":
            v = v.reshape(1, -1)
        elif kind.port == "col":
            v = v.reshape(-1, 1)
        if kind.port == "paired" or (acc_pairs and kind.port in ("row", "tile")):
            v = _lanes(v)
        args[name] = v
    return args


def head_rstd_values(acc: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """(M, N / head_dim) inverse RMS of each row's heads, from the raw accumulator."""
    m, n = acc.shape
    return torch.rsqrt(acc.view(m, n // head_dim, head_dim).pow(2).mean(-1) + eps)


def _fold(red_name: str, red: Any, values: Any, m: int, n_pairs: int, tile_n: int) -> torch.Tensor:
    if isinstance(values, Pair):
        a, b = (torch.as_tensor(v, dtype=torch.float32).expand(m, n_pairs) for v in values)
        values = a + b if red.combine == "add" else torch.maximum(a, b)
    vals = torch.as_tensor(values, dtype=torch.float32)
    if red.axis == "rows":
        return vals.expand(m, n_pairs).sum(dim=0)
    vals = vals.expand(m, n_pairs)
    if red.combine == "add":
        if red.partials:
            tiles = -(-n_pairs // tile_n)
            padded = torch.zeros(m, tiles * tile_n, dtype=vals.dtype, device=vals.device)
            padded[:, :n_pairs] = vals
            return padded.view(m, tiles, tile_n).sum(dim=-1)
        return vals.sum(dim=1)
    if red.combine == "max":
        return vals.amax(dim=1)
    if red.combine == "lse":
        return torch.logsumexp(vals, dim=1)
    raise AssertionError(red_name)


def run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
        out_dtype: torch.dtype, tile_n: int, accumulate_into: torch.Tensor | None) -> dict[str, torch.Tensor]:
    acc = A.float() @ B.float()
    m, n = acc.shape
    if epi is None:
        result: dict[str, Any] = {"D": acc}
    else:
        result = epi.fn(**fn_arguments(epi, acc, operands))
        if not isinstance(result, dict):
            raise CatalogueError(f"epilogue {epi.name!r} must return a dict", line=epi.line)
    out: dict[str, torch.Tensor] = {}
    width = n // 2 if epi is not None and epi.pairs == "acc" else n
    if "D" in result:
        d = result["D"]
        if isinstance(d, Pair):
            d = _interleave(d)
        d = torch.as_tensor(d, dtype=torch.float32)
        d_shape = (m, 2 * n) if epi is not None and epi.pairs not in (None, "acc") else (m, n)
        d = d.expand(d_shape)
        if accumulate_into is not None:
            # Matches the TMA reduce-add store: the fp32 result is rounded, then added in place.
            accumulate_into.add_(d.to(accumulate_into.dtype))
            out["D"] = accumulate_into
        else:
            out["D"] = d.to(out_dtype)
    if epi is None:
        return out
    for name, stat in epi.head_stats.items():
        if stat.save:
            out[name] = head_rstd_values(acc, operands[name], stat.eps)
    for name, dtype in epi.outputs.items():
        v = result[name]
        if isinstance(v, Pair):
            v = _interleave(v)
        out[name] = torch.as_tensor(v, dtype=torch.float32).expand(m, width if not isinstance(
            result[name], Pair) else 2 * width).to(dtype).contiguous()
    for name, red in epi.reductions.items():
        if red.combine == "select":
            idx = operands[red.index].long()
            vals = torch.as_tensor(result[name], dtype=torch.float32).expand(m, n)
            ok = (idx >= 0) & (idx < n)
            picked = vals.gather(1, idx.clamp(0, n - 1).view(-1, 1)).view(-1)
            out[name] = torch.where(ok, picked, torch.zeros_like(picked))
        else:
            out[name] = _fold(name, red, result[name], m, width, tile_n)
    return out
