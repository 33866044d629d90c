"""Auxiliary kernels: the light passes that finish what epilogues start.

A fused epilogue folds statistics per output tile; a row's statistic is only
complete once every N tile has been visited, so a tiny kernel finishes it
before the next GEMM consumes it (inverse RMS from a sum of squares, the loss
from a log-sum-exp).  They touch O(M) or O(M * heads) values, never a full
activation, except :func:`xent_grad_`, the cross-entropy gradient, which
rewrites one logits chunk in place (bounded by the caller's chunk size).

Each is one catalogue call, recorded in the launch ledger as ``aux``; they are
plain PyTorch (a handful of small kernels each), identical in both lowerings,
except two on CUDA tensors: :func:`xent_grad_` is one Triton kernel
(:mod:`.xent_triton`, imported lazily) with the same math as its PyTorch form,
and :func:`rms_prepare`, which writes a full activation, is a tile pass on the
catalogue's pass kernel (:func:`rms_prepare_pass`: the same bits of
``x * gamma``, the sum of squares in another order).

Each is also a ``torch.library`` custom op, ``coda::<name>`` (see gemm.py for
why): the op's body is the launch (ledger entry and profiler range, read when
it runs); its fake is the same PyTorch code on fake tensors (shapes only; the
in-place ``xent_grad_`` has none to compute), and the differentiable ones
register their derivative, so a program's aux calls trace under torch.compile
and a model may train through them directly.  In eager mode a call runs the
op's body directly where nothing could tell the difference (:mod:`.dispatch`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from .dispatch import direct, mutated
from .epilogue import epilogue
from .errors import CatalogueError
from .lowering import launching
from .operands import OUTPUT_DTYPES, RowVec, Tile
from .passes import tile_pass
from .reductions import col_sum


def aux_kernel(name: str, *, mutates: tuple[str, ...] = (), fake: Callable | None = None,
         backward: Callable | None = None) -> Callable[[Callable], Callable]:
    """Make ``fn`` the custom op ``coda::<name without trailing _>`` and return its public
    form: ``fn``'s signature and doc, arguments checked against their annotations before the op
    is called."""

    def wrap(fn: Callable) -> Callable:
        def launch(*args: Any, **kwargs: Any) -> Any:
            with launching("aux", name), torch.no_grad():
                return fn(*args, **kwargs)

        op = torch.library.custom_op(f"coda::{name.rstrip('_')}", launch, mutates_args=mutates,
                                     schema=torch.library.infer_schema(fn, mutates_args=mutates))
        op.register_fake(fake or fn)
        if backward is not None:
            op.register_autograd(backward, setup_context=_keep_inputs)
        params = list(inspect.signature(fn).parameters.values())
        written = [i for i, p in enumerate(params) if p.name in mutates]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for p, v in zip(params, args):
                _check_argument(name, p, v)
            if kwargs or not direct(args, differentiable=backward is not None):
                return op(*args, **kwargs)
            out = launch(*args)
            mutated(args[i] for i in written if i < len(args))
            return out

        return call

    return wrap


# What the op's schema admits for a parameter annotated so (the op path raises on anything else;
# the direct path checks the same here, so a program that runs eagerly also traces).
_ADMITS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
                                        "torch.device": (torch.device, str)}


def _check_argument(kernel: str, p: inspect.Parameter, v: object) -> None:
    if p.annotation == "torch.Tensor":
        need(p.name, v)
        return
    admits = _ADMITS.get(p.annotation)
    if admits is not None and (not isinstance(v, admits) or (bool not in admits and isinstance(v, bool))):
        raise CatalogueError(f"{kernel.rstrip('_')}: {p.name} must be {p.annotation}; got {type(v).__name__}")


def _keep_inputs(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.inputs = inputs
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)))


def composite(fn: Callable) -> Callable:
    """Make ``fn``, a catalogue function built from other catalogue calls (tile
    passes, aux ops) and O(M) vector math, one ``aux`` launch: a ledger entry and
    a profiler range around all it runs, no autograd.  It is no custom op of its
    own: under torch.compile its parts trace as what they are (the ops it calls,
    and vector math Inductor fuses), and the range, read from ContextVars, is
    left out of the trace."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with launching("aux", name), torch.no_grad():
            return fn(*args, **kwargs)

    return call


