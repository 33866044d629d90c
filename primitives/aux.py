"""Auxiliary kernels: the light passes that finish what epilogues start.

A fused epilogue folds statistics per output tile; a row's statistic is only
complete once every N tile has been visited, so a tiny kernel finishes it
before the next GEMM consumes it (inverse RMS from a sum of squares, the loss
from a log-sum-exp).  They touch O(M) or O(M * heads) values, never a full
activation, except :func:`xent_grad_`, the cross-entropy gradient, which
rewrites one logits chunk in place (bounded by the caller's chunk size).

Each is one catalogue call, recorded in the launch ledger as ``aux``; they are
plain PyTorch (a handful of small kernels each), identical in both lowerings,
except :func:`xent_grad_`, which on CUDA tensors is one Triton kernel
(:mod:`.xent_triton`, imported lazily) with the same math as its PyTorch form.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .errors import CatalogueError
from .lowering import current_lowering, launching


def _aux(fn: Callable) -> Callable:
    name = fn.__name__

    def run(*args, **kwargs):  # noqa: ANN002, ANN003
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # Compile-only runs still compute (cheap at the small compile shapes, and it
        # keeps every later shape right) but launch nothing worth recording.
        compiling = current_lowering(*tensors) == "compile"
        with contextlib.nullcontext() if compiling else launching("aux", name), torch.no_grad():
            return fn(*args, **kwargs)

    run.__name__ = name
    run.__doc__ = fn.__doc__
    run.__wrapped_aux__ = fn  # type: ignore[attr-defined]
    return run


def _need(name: str, t: object, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CatalogueError(f"{name} must be a tensor; got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise CatalogueError(f"{name} must be {dims}-D; got shape {tuple(t.shape)}")
    return t


@_aux
def rms_rstd(sqsum: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """Inverse RMS from a sum of squares: ``(sqsum / dim + eps) ** -0.5`` (fp32).

    ``sqsum`` is any fp32 tensor of sums (a col_sum (M,), per-head partials
    (M, heads)); ``dim`` is how many squares each sum holds."""
    _need("sqsum", sqsum)
    return torch.rsqrt(sqsum.float() / float(dim) + float(eps))


@_aux
def rms_prepare(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """Entry RMSNorm with no producing GEMM: ``{"xg": x * gamma, "rstd": (M,)}``.

    Feed ``xg`` to the next GEMM and multiply its accumulator by ``rstd`` (a
    ColVec): RMSNorm(x) @ W == rstd * ((x * gamma) @ W)."""
    _need("x", x, 2)
    # One read of x for the statistic (fp32 accumulation, no fp32 copy of x) and
    # one read + write for x * gamma (computed in fp32, rounded once to x's dtype).
    norm = torch.linalg.vector_norm(x, 2, dim=1, dtype=torch.float32)
    rstd = torch.rsqrt(norm * norm / float(x.shape[1]) + float(eps))
    if gamma.dtype == x.dtype:
        xg = x * gamma
    else:
        xg = (x.float() * gamma.float()).to(x.dtype)
    return {"xg": xg, "rstd": rstd}


@_aux
def xent_loss(lse: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor,
              ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy ``lse - target_logit`` (0 where target == ignore_index)."""
    _need("lse", lse, 1)
    return torch.where(target == ignore_index, torch.zeros_like(lse), lse - target_logit)


@_aux
def xent_grad_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
               dloss: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """In place: ``logits <- (softmax(logits) - onehot(target)) * dloss[:, None]``.

    ``logits`` is one (rows, V) chunk in bf16/fp16; ``lse`` the finished
    log-sum-exp per row (fp32); ``dloss`` the per-row loss gradient.  The
    softmax is of the stored logits: ``exp(x - lse)`` renormalised by its row
    sum, because ``lse`` comes from the GEMM's fp32 accumulator and the stored
    logits are rounded (at logits of about 100 a bf16 rounding moves
    ``exp(x - lse)`` by a quarter, and the row's probabilities no longer sum to
    one: the verifier's edge rows found this).  Rows whose
    target is ``ignore_index`` become 0; a target outside [0, V) subtracts no
    one-hot.  Returns ``logits`` (now dlogits), ready to be the A operand of
    dX = dlogits @ W and the B operand of dW = X^T @ dlogits."""
    _need("logits", logits, 2)
    _need("lse", lse, 1)
    _need("target", target, 1)
    _need("dloss", dloss, 1)
    if logits.is_cuda and logits.stride(1) == 1:
        from .xent_triton import xent_grad_triton  # lazy: CPU runs never import Triton

        return xent_grad_triton(logits, lse, target, dloss, ignore_index)
    return _xent_grad_torch(logits, lse, target, dloss, ignore_index)


