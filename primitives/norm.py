"""LayerNorm around GEMMs: row statistics, the rank-1 form, and the normalized
tensor itself (catalogue families 2 and 4).

LayerNorm(x) = (x - mean) * rstd * gamma + beta has two statistics per row,
so it commutes with the GEMM that consumes it in a rank-1 form (family 2:
vectors along the rows and along the columns)::

    LN(x) @ B = rstd * (x @ B' - mean * gw) + c
    B' = gamma[:, None] * B,   gw = the column sums of B',   c = beta @ B (+ bias)

- The consuming GEMM reads x itself (no normalized copy is written, nor
  rounded) against B', and its epilogue finishes ``rstd * (acc - mean * gw)
  + c``.  :func:`layernorm_fold` makes B', gw and c in one tile pass over the
  weight, once per call (weights change every step): a GEMV's worth of reads
  and one write of the weight, instead of a GEMM to host ``gamma @ B``.  gw
  sums B' *as stored*, rounded to its dtype, so ``x @ B' - mean * gw`` is
  exactly ``(x - mean) @ B'`` up to fp32 accumulation: the centring cancels
  nothing that a rounding left behind, however large the mean.  (Storing
  ``x * gamma`` in bf16 instead would carry an error proportional to |x|,
  not to |x - mean|.)
- Statistics (family 4): where a GEMM produces x (a residual stream) its
  epilogue folds sum(x) and sum(x^2) per row (two ``col_sum``) and
  :func:`layernorm_stats` finishes mean and rstd; where no GEMM does (a
  block's first LayerNorm) :func:`row_stats` reads x once, in a tile pass.
  Both form var = E[x^2] - mean^2 in fp32 (clamped at 0), whose relative
  error is about 2^-24 * (1 + mean^2 / var): below bf16 precision while
  |mean| < ~100 std.  row_stats sums x less a shift per row (the mean of
  its first columns), which takes mean^2 down to (mean - shift)^2: its
  fp32 statistics hold an fp32 reference's, which a program that returns
  them (a backward's saved mean and rstd) is held to.  A sum folds the
  padded lanes of a ragged last tile too, where the accumulator and Tile
  loads are 0 but vectors are not (row_stats masks them by column): so with a
  bias (x = acc + residual + bias) the epilogue folds a = acc + residual, a^2
  and a * bias, and ``layernorm_stats(..., bias=, bias_dot=)`` adds the
  bias's share.
- Backward: with g the gradient of LN(x) and xhat = (x - mean) * rstd,
  ``dx = rstd * (gamma * g - (s1 + xhat * s2) / dim)`` needs
  s1 = sum(gamma * g) and s2 = sum(gamma * g * xhat) per row, and those are
  read off the consuming GEMM's output u and its gradient du:
  s1 = du . gw and s2 = du . (u - c), two ``col_sum`` in the epilogue that
  produces du (or in a tile pass over du and u).  The per-row coefficients of
  dx are a ``vector_pass``; the GEMM that computes g = du @ B^T finishes dx
  in its epilogue.
- :func:`normalize_rows` materializes the normalized tensor (family 2: a
  per-row and per-column scale of a tile, run as a tile pass) where the
  tensor itself is needed: a post-norm block's residual stream, a tensor two
  GEMMs read (the LM head's logits and its weight gradient), a weight
  gradient's input.
"""

from __future__ import annotations

import torch

from .aux import column_index, composite, need, offset_weight
from .epilogue import Epilogue, epilogue
from .errors import CatalogueError
from .math import round_bf16, round_fp16, where
from .operands import ColVec, RowVec, Scalar, Tile
from .passes import tile_pass
from .reductions import col_sum, row_sum


@epilogue(reductions={"sum": col_sum(), "sumsq": col_sum()})
def row_moments(x: Tile, shift: ColVec, col: RowVec, n: Scalar):
    # a ragged last tile's padded lanes load 0, which less the shift is not: masked by column
    d = where(col < n, x - shift, 0.0)
    return {"sum": d, "sumsq": d * d}


@epilogue()
def normalize(x: Tile, mean: ColVec, rstd: ColVec, gamma: RowVec, beta: RowVec):
    return {"D": (x - mean) * rstd * gamma + beta}


