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

from .epilogue import Epilogue
from .errors import CatalogueError
from .fp8 import store
from .pair import Pair


def _interleave(p: Pair) -> torch.Tensor:
    """A Pair of column lanes back as one tensor, columns (a0, b0, a1, b1, ...)."""
    a, b = (torch.as_tensor(v, dtype=torch.float32) for v in p)
    return torch.stack(torch.broadcast_tensors(a, b), dim=-1).flatten(-2)


def _fp32(value: Any) -> torch.Tensor:
    return torch.as_tensor(_interleave(value) if isinstance(value, Pair) else value, dtype=torch.float32)


def run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
        out_dtype: torch.dtype, tile_n: int, accumulate_into: torch.Tensor | None) -> dict[str, torch.Tensor]:
    acc = A.float() @ B.float()
    m, n = acc.shape
    if epi is None:
        result: dict[str, Any] = {"D": acc}
    else:
        result = epi.fn(**epi.tile_arguments(acc, operands))
        if not isinstance(result, dict):
            raise CatalogueError(f"epilogue {epi.name!r} must return a dict", line=epi.line)
    out: dict[str, torch.Tensor] = {}
    if "D" in result:
        d = _fp32(result["D"]).expand(epi.d_shape(m, n) if epi is not None else (m, n))
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
            out[name] = stat.values(acc, operands[name])
    width = epi.output_width(n)
    for name, dtype in epi.outputs.items():
        v = result[name]
        # A Pair output holds both lanes of each pair: twice the width of a per-pair value.
        shape = (m, 2 * width if isinstance(v, Pair) else width)
        out[name] = store(_fp32(v).expand(shape), dtype).contiguous()
    for name, red in epi.reductions.items():
        v = result[name]
        if isinstance(v, Pair):
            v = red.fold_lanes(*(torch.as_tensor(lane, dtype=torch.float32).expand(m, width) for lane in v))
        out[name] = red.fold(torch.as_tensor(v, dtype=torch.float32).expand(m, width), operands, tile_n)
    return out
