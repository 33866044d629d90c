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
- reductions fold the real (M, N) extent: what the kernel computes when the fn
  returns 0 in a ragged tile's padded lanes, which ``padded_lanes`` (below)
  checks; ``col_sum(partials=True)`` splits columns into
  the kernel's N tiles (``config.tile_n`` accumulator columns each);
- ``select_col`` leaves rows whose target is outside [0, N) at 0.0, exactly as
  the GPU lowering (which pre-fills the buffer);
- inside :func:`.lowering.padded_lanes` it runs the fn over whole tiles of the
  call's tile configuration instead, with what the kernel holds past a ragged
  edge (zeros for the accumulator and Tiles, stale values for vectors) and the
  sums folding every lane, so a fold that depends on padded lanes shows on
  the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from .epilogue import Epilogue
from .errors import CatalogueError
from .fp8 import store
from .lowering import padding_lanes
from .pair import Pair


def _interleave(p: Pair) -> torch.Tensor:
    """A Pair of column lanes back as one tensor, columns (a0, b0, a1, b1, ...)."""
    a, b = (torch.as_tensor(v, dtype=torch.float32) for v in p)
    return torch.stack(torch.broadcast_tensors(a, b), dim=-1).flatten(-2)


def _fp32(value: Any) -> torch.Tensor:
    return torch.as_tensor(_interleave(value) if isinstance(value, Pair) else value, dtype=torch.float32)


def _whole_tiles(size: int, tile: int) -> int:
    return -(-size // tile) * tile


def run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
        out_dtype: torch.dtype, tile_m: int, tile_n: int,
        accumulate_into: torch.Tensor | None) -> dict[str, torch.Tensor]:
    acc = A.float() @ B.float()
    m, n = acc.shape
    if epi is None:
        result: dict[str, Any] = {"D": acc}
        mp, np_, seen = m, n, operands
    else:
        # Whole tiles in padded_lanes mode (see lowering.padded_lanes); else the real extent.
        mp, np_ = (_whole_tiles(m, tile_m), _whole_tiles(n, tile_n)) if padding_lanes() else (m, n)
        seen = operands
        if (mp, np_) != (m, n):
            seen = {name: kind.padded(operands[name], mp, np_) for name, kind in epi.operands.items()}
            seen.update({idx: operands[idx] for idx in epi.index_operands})
            acc = torch.nn.functional.pad(acc, (0, np_ - n, 0, mp - m))
        result = epi.fn(**epi.tile_arguments(acc, seen))
        if not isinstance(result, dict):
            raise CatalogueError(f"epilogue {epi.name!r} must return a dict", line=epi.line)
    out: dict[str, torch.Tensor] = {}
    if "D" in result:
        rows, cols = epi.d_shape(m, n) if epi is not None else (m, n)
        d = _fp32(result["D"]).expand(epi.d_shape(mp, np_) if epi is not None else (m, n))[:rows, :cols]
        if accumulate_into is not None:
            # Matches the TMA reduce-add store: the fp32 result is rounded, then added in place.
            accumulate_into.add_(d.to(accumulate_into.dtype))
            out["D"] = accumulate_into
        else:
            out["D"] = store(d, out_dtype)
    if epi is None:
        return out
    for name, stat in epi.head_stats.items():
        if stat.save:
            out[name] = stat.values(acc, operands[name])[:m, :n // operands[name]]
    width, padded_width = epi.output_width(n), epi.output_width(np_)
    for name, dtype in epi.outputs.items():
        v = result[name]
        # A Pair output holds both lanes of each pair: twice the width of a per-pair value.
        lanes = 2 if isinstance(v, Pair) else 1
        out[name] = store(_fp32(v).expand(mp, lanes * padded_width)[:m, :lanes * width], dtype).contiguous()
    for name, red in epi.reductions.items():
        v = result[name]
        if isinstance(v, Pair):
            v = red.fold_lanes(*(torch.as_tensor(lane, dtype=torch.float32).expand(mp, padded_width) for lane in v))
        v = torch.as_tensor(v, dtype=torch.float32).expand(mp, padded_width)
        if red.folds_padded_lanes:
            out[name] = red.trim(red.fold(v, seen, tile_n), m, width)
        else:  # the kernel masks padded lanes of a max, an LSE or a select
            out[name] = red.fold(v[:m, :width], operands, tile_n)
    return out