_ROUNDING = {torch.bfloat16: round_bf16, torch.float16: round_fp16}


def _fold(dtype: torch.dtype, over_rows: bool) -> Epilogue:
    """The fold as one pass over the weight as it is stored: over the rows of a weight stored
    (N, K) (``B = W.t()``; gamma and beta one per column of the pass, the sums down its
    columns), else over ``B`` stored (K, N) (one per row, the sums along its rows)."""
    rounded = _ROUNDING[dtype]

    def layernorm_fold(w, gamma, beta):  # noqa: ANN001, ANN202 - its kinds are set below
        wg = rounded(w * gamma)
        return {"D": wg, "gw": wg, "bw": w * beta}

    vec, total = (RowVec, col_sum) if over_rows else (ColVec, row_sum)
    layernorm_fold.__annotations__ = {"w": Tile, "gamma": vec, "beta": vec}
    return epilogue(reductions={"gw": total(), "bw": total()})(layernorm_fold)


# Built once, at import: torch.compile traces through a call that builds an epilogue (its dry
# run) and fails there, while a lookup in a constant table traces.
_FOLDS = {(dtype, over_rows): _fold(dtype, over_rows) for dtype in _ROUNDING for over_rows in (True, False)}


def _mean_rstd(sums: torch.Tensor, sumsq: torch.Tensor, dim: int, eps: float) -> dict[str, torch.Tensor]:
    mean = sums / float(dim)
    var = (sumsq / float(dim) - mean * mean).clamp_min(0.0)
    return {"mean": mean, "rstd": torch.rsqrt(var + float(eps))}