def _xent_grad_torch(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                     dloss: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The CPU path of :func:`xent_grad_` (same math as the Triton kernel, in
    fp32: ``(exp(x - lse) / sum(exp(x - lse)) - onehot) * scale``), in row blocks
    that bound the fp32 temporary; no host synchronisation."""
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits
    scale = torch.where(target == ignore_index, torch.zeros_like(dloss.float()), dloss.float())
    step = max(1, (64 << 20) // (vocab * 4))  # bound the fp32 temporary to ~64 MiB
    for r0 in range(0, rows, step):
        blk = logits[r0:r0 + step]
        n = blk.shape[0]
        p = blk.float()
        p.sub_(lse[r0:r0 + n, None].float()).exp_()
        p.div_(p.sum(1, keepdim=True))
        t = target[r0:r0 + n].long()
        valid = (t >= 0) & (t < vocab)
        idx = t.clamp(0, vocab - 1).view(-1, 1)
        p.scatter_add_(1, idx, -valid.to(p.dtype).view(-1, 1))
        p.mul_(scale[r0:r0 + n, None])
        blk.copy_(p)
    return logits


@_aux
def column_index(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[0, 1, ..., n-1]``: a RowVec for epilogues that need the column number
    (exact up to 2**24)."""
    return torch.arange(n, dtype=torch.float32, device=device)


@_aux
def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` as fp32 (e.g. integer targets compared against column_index)."""
    return _need("x", x).float()


@_aux
def interleave_columns(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Weight layout: (K, N) and (K, N) -> (K, 2N) with columns [a0, b0, a1, b1, ...],
    so adjacent accumulator columns form the (gate, up) Pair of SwiGLU."""
    _need("a", a, 2)
    _need("b", b, 2)
    if a.shape != b.shape:
        raise CatalogueError(f"interleave_columns: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    return torch.stack((a, b), dim=-1).flatten(-2).contiguous()


@_aux
def deinterleave_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_columns`: (K, 2N) -> even and odd columns (copies)."""
    _need("x", x, 2)
    return x[:, 0::2].contiguous(), x[:, 1::2].contiguous()


@_aux
def zeros_like(x: torch.Tensor) -> torch.Tensor:
    """A zero-filled tensor like ``x``: the start of a gradient accumulated with
    ``gemm(..., accumulate_into=...)``."""
    return torch.zeros_like(_need("x", x))


@_aux
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for two gradients of the same shape (e.g. weight-gradient partials
    from token chunks), in a's dtype."""
    if a.shape != b.shape:
        raise CatalogueError(f"add: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float() + b.float()).to(a.dtype)


@_aux
def concat_rows(parts: list) -> torch.Tensor:
    """Join 1-D per-row vectors end to end: the per-chunk results (loss, lse) of a
    program that chunks over tokens, e.g. ``concat_rows([loss_0, loss_1, ...])``.

    Vectors only (O(rows) work): assemble a chunked *matrix* without a copy by
    giving each chunk's GEMM ``accumulate_into=buf[r0:r1]`` of a ``zeros_like``
    buffer."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise CatalogueError("concat_rows takes a non-empty list of 1-D tensors")
    for i, p in enumerate(parts):
        _need(f"parts[{i}]", p, 1)
        if p.dtype != parts[0].dtype or p.device != parts[0].device:
            raise CatalogueError(f"concat_rows: parts[{i}] is {p.dtype} on {p.device}; parts[0] is "
                                 f"{parts[0].dtype} on {parts[0].device}")
    return torch.cat(list(parts))


AUX_KERNELS = (rms_rstd, rms_prepare, xent_loss, xent_grad_, column_index, to_fp32,
               interleave_columns, deinterleave_columns, zeros_like, add, concat_rows)
