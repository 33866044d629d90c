"""``quantize_rows`` and ``quantize_both``: the casts to fp8 for what no
epilogue writes (auxiliary kernels; the numerics and where they are needed are
in :mod:`.fp8`).

``quantize_rows`` quantizes along one axis.  A tensor that feeds two GEMMs
along different axes (a gradient: its input-gradient GEMM contracts over the
features, its weight-gradient GEMM over the tokens) needs both copies, and
``quantize_both`` writes them from two reads of the tensor, where two
``quantize_rows`` read it four times; the values and scales are the same bits.

Each is one catalogue call: on CPU tensors plain PyTorch, on CUDA tensors two
Triton kernels (:mod:`.quantize_triton`, imported lazily so that CPU runs never
load Triton) with the same math: current scales, powers of two, saturating.
Like every aux kernel each is a custom op, ``coda::quantize_rows`` and
``coda::quantize_both`` (:mod:`.aux`), whose fake gives the shapes (the Triton
path cannot run on fake tensors).
"""

from __future__ import annotations

import torch

from .aux import aux_kernel, need
from .errors import CatalogueError
from .fp8 import FP8_DTYPES, saturate, scale_from_amax


def _check(x: torch.Tensor, dtype: str, call: str) -> None:
    """A cast's arguments: a 2-D tensor and an fp8 format's name."""
    need("x", x, 2)
    if dtype not in FP8_DTYPES:
        raise CatalogueError(f"{call}: dtype {dtype!r} is not one of {sorted(FP8_DTYPES)}")


def _check_scales(call: str, x: torch.Tensor, **scales: torch.Tensor | None) -> None:
    """Each given vector lies along its axis of x: ``row_scale``/``row_amax`` (R,), ``col_scale``/``col_amax``
    (C,)."""
    for name, v in scales.items():
        n = x.shape[0 if name.startswith("row_") else 1]
        if v is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != (n,)):
            raise CatalogueError(f"{call}: {name} must be a tensor of shape ({n},); got "
                                 f"{tuple(getattr(v, 'shape', ())) or type(v).__name__}")