@composite
def layernorm_stats(sums: torch.Tensor, sumsq: torch.Tensor, dim: int, eps: float, *,
                    bias: torch.Tensor | None = None, bias_dot: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """LayerNorm's ``{"mean", "rstd"}`` (M,) fp32 from per-row sums of x and of
    x^2 over ``dim`` columns (two col_sum reductions of the epilogue that
    produced x): ``rstd = (E[x^2] - mean^2 + eps) ** -0.5``.  With ``bias``
    (N,) and ``bias_dot`` (M,), the statistics of x = a + bias from the sums of
    a, of a^2 and of a * bias (``bias_dot``): a sum must fold 0 in a ragged
    tile's padded lanes, where a = acc + residual is and a bias is not."""
    need("sums", sums, 1)
    need("sumsq", sumsq, 1)
    sums, sumsq = sums.float(), sumsq.float()
    if (bias is None) != (bias_dot is None):
        raise CatalogueError("layernorm_stats: give bias and bias_dot together (the sums of a, a^2 and a * bias "
                             "for x = a + bias), or neither")
    if bias is not None:
        need("bias", bias, 1)
        need("bias_dot", bias_dot, 1)
        b = bias.float()
        sums, sumsq = sums + b.sum(), sumsq + 2.0 * bias_dot.float() + (b * b).sum()
    return _mean_rstd(sums, sumsq, dim, eps)


SHIFT_COLUMNS = 64  # the columns whose mean shifts row_stats' sums


@composite
def row_stats(x: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """``{"mean", "rstd"}`` (M,) fp32 of each row of x (M, H), which no GEMM
    produced (a block's first LayerNorm): one read of x in a tile pass (sums
    in fp32 of x less a shift per row, the mean of its first 64 columns),
    finished as :func:`layernorm_stats` does.  The shift keeps the variance's
    cancellation at about (1 + (mean - shift)^2 / var) ulps, where sums of x
    itself lose (1 + mean^2 / var): fp32 statistics as accurate as a two-pass
    LayerNorm's, for a row whose mean is many times its spread too."""
    need("x", x, 2)
    m, h = x.shape
    shift = x[:, :SHIFT_COLUMNS].float().mean(dim=1) if h else x.new_zeros(m, dtype=torch.float32)
    sums = tile_pass(row_moments, x=x, shift=shift, col=column_index(h, x.device), n=float(h))
    mean = sums["sum"] / float(h)
    var = (sums["sumsq"] / float(h) - mean * mean).clamp_min(0.0)
    return {"mean": shift + mean, "rstd": torch.rsqrt(var + float(eps))}


@composite
def layernorm_fold(B: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor | None,
                   bias: torch.Tensor | None = None, gamma_offset: float = 0.0) -> dict[str, torch.Tensor]:
    """LayerNorm's rank-1 form for ``LN(x) @ B (+ bias)`` with B (K, N), as gemm
    takes it (``W.t()`` for a weight stored (N, K)): ``{"B": B', "gw": (N,),
    "c": (N,)}`` with B' = gamma[:, None] * B in B's dtype and layout, gw the
    column sums of B' as stored and c = beta @ B + bias (fp32), in one pass over
    the weight.  Then ``gemm(x, out["B"], fn, ...)`` with
    ``rstd * (acc - mean * gw) + c`` in fn is LN(x) @ B + bias.  ``gamma=None``,
    ``beta=None``: a LayerNorm without weight or bias (OLMo's non-parametric one);
    ``gamma_offset=1.0``: one that scales by ``1 + gamma`` (LayerNorm1P's, in fp32)."""
    need("B", B, 2)
    k, n = B.shape
    gamma = (torch.ones(k, dtype=torch.float32, device=B.device) if gamma is None
             else offset_weight(gamma, gamma_offset, "layernorm_fold"))
    beta = torch.zeros(k, dtype=torch.float32, device=B.device) if beta is None else beta
    for name, v, size in (("gamma", gamma, k), ("beta", beta, k), ("bias", bias, n)):
        if v is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != (size,)):
            raise CatalogueError(f"layernorm_fold: {name} needs shape ({size},) for B of shape {(k, n)} (gamma "
                                 f"and beta: one value per row of B; bias: one per column); got "
                                 f"{tuple(getattr(v, 'shape', ())) or type(v).__name__}")
    if B.dtype not in _ROUNDING:
        raise CatalogueError(f"layernorm_fold: B has dtype {B.dtype}; the mainloop takes bf16 or fp16")
    if B.stride(0) == 1:  # a transposed view of a weight stored (N, K)
        out = tile_pass(_FOLDS[B.dtype, True], w=B.t(), gamma=gamma, beta=beta)
        folded = out["D"].t()
    elif B.stride(1) == 1:
        out = tile_pass(_FOLDS[B.dtype, False], w=B, gamma=gamma, beta=beta)
        folded = out["D"]
    else:
        raise CatalogueError(f"layernorm_fold: B has strides {B.stride()}; give a weight stored row-major "
                             "(K, N), or the transposed view W.t() of one stored (N, K)")
    return {"B": folded, "gw": out["gw"], "c": out["bw"] if bias is None else out["bw"] + bias.float()}


@composite
def normalize_rows(x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor | None, mean: torch.Tensor | None = None,
                   beta: torch.Tensor | None = None, gamma_offset: float = 0.0) -> torch.Tensor:
    """The normalized tensor itself, ``(x - mean) * rstd * gamma + beta`` in x's
    dtype (x (M, H); rstd, mean (M,); gamma, beta (H,)): LayerNorm, or RMSNorm
    ``x * rstd * gamma`` without mean and beta; ``gamma=None`` for a norm without
    a weight (OLMo's non-parametric LayerNorm), ``gamma_offset=1.0`` for one that
    scales by ``1 + gamma`` (Gemma's).  One tile pass (read x, write
    the result): for a post-norm block's residual stream, or a normalized
    activation that two GEMMs read."""
    need("x", x, 2)
    m, h = x.shape
    gamma = (torch.ones(h, dtype=torch.float32, device=x.device) if gamma is None
             else offset_weight(gamma, gamma_offset, "normalize_rows"))
    mean = torch.zeros(m, dtype=torch.float32, device=x.device) if mean is None else mean
    beta = torch.zeros(h, dtype=torch.float32, device=x.device) if beta is None else beta
    return tile_pass(normalize, x=x, mean=mean, rstd=rstd, gamma=gamma, beta=beta)["D"]


NORM_KERNELS = (row_stats, layernorm_stats, layernorm_fold, normalize_rows)
