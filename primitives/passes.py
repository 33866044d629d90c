"""Passes without a GEMM: an epilogue fn over tiles (family 3), or over vectors
(family 2).

Some work of a layer has no GEMM to ride on: dGELU of a gradient that arrives
from outside, the row statistics of a block's input, the bias gradient of an
incoming gradient, the LayerNorm-backward statistics of a gradient the
attention backward produced.  Before these passes a program hosted such work
in a throwaway GEMM (a K = 64 product whose accumulator it ignored) or
recomputed a forward GEMM to host it.

``tile_pass(fn, **operands)`` runs an epilogue fn that takes no ``acc`` over
the (M, N) tiles of its ``Tile``/``PairedTile`` operands, with everything a
GEMM epilogue has: the operand kinds, extra outputs, reductions with their
ragged-edge masking, both lowerings and the compile stage's SASS gate.  In the
cute lowering an untuned pass of Tiles (a PairedTile too), vectors and Scalars
with 16-bit or fp32 outputs and plain folds runs on its own streaming kernel
(:mod:`.pass_kernel`: 3.3 TB/s on the H200 for the wide dGELU pass, where the
GEMM's epilogue moved 2.1); anything else, and a pass given a ``config``, runs
on quack's SM90 kernel with a mainloop over zeros: A is (M, 16) and B (16, N)
of bf16 zeros (one k-block; TMA fills the rest of it with zeros), views of one
buffer per device that the catalogue keeps, so each tile costs one small TMA
load and one WGMMA before its epilogue, and the fn never sees the
accumulator.  Either way the pass is recorded as ``pass`` in the launch
ledger, and the task's FLOP count does not include it.

Why not a prologue on A (quack's ``operand_transform``: ``@a_transform``,
``EpiMod(..., transform_a=...)``)?  Both a value transform (``x * 0.5``) and a
strip transform (``x * gamma[k]``, kind ``kvec_m64``) compile for sm_90a on the
CPU, but a transform sees only A's own values plus per-(row, k-tile) or
per-(64 rows, k) strips, so it cannot read a second tensor (dGELU needs the
saved pre-activation) nor fold a reduction (row statistics); strip operands
need M to be a multiple of the tile's M (no ragged token counts); it runs on
the warps that issue the WGMMAs and is paid once per N tile of the output
(A is re-transformed for every column block), which for a transcendental
(GELU of A: ~25 instructions per element, 4 N tiles at N = 768) costs more
than the MMA it feeds; and per-row or per-column scalings commute through the
GEMM anyway (the epilogue's ``rstd``, LayerNorm's folded ``gamma``).

``vector_pass(fn, **operands)`` evaluates an acc-less fn on per-row (``ColVec``,
length M) or per-column (``RowVec``, length N) vectors and ``Scalar``\\ s: math
on finished statistics done once per row in host code, instead of once per
element in the next epilogue (LayerNorm's backward coefficients).  It is a few
PyTorch kernels on the vectors' device in every lowering, recorded as one
``aux`` launch; its results are fp32 vectors unless an output declares another
dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .epilogue import Epilogue
from .errors import CatalogueError
from .gemm import check_operands, launch
from .lowering import launching, profiler_range
from .operands import ColVec, RowVec, Scalar
from .tile_config import TileConfig

ZERO_K = 16  # the zero mainloop's K: one bf16 MMA k-step

def zero_rows(rows: int, device: torch.device) -> torch.Tensor:
    """(rows, ZERO_K) bf16 zeros, the zero mainloop's operand (on the pass kernel only the
    shape carrier of the call), made fresh for each call: a launch keeps no device memory
    from one call to the next.  A buffer kept across calls would be allocated wherever the
    first call ran, and under torch.compile's CUDA graphs (``mode="reduce-overhead"``) that is
    the graphs' private pool, whose every live block must be a graph output: the compiled
    step fails there (H200, run 21).  Two memsets of at most a few hundred KiB a call."""
    return torch.zeros(rows, ZERO_K, dtype=torch.bfloat16, device=device)


def _require_pass(epi: Any, call: str) -> Epilogue:
    if not isinstance(epi, Epilogue):
        raise CatalogueError(f"{call}: the first argument must be an @epilogue function; got "
                             f"{type(epi).__name__}")
    if epi.reads_acc:
        raise CatalogueError(f"{call}: epilogue {epi.name!r} reads `acc`, but a pass runs no GEMM, so there "
                             "is no accumulator; drop the `acc` parameter (or run it in a gemm)")
    return epi


def tile_pass(epilogue: Epilogue, *, out_dtype: str | None = None, config: TileConfig | None = None,
              accumulate_into: torch.Tensor | None = None, out: torch.Tensor | None = None,
              **operands: Any) -> dict[str, torch.Tensor]:
    """Run an epilogue fn without ``acc`` over tiles, with no GEMM: its Tile
    (and PairedTile) operands set the (M, N) it covers; every operand kind,
    output, reduction, ``accumulate_into`` and ``out`` work as in ``gemm``
    (``out`` may be a Tile the fn reads and nothing reads later: each element
    is read before it is written; use the returned D, as ``gemm`` says).
    D's dtype is ``out_dtype``, by default the first Tile operand's.  The cost
    is the epilogue's own loads and stores (e.g. dGELU of an incoming gradient
    over the saved pre-activation: ``tile_pass(dgelu, dy=dy, pre=pre,
    out=pre)``, no GEMM to recompute, no new (M, N) buffer).  With
    ``config=None`` a pass of Tile, PairedTile, RowVec, ColVec and Scalar
    operands, 16-bit or fp32 outputs and col_sum, col_max or row_sum folds
    streams on the catalogue's own pass kernel, near copy bandwidth (the only
    place ``accumulate_into`` takes a PairedTile pass); fp8 outputs, partials,
    an LSE or select, or a ``config`` run it as the epilogue of quack's GEMM
    over a zero mainloop."""
    epi = _require_pass(epilogue, "tile_pass")
    grid = []  # a loop, not a comprehension with :=, which torch.compile's tracer cannot read
    for name, kind in epi.operands.items():
        g = kind.output_grid(operands.get(name))
        if g is not None:
            grid.append((name, g))
    if not grid:
        raise CatalogueError(f"tile_pass: epilogue {epi.name!r} has no Tile or PairedTile operand (given as "
                             "a 2-D tensor) to set the (M, N) the pass covers; a pass over per-row or "
                             "per-column values is a vector_pass")
    first, (m, n) = grid[0]
    device = operands[first].device
    if out_dtype is None and epi.stores_d and not epi.paired_operand:
        out_dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(operands[first].dtype, "fp32")
    # The zeros are device work of this call: inside a catalogue range, where the verifier's launch
    # audit attributes them (outside every range they read as the program's own launches).
    with profiler_range(f"coda::buffers::{epi.name}"):
        a, b = zero_rows(m, device), zero_rows(n, device).t()
    return launch(epi, a, b, operands, out_dtype=out_dtype, config=config, accumulate_into=accumulate_into,
                  out=out, kind="pass")


def vector_pass(epilogue: Epilogue, **operands: Any) -> dict[str, torch.Tensor]:
    """Evaluate an epilogue fn without ``acc`` on per-row (ColVec, length M) or
    per-column (RowVec, length N) vectors and Scalars, once per element of the
    vectors (host-side vector math, e.g. per-row coefficients from finished
    statistics).  Returns D (fp32) and the declared outputs, 1-D."""
    epi = _require_pass(epilogue, "vector_pass")
    kinds = set(epi.operands.values()) - {Scalar}
    if epi.reductions or epi.paired_operand or not kinds or not (kinds <= {ColVec} or kinds <= {RowVec}):
        raise CatalogueError(
            f"vector_pass: epilogue {epi.name!r} must read ColVec operands (one value per row) or RowVec "
            "operands (one per column), not both, plus Scalars, and fold nothing: an outer product, a "
            "Tile or a reduction is a tile_pass")
    vectors = {name: operands[name] for name, kind in epi.operands.items() if kind is not Scalar and name in operands}
    sized = [v for v in vectors.values() if isinstance(v, torch.Tensor) and v.dim() == 1]
    if vectors and not sized and set(epi.operands) <= set(operands):
        name = next(iter(vectors))
        raise CatalogueError(f"vector_pass: operand {name!r} is declared {epi.operands[name].name} and needs a "
                             f"1-D tensor; got {getattr(vectors[name], 'shape', type(vectors[name]).__name__)}")
    length = sized[0].shape[0] if sized else 0
    device = sized[0].device if sized else torch.device("cpu")
    check_operands(epi, operands, length, length, device, f"vector_pass({epi.name}, ...)")
    # The ledger range reads ContextVars, which torch.compile's tracer cannot: left out of a trace.
    scope = contextlib.nullcontext() if torch.compiler.is_compiling() else launching("aux", epi.name)
    with scope, torch.no_grad():
        result = epi.fn(**{name: float(operands[name]) if kind is Scalar else operands[name].float()
                           for name, kind in epi.operands.items()})
        dtypes = {"D": torch.float32, **epi.outputs}
        return {name: torch.as_tensor(result[name], dtype=torch.float32, device=device).expand(length)
                .to(dtype).contiguous() for name, dtype in dtypes.items() if name in result}