def _scaled(x: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * row_scale[:, None] * col_scale[None, :]`` in fp32 (each optional): what the CPU path quantizes."""
    v = x.float()
    if row_scale is not None:
        v = v * row_scale.float()[:, None]
    if col_scale is not None:
        v = v * col_scale.float()[None, :]
    return v


def _quantize_shapes(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None,
                     col_scale: torch.Tensor | None, row_amax: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's fake: what quantize_rows returns, shapes and dtypes only."""
    return (torch.empty(x.shape, dtype=FP8_DTYPES[dtype], device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))


@aux_kernel("quantize_rows", fake=_quantize_shapes)
def _quantize_rows(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None,
                   col_scale: torch.Tensor | None, row_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    fp8 = FP8_DTYPES[dtype]
    if x.is_cuda:
        from .quantize_triton import quantize_rows_triton  # lazy: CPU runs never import Triton

        out = quantize_rows_triton(x, fp8, row_scale, col_scale, row_amax)
        return out["q"], out["scale"]
    return _per_row(_scaled(x, row_scale, col_scale), fp8, row_amax)


def _per_row(v: torch.Tensor, fp8: torch.dtype, amax: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``v`` quantized per row: (contiguous fp8 values, power-of-two scales), from the
    rows' amaxes (``amax`` where given)."""
    scale = scale_from_amax(v.abs().amax(dim=1) if amax is None else amax, fp8)
    return saturate(v / scale[:, None], fp8).contiguous(), scale


def quantize_rows(x: torch.Tensor, dtype: str = "fp8_e4m3", row_scale: torch.Tensor | None = None,
                  col_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
    """Current row-wise fp8 quantization: ``{"q": (R, C) fp8, "scale": (R,) fp32}``.

    ``x`` is any 2-D tensor or view: ``quantize_rows(x.t())`` quantizes x's
    columns and writes them as the rows of a contiguous transposed copy (the
    K-major operand of a weight-gradient GEMM).  ``v = x * row_scale[:, None] *
    col_scale[None, :]`` (each optional, fp32; e.g. dequantize an fp8 ``x`` with
    its scale, or fold a norm weight into a weight) is quantized per row:
    ``scale`` is a power of two (:func:`scale_from_amax`) and ``q = sat(v /
    scale)``, so ``v ~= q * scale[:, None]``; in a GEMM ``scale`` is a ColVec for
    an A operand and a RowVec for a B = ``q.t()`` operand.  ``row_amax`` (R,): each
    row's largest ``|v|`` as the epilogue that wrote x reduced it (``col_amax()``), so
    the cast reads x once (see :func:`quantize_both`)."""
    _check(x, dtype, "quantize_rows")
    _check_scales("quantize_rows", x, row_scale=row_scale, col_scale=col_scale, row_amax=row_amax)
    q, scale = _quantize_rows(x, dtype, row_scale, col_scale, row_amax)
    return {"q": q, "scale": scale}


def _quantize_both_shapes(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None,
                          row_amax: torch.Tensor | None, col_amax: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The op's fake: what quantize_both returns, shapes and dtypes only."""
    rows, cols = x.shape
    fp8 = FP8_DTYPES[dtype]
    dev = x.device
    return (torch.empty(rows, cols, dtype=fp8, device=dev), torch.empty(rows, dtype=torch.float32, device=dev),
            torch.empty(cols, rows, dtype=fp8, device=dev), torch.empty(cols, dtype=torch.float32, device=dev))


@aux_kernel("quantize_both", fake=_quantize_both_shapes)
def _quantize_both(x: torch.Tensor, dtype: str, row_scale: torch.Tensor | None, row_amax: torch.Tensor | None,
                   col_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fp8 = FP8_DTYPES[dtype]
    if x.is_cuda:
        from .quantize_triton import quantize_both_triton  # lazy: CPU runs never import Triton

        out = quantize_both_triton(x, fp8, row_scale, row_amax, col_amax)
        return out["q"], out["scale"], out["qt"], out["scale_t"]
    v = _scaled(x, row_scale)
    q, scale = _per_row(v, fp8, row_amax)
    qt, scale_t = _per_row(v.t(), fp8, col_amax)
    return q, scale, qt, scale_t


def quantize_both(x: torch.Tensor, dtype: str = "fp8_e4m3", row_scale: torch.Tensor | None = None,
                  row_amax: torch.Tensor | None = None, col_amax: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
    """``quantize_rows(x)`` and ``quantize_rows(x.t())`` in one call, from two reads of
    x instead of four: ``{"q": (R, C), "scale": (R,), "qt": (C, R), "scale_t": (C,)}``,
    the same bits as the two calls.  For a tensor that two GEMMs read along
    different axes, e.g. an incoming gradient dy: ``q`` (per token) is the A of
    the input-gradient GEMM, ``qt`` (per feature, the contiguous transposed copy)
    the A of the weight-gradient GEMM dy^T @ x, with ``scale_t`` its ColVec.

    ``row_scale`` (R,): ``v = x * row_scale[:, None]`` is quantized both ways, e.g.
    ``quantize_both(xg, row_scale=rstd)`` for RMSNorm's output from ``rms_prepare``'s
    ``xg``.  A per-token factor leaves the per-token copy's precision as it is, but
    the per-feature copy's scale is the amax over every token: quantize the tensor
    the math has (the normalized input, the gradient before a norm's ``r``), not one
    with a per-token factor left out, or the rows that factor makes large set every
    feature's scale and the other rows lose their bits.

    ``row_amax`` (R,) and ``col_amax`` (C,), given together: the largest ``|v|`` of each
    row and of each column, as the epilogue that wrote x reduced them (``col_amax()``,
    ``row_amax()`` of the value it stores; for a paired tensor the two lanes' column
    amaxes joined by ``interleave_columns``).  The cast then reads x once instead of
    twice.  The scales come from these amaxes as given: an amax of the fp32 value before
    its 16-bit store may sit a rounding below the stored one, and the value a scale
    then maps past the format's largest saturates to it (a change of at most that
    rounding); an amax that is no bound at all clips every value past it."""
    _check(x, dtype, "quantize_both")
    _check_scales("quantize_both", x, row_scale=row_scale, row_amax=row_amax, col_amax=col_amax)
    if (row_amax is None) != (col_amax is None):
        raise CatalogueError("quantize_both: give row_amax and col_amax together (both of the value quantized, "
                             "e.g. an epilogue's col_amax() and row_amax()), or neither")
    q, scale, qt, scale_t = _quantize_both(x, dtype, row_scale, row_amax, col_amax)
    return {"q": q, "scale": scale, "qt": qt, "scale_t": scale_t}
