"""``quantize_rows``: the cast to fp8 for what no epilogue writes (an auxiliary
kernel; the numerics and where it is needed are in :mod:`.fp8`).

One catalogue call: on CPU tensors plain PyTorch, on CUDA tensors two Triton
kernels (:mod:`.quantize_triton`, imported lazily so that CPU runs never load
Triton) with the same math: current row-wise scales, powers of two, saturating.
Like every aux kernel it is a custom op, ``coda::quantize_rows`` (:mod:`.aux`),
whose fake gives the shapes (the Triton path cannot run on fake tensors).
"""

from __future__ import annotations

import torch

from .aux import aux_kernel, need
from .errors import CatalogueError
from .fp8 import FP8_DTYPES, saturate, scale_from_amax


def _quantize_shapes(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None,
                     col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's fake: what quantize_rows returns, shapes and dtypes only."""
    return (torch.empty(x.shape, dtype=FP8_DTYPES[dtype], device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))


@aux_kernel("quantize_rows", fake=_quantize_shapes)
def _quantize_rows(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None,
                   col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    fp8 = FP8_DTYPES[dtype]
    if x.is_cuda:
        from .quantize_triton import quantize_rows_triton  # lazy: CPU runs never import Triton

        out = quantize_rows_triton(x, fp8, row_scale, col_scale)
        return out["q"], out["scale"]
    v = x.float()
    if row_scale is not None:
        v = v * row_scale.float()[:, None]
    if col_scale is not None:
        v = v * col_scale.float()[None, :]
    scale = scale_from_amax(v.abs().amax(dim=1), fp8)
    return saturate(v / scale[:, None], fp8).contiguous(), scale


def quantize_rows(x: torch.Tensor, dtype: str = "fp8_e4m3", row_scale: torch.Tensor | None = None,
                  col_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Current row-wise fp8 quantization: ``{"q": (R, C) fp8, "scale": (R,) fp32}``.

    ``x`` is any 2-D tensor or view: ``quantize_rows(x.t())`` quantizes x's
    columns and writes them as the rows of a contiguous transposed copy (the
    K-major operand of a weight-gradient GEMM).  ``v = x * row_scale[:, None] *
    col_scale[None, :]`` (each optional, fp32; e.g. dequantize an fp8 ``x`` with
    its scale, or fold a norm weight into a weight) is quantized per row:
    ``scale`` is a power of two (:func:`scale_from_amax`) and ``q = sat(v /
    scale)``, so ``v ~= q * scale[:, None]``; in a GEMM ``scale`` is a ColVec for
    an A operand and a RowVec for a B = ``q.t()`` operand."""
    need("x", x, 2)
    if dtype not in FP8_DTYPES:
        raise CatalogueError(f"quantize_rows: dtype {dtype!r} is not one of {sorted(FP8_DTYPES)}")
    for name, v, n in (("row_scale", row_scale, x.shape[0]), ("col_scale", col_scale, x.shape[1])):
        if v is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != (n,)):
            raise CatalogueError(f"quantize_rows: {name} must be a tensor of shape ({n},); got "
                                 f"{tuple(getattr(v, 'shape', ())) or type(v).__name__}")
    q, scale = _quantize_rows(x, dtype, row_scale, col_scale)
    return {"q": q, "scale": scale}