def need(name: str, t: object, dims: int | None = None) -> torch.Tensor:
    """``t``, or a CatalogueError naming what it must be (a tensor, of ``dims`` dimensions)."""
    if not isinstance(t, torch.Tensor):
        raise CatalogueError(f"{name} must be a tensor; got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise CatalogueError(f"{name} must be {dims}-D; got shape {tuple(t.shape)}")
    return t


def _rms_rstd_backward(ctx: Any, g: torch.Tensor) -> tuple:
    (sqsum,) = ctx.saved_tensors
    _, dim, eps = ctx.inputs
    r = torch.rsqrt(sqsum.float() / float(dim) + float(eps))
    return (g * (-0.5 / dim) * r * r * r).to(sqsum.dtype), None, None


@aux_kernel("rms_rstd", backward=_rms_rstd_backward)
def rms_rstd(sqsum: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """Inverse RMS from a sum of squares: ``(sqsum / dim + eps) ** -0.5`` (fp32).

    ``sqsum`` is any fp32 tensor of sums (a col_sum (M,), per-head partials
    (M, heads)); ``dim`` is how many squares each sum holds."""
    need("sqsum", sqsum)
    return torch.rsqrt(sqsum.float() / float(dim) + float(eps))


def _rms_prepare_backward(ctx: Any, gxg: torch.Tensor, grstd: torch.Tensor) -> tuple:
    x, gamma = ctx.saved_tensors
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(dim=1) + float(ctx.inputs[2]))
    dx = gxg.float() * gamma.float() - (grstd * r.pow(3) / x.shape[1])[:, None] * xf
    return dx.to(x.dtype), (gxg.float() * xf).sum(dim=0).to(gamma.dtype), None


def _rms_prepare_torch(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    need("x", x, 2)
    # One read of x for the statistic (fp32 accumulation, no fp32 copy of x) and
    # one read + write for x * gamma (computed in fp32, rounded once to x's dtype).
    norm = torch.linalg.vector_norm(x, 2, dim=1, dtype=torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(norm * norm / float(x.shape[1]) + float(eps))
    if gamma.dtype == x.dtype:
        xg = x * gamma
    else:
        xg = (x.float() * gamma.float()).to(x.dtype)
    return xg, rstd


@epilogue(reductions={"sumsq": col_sum()})
def scale_columns(x: Tile, gamma: RowVec):
    return {"D": x * gamma, "sumsq": x * x}


def rms_prepare_pass(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_prepare``'s body on CUDA: ``x * gamma`` (fp32 math, rounded once to x's dtype, the
    bits of PyTorch's product) and the inverse RMS from one read of x, a tile pass on the pass
    kernel: 2.6-3.4 TB/s on the H200 at LLaMA-3 widths, where the PyTorch body (a broadcasting
    product and a norm) moves 1.1-1.2 (BENCHMARKS.md, run 17)."""
    out = tile_pass(scale_columns, x=x, gamma=gamma)
    return out["D"], torch.rsqrt(out["sumsq"] / float(x.shape[1]) + float(eps))


@aux_kernel("rms_prepare", backward=_rms_prepare_backward, fake=_rms_prepare_torch)
def _rms_prepare(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    need("x", x, 2)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous() and x.shape[1] % 8 == 0:
        return rms_prepare_pass(x, gamma, eps)
    return _rms_prepare_torch(x, gamma, eps)


def offset_weight(gamma: torch.Tensor, offset: float, where: str) -> torch.Tensor:
    """``offset + gamma`` in fp32: the scale of a norm whose weight is stored as its offset from
    ``offset`` (Gemma's RMSNorm and LayerNorm1P scale by 1 + w, in fp32); ``gamma`` as it is for 0."""
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise CatalogueError(f"{where}: gamma_offset is a number (1.0 for a weight applied as 1 + w); "
                             f"got {offset!r}")
    need("gamma", gamma, 1)
    return gamma.float() + float(offset) if offset else gamma


def rms_prepare(x: torch.Tensor, gamma: torch.Tensor, eps: float, gamma_offset: float = 0.0
                ) -> dict[str, torch.Tensor]:
    """Entry RMSNorm with no producing GEMM: ``{"xg": x * gamma, "rstd": (M,)}``.

    Feed ``xg`` to the next GEMM and multiply its accumulator by ``rstd`` (a
    ColVec): RMSNorm(x) @ W == rstd * ((x * gamma) @ W).  ``gamma_offset=1.0``
    scales by ``1 + gamma`` in fp32 (Gemma's RMSNorm, LayerNorm1P): its gradient
    is gamma's own."""
    xg, rstd = _rms_prepare(x, offset_weight(gamma, gamma_offset, "rms_prepare"), eps)
    return {"xg": xg, "rstd": rstd}


def _xent_loss_backward(ctx: Any, g: torch.Tensor) -> tuple:
    target, ignore_index = ctx.inputs[2], ctx.inputs[3]
    d = torch.where(target == ignore_index, torch.zeros_like(g), g)
    return d, -d, None, None


@aux_kernel("xent_loss", backward=_xent_loss_backward)
def xent_loss(lse: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor,
              ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy ``lse - target_logit`` (0 where target == ignore_index)."""
    need("lse", lse, 1)
    return torch.where(target == ignore_index, torch.zeros_like(lse), lse - target_logit)


def _no_result(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor,
               ignore_index: int = -100) -> None:
    return None  # in place: nothing to allocate


@aux_kernel("xent_grad_", mutates=("logits",), fake=_no_result)
def _xent_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor,
               ignore_index: int = -100) -> None:
    need("logits", logits, 2)
    need("lse", lse, 1)
    need("target", target, 1)
    need("dloss", dloss, 1)
    if logits.is_cuda and logits.stride(1) == 1:
        from .xent_triton import xent_grad_triton  # lazy: CPU runs never import Triton

        xent_grad_triton(logits, lse, target, dloss, ignore_index)
    else:
        _xent_grad_torch(logits, lse, target, dloss, ignore_index)


def xent_grad_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
               dloss: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """In place: ``logits <- (softmax(logits) - onehot(target)) * dloss[:, None]``.

    ``logits`` is one (rows, V) chunk in bf16/fp16; ``lse`` the finished
    log-sum-exp per row (fp32); ``dloss`` the per-row loss gradient.  The
    softmax is of the stored logits, ``exp(x - m) / sum(exp(x - m))`` with ``m``
    their row maximum, not ``exp(x - lse)``: ``lse`` comes from the GEMM's fp32
    accumulator and the stored logits are rounded (at logits of about 100 a
    bf16 rounding moves ``exp(x - lse)`` by a quarter, and the row's
    probabilities no longer sum to one: the verifier's edge rows check this;
    past logits of about 2^14 a rounding moves a logit above ``lse`` by more
    than fp32's exp can take, and ``exp(x - lse)`` overflows).  ``lse`` stays an
    argument: the loss is read off it (:func:`xent_loss`).  Rows whose
    target is ``ignore_index`` become 0; a target outside [0, V) subtracts no
    one-hot.  Returns ``logits`` (now dlogits), ready to be the A operand of
    dX = dlogits @ W and the B operand of dW = X^T @ dlogits."""
    _xent_grad(logits, lse, target, dloss, ignore_index)
    return logits


def _xent_grad_torch(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                     dloss: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The CPU path of :func:`xent_grad_` (same math as the Triton kernel, in
    fp32: ``(exp(x - m) / sum(exp(x - m)) - onehot) * scale``, ``m`` the row's
    maximum), in row blocks that bound the fp32 temporary; no host synchronisation."""
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits
    scale = torch.where(target == ignore_index, torch.zeros_like(dloss.float()), dloss.float())
    step = max(1, (64 << 20) // (vocab * 4))  # bound the fp32 temporary to ~64 MiB
    for r0 in range(0, rows, step):
        blk = logits[r0:r0 + step]
        n = blk.shape[0]
        p = blk.float()
        p.sub_(p.amax(1, keepdim=True)).exp_()
        p.div_(p.sum(1, keepdim=True))
        t = target[r0:r0 + n].long()
        valid = (t >= 0) & (t < vocab)
        idx = t.clamp(0, vocab - 1).view(-1, 1)
        p.scatter_add_(1, idx, -valid.to(p.dtype).view(-1, 1))
        p.mul_(scale[r0:r0 + n, None])
        blk.copy_(p)
    return logits


@aux_kernel("column_index")
def _column_index(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device=device)


def column_index(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[0, 1, ..., n-1]``: a RowVec for epilogues that need the column number
    (exact up to 2**24)."""
    return _column_index(n, torch.device(device))


def _to_fp32_backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
    return g.to(ctx.inputs[0].dtype)


@aux_kernel("to_fp32", backward=_to_fp32_backward)
def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` as fp32 (e.g. integer targets compared against column_index)."""
    return need("x", x).to(torch.float32, copy=True)  # an op's result never aliases its input


def _interleave_backward(ctx: Any, g: torch.Tensor) -> tuple:
    return g[:, 0::2], g[:, 1::2]


@aux_kernel("interleave_columns", backward=_interleave_backward)
def interleave_columns(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Weight layout: (K, N) and (K, N) -> (K, 2N) with columns [a0, b0, a1, b1, ...],
    so adjacent accumulator columns form the (gate, up) Pair of SwiGLU."""
    need("a", a, 2)
    need("b", b, 2)
    if a.shape != b.shape:
        raise CatalogueError(f"interleave_columns: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    return torch.stack((a, b), dim=-1).flatten(-2).contiguous()


def _deinterleave_backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    return torch.stack((ga, gb), dim=-1).flatten(-2)


@aux_kernel("deinterleave_columns", backward=_deinterleave_backward)
def deinterleave_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_columns`: (K, 2N) -> even and odd columns (copies)."""
    need("x", x, 2)
    return x[:, 0::2].clone(memory_format=torch.contiguous_format), x[:, 1::2].clone(
        memory_format=torch.contiguous_format)


@aux_kernel("zeros_like")
def zeros_like(x: torch.Tensor, dtype: str = "") -> torch.Tensor:
    """A zero-filled tensor of ``x``'s shape, in its dtype or ``dtype``: the start of a gradient
    accumulated with ``gemm(..., accumulate_into=...)``."""
    return torch.zeros(need("x", x).shape, dtype=_dtype("zeros_like", dtype, x), device=x.device)


@aux_kernel("zeros")
def zeros(n: int, like: torch.Tensor, dtype: str = "") -> torch.Tensor:
    """A 1-D vector of ``n`` zeros on ``like``'s device, in ``like``'s dtype or ``dtype``
    (``"bf16"``, ``"fp32"``, ...): the padding of a per-row or per-column vector built with
    :func:`concat_rows` (e.g. a RoPE frequency table whose last columns of each head are not
    rotated: ``concat_rows([freq, zeros(d - r, freq), ...])``)."""
    if n < 0:
        raise CatalogueError(f"zeros: n is {n}; a vector's length is 0 or more")
    return torch.zeros(n, dtype=_dtype("zeros", dtype, need("like", like)), device=like.device)


def _broadcast_backward(ctx: Any, g: torch.Tensor) -> tuple:
    x = ctx.inputs[0]
    return g.float().sum().reshape(x.shape).to(x.dtype), None, None


@aux_kernel("broadcast", backward=_broadcast_backward)
def broadcast(x: torch.Tensor, n: int, dtype: str = "") -> torch.Tensor:
    """A 1-D vector of ``n`` copies of the one value a one-element tensor ``x`` holds, in ``x``'s
    dtype or ``dtype``: a trained scalar (xIELU's slopes, PReLU's one slope, a ReZero gate) as a
    RowVec or ColVec operand, since a Scalar is a number of the program and a tensor's value never
    becomes one (``float(x)`` would read the device from the host).  Its gradient is the sum of the
    vector's: fold it where it is made (a ``row_sum``), then over that (N,) vector with a
    ``tile_pass`` of ``v.view(1, n)`` as a Tile and a ``col_sum``."""
    if need("x", x).numel() != 1:
        raise CatalogueError(f"broadcast: x has shape {tuple(x.shape)}; it repeats a one-element tensor's value "
                             "(a vector is already a RowVec or ColVec)")
    if n < 1:
        raise CatalogueError(f"broadcast: n is {n}; a vector's length is 1 or more")
    return x.reshape(1).to(_dtype("broadcast", dtype, x)).expand(n).clone()


def _dtype(kernel: str, name: str, like: torch.Tensor) -> torch.dtype:
    if not name:
        return like.dtype
    if name not in OUTPUT_DTYPES:
        raise CatalogueError(f"{kernel}: dtype {name!r} is none of {', '.join(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[name]


def _pad_backward(ctx: Any, g: torch.Tensor) -> tuple:
    x = ctx.inputs[0]
    return g[tuple(slice(0, n) for n in x.shape)].to(x.dtype), None, None


@aux_kernel("pad", backward=_pad_backward)
def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = x.new_zeros((rows, cols)[:x.dim()])
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def pad(x: torch.Tensor, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """A contiguous copy of a 1-D or 2-D ``x`` with zeros appended up to ``rows`` rows (and
    ``cols`` columns); None keeps a size.  A GEMM needs every row stride a multiple of 16 bytes:
    a router weight of 60 experts becomes ``pad(w_r, rows=64)`` (its 4 extra logits masked in the
    epilogue, the result's columns ``[:, :60]`` read back; a program's results are dense, so that
    view is copied to be returned, ``pad(r[:, :60])``, and a task result whose rows are no 16-byte
    multiple, 3 bf16 classes, cannot be returned at all: ``tasks check`` says so), a vocabulary of
    50257 ``pad(w, rows=50304)``.  The gradient of the copy is the gradient's first
    rows and columns."""
    need("x", x)
    if x.dim() not in (1, 2) or (x.dim() == 1 and cols is not None):
        raise CatalogueError(f"pad: x has shape {tuple(x.shape)}; it pads a 1-D tensor's rows or a 2-D "
                             "tensor's rows and columns")
    want = [x.shape[0] if rows is None else rows, *([] if x.dim() == 1 else [x.shape[1] if cols is None else cols])]
    for what, have, n in zip(("rows", "cols"), x.shape, want):
        if not isinstance(n, int) or isinstance(n, bool) or n < have:
            raise CatalogueError(f"pad: {what}={n!r}; it pads to a whole number at least x's {have}")
    return _pad(x, want[0], want[-1])


def _add_backward(ctx: Any, g: torch.Tensor) -> tuple:
    a, b = ctx.inputs
    return g.to(a.dtype), g.to(b.dtype)


@aux_kernel("add", backward=_add_backward)
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for two gradients of the same shape (e.g. weight-gradient partials
    from token chunks), in a's dtype."""
    if a.shape != b.shape:
        raise CatalogueError(f"add: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float() + b.float()).to(a.dtype)


def _concat_backward(ctx: Any, g: torch.Tensor) -> list[torch.Tensor]:
    return list(g.split([p.shape[0] for p in ctx.inputs[0]]))


@aux_kernel("concat_rows", backward=_concat_backward)
def _concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts)


def concat_rows(parts: list) -> torch.Tensor:
    """Join 1-D per-row vectors end to end: the per-chunk results (loss, lse) of a
    program that chunks over tokens, e.g. ``concat_rows([loss_0, loss_1, ...])``.

    Vectors only (O(rows) work): assemble a chunked *matrix* without a copy by
    giving each chunk's GEMM ``accumulate_into=buf[r0:r1]`` of a ``zeros_like``
    buffer."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise CatalogueError("concat_rows takes a non-empty list of 1-D tensors")
    for i, p in enumerate(parts):
        need(f"parts[{i}]", p, 1)
        if p.dtype != parts[0].dtype or p.device != parts[0].device:
            raise CatalogueError(f"concat_rows: parts[{i}] is {p.dtype} on {p.device}; parts[0] is "
                                 f"{parts[0].dtype} on {parts[0].device}")
    return _concat_rows(list(parts))


AUX_KERNELS = (rms_rstd, rms_prepare, xent_loss, xent_grad_, column_index, to_fp32,
               interleave_columns, deinterleave_columns, zeros_like, zeros, broadcast, pad, add, concat_rows)
