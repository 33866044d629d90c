"""The tile pass's own kernel: an acc-less epilogue fn streamed over (M, N) tiles.

A tile pass has no product to compute, only its operands to read and its
outputs to write, so its speed is the memory's.  quack's SM90 GEMM with a
zero mainloop (the fallback, :mod:`.passes`) runs it as an epilogue: one CTA
per SM, because the mainloop's A/B stages fill shared memory, and a C prefetch
that stops at each tile's end, so every tile starts with a load's latency.
It moved 1.2-2.3 TB/s on the H200 where torch.compile's fused elementwise and
reduction kernels reach 3-4 (BENCHMARKS.md, runs 10 and 12).

This kernel is the plain streaming shape instead: 256 threads per CTA, a CTA
per 128 x 128 block of the output, each thread owning 8 adjacent columns
(one 16-byte load of a 16-bit tile) of 8 rows, its loads for 2 rows issued
before any of their math, and several CTAs per SM (few registers, no shared
memory but a small buffer per ``row_sum``), so the loads of many rows are in
flight.
Values reach the fn exactly as in the GEMM epilogue: ``cutlass.Float32``
scalars, one element at a time, so the same catalogue math and the same fn
run in both kernels.

- ``Tile`` operands, ``D`` and the extra outputs are row-major (M, N) tensors
  in 16-bit or fp32; ``RowVec`` (N,) and ``ColVec`` (M,) vectors in any of
  those; ``Scalar`` values are baked into the kernel, as quack bakes them.
- Lanes past a ragged edge are neither computed into a result nor folded:
  the reductions fold the real extent, which is the reference lowering's
  definition (its ``padded_lanes`` check still holds a program to the
  fallback's behaviour).
- ``col_sum``/``col_max`` (one value per row) fold a row's 8 values in the
  thread, then the 16 threads of the row with warp shuffles, into one partial
  per (row, column block); ``row_sum`` (one per column) folds a thread's rows,
  the two half-warps, then the 8 warps through shared memory, into one partial
  per (row block, column).  The partials are summed in column or row order by
  PyTorch afterwards (a few microseconds): every fold runs in a fixed order,
  so a pass is deterministic, as the verifier requires.
- ``accumulate_into`` adds the result rounded to D's dtype to D, as the TMA
  reduce-add store of the GEMM path does.
- A ``PairedTile`` (M, 2N) arrives as one Pair per output column, as in the
  GEMM epilogue: a thread loads the 2 x VEC elements of its VEC pairs (two
  16-byte loads) and stores the paired D at that width, while its Tiles,
  vectors and extra outputs are one value per pair (the (M, N) grid).  The
  inverse RoPE rotation of a gradient and dSwiGLU of an incoming one stream
  this way.

What it does not take falls back to quack's kernel (:func:`plan_for` says
why): fp8 outputs, ``col_sum(partials=True)`` (its layout is the GEMM
config's), LSE and select folds, transposed or misaligned tensors (16-byte
vectors need rows whose length and stride are multiples of 8 elements), and
N not a multiple of 8.

The kernel is compiled per epilogue and signature (dtypes, which folds,
accumulation) with symbolic M and N, through CuTeDSL's TVM-FFI entry point
(the tensors cross as torch tensors on the current stream), and cached in the
process.  cutlass is imported inside the functions that compile: importing
the catalogue does not load it.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .cute import CompileError
from .dsl_scope import compile_settings
from .epilogue import Epilogue
from .errors import CatalogueError
from .lowering import CompiledKernel, record_compiled
from .operands import ColVec, PairedTile, RowVec, Scalar, Tile
from .reductions import ColMax, ColSum, RowSum
from .sass import inspect_cubin

VEC = 8  # columns per thread: one 16-byte load of a 16-bit tile
LANES = 16  # threads along a row
THREADS = 256
WARPS = THREADS // 32
ROWS = THREADS // LANES  # rows one sweep of the CTA covers
TILE_N = VEC * LANES  # 128
MAX_GRID_Y = 65535  # CUDA's limit on the grid's y extent (the row blocks)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Geometry:
    """How many rows a thread covers: ``rows_in_flight`` loaded before their math,
    ``chunks`` times over."""

    rows_in_flight: int = 1
    chunks: int = 8

    @property
    def tile_m(self) -> int:
        return ROWS * self.rows_in_flight * self.chunks

    def __str__(self) -> str:
        return f"pass kernel {self.tile_m}x{TILE_N} r{self.rows_in_flight}"


# bench/passes.py's sweep on the H200 (bench/results/h200-2026-12-02-b): fewer rows in flight
# hold fewer registers (dGELU with its bias gradient: 48 at one row, 64 at two, 97 at four),
# so more CTAs share an SM, and more warps hide more latency than more loads per thread do:
# that pass at (16384, 16384) took 0.456 ms at one row, 0.486 at two, 0.663 at four, 0.771 on
# quack's zero mainloop and 0.624 under torch.compile; one row is within noise of two or
# faster on every pass and width of the sweep.
GEOMETRY = Geometry()
CONFIG = str(GEOMETRY)  # what the launch ledger records

_geometry: contextvars.ContextVar[Geometry] = contextvars.ContextVar("coda_pass_geometry", default=GEOMETRY)


@contextlib.contextmanager
def geometry(g: Geometry) -> Iterator[None]:
    """Run the enclosed untuned passes with another geometry (the benchmark's sweep)."""
    token = _geometry.set(g)
    try:
        yield
    finally:
        _geometry.reset(token)


@dataclass(frozen=True)
class Plan:
    """One kernel's static signature: the tensors in call order and what each is."""

    key: str  # the epilogue's registry key
    tiles: tuple[tuple[str, torch.dtype], ...]
    pair: tuple[str, torch.dtype] | None  # the PairedTile (M, 2N), read as one Pair per column
    rows: tuple[tuple[str, torch.dtype], ...]  # RowVec operands (N,)
    cols: tuple[tuple[str, torch.dtype], ...]  # ColVec operands (M,)
    scalars: tuple[tuple[str, float], ...]
    stores: tuple[tuple[str, torch.dtype], ...]  # "D" (if stored) first, then the extra outputs
    # With a pair, D is stored paired, (M, 2N); the extra outputs are one value per pair.
    per_row: tuple[tuple[str, str], ...]  # (name, "add" | "max"): col_sum / col_max -> (M,)
    per_col: tuple[str, ...]  # row_sum -> (N,)
    accumulate: bool
    geometry: Geometry = GEOMETRY


def plan_for(epi: Epilogue, operands: dict[str, Any], buffers: dict[str, torch.Tensor],
             accumulate: bool) -> tuple[Plan | None, str]:
    """(the kernel's plan, "") if this kernel runs the pass, else (None, why not)."""
    if epi.pairs_acc or epi.head_stats or epi.index_operands:
        return None, "a head-statistic or index epilogue"
    tiles, rows, cols, scalars, pair = [], [], [], [], None
    shape = None
    for name, kind in epi.operands.items():
        value = operands[name]
        if kind is Scalar:
            scalars.append((name, float(value)))
            continue
        if (kind not in (Tile, PairedTile, RowVec, ColVec) or not isinstance(value, torch.Tensor)
                or value.dtype not in _DTYPES):
            return None, f"operand {name!r} ({kind.name})"
        if kind in (Tile, PairedTile):
            if not _vectorizable(value):
                return None, f"{kind.name} {name!r} is not row-major with 16-byte aligned rows of 8k elements"
            shape = shape or kind.output_grid(value)
            if kind is PairedTile:
                pair = (name, value.dtype)
            else:
                tiles.append((name, value.dtype))
        elif kind is RowVec:
            if not _aligned(value):
                return None, f"RowVec {name!r} is not 16-byte aligned"
            rows.append((name, value.dtype))
        else:
            cols.append((name, value.dtype))
    if shape is None or shape[1] % VEC:
        return None, "N is not a multiple of 8"
    g = _geometry.get()
    if -(-shape[0] // g.tile_m) > MAX_GRID_Y:
        return None, f"more than {MAX_GRID_Y * g.tile_m} rows"
    stores = []
    for name in ("D", *epi.outputs):
        buf = buffers.get(name)
        if buf is None:
            continue
        want = (shape[0], 2 * shape[1]) if pair is not None and name == "D" else shape
        if buf.dtype not in _DTYPES or not _vectorizable(buf) or tuple(buf.shape) != want:
            return None, f"output {name!r} ({buf.dtype}) is not a 16-bit or fp32 row-major {want} tensor"
        stores.append((name, buf.dtype))
    per_row, per_col = [], []
    for name, red in epi.reductions.items():
        if isinstance(red, ColSum) and not red.partials:
            per_row.append((name, "add"))
        elif isinstance(red, ColMax):
            per_row.append((name, "max"))
        elif isinstance(red, RowSum):
            per_col.append(name)
        else:
            return None, f"reduction {name!r} ({red.describe()})"
    return Plan(epi.key, tuple(tiles), pair, tuple(rows), tuple(cols), tuple(scalars), tuple(stores),
                tuple(per_row), tuple(per_col), accumulate, g), ""


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % (VEC * t.element_size()) == 0 if t.numel() else True


def _vectorizable(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % VEC == 0 and _aligned(t)


# --------------------------------------------------------------------------- host side


def _partials(plan: Plan, m: int, n: int, buffers: dict[str, torch.Tensor], dev: torch.device) -> tuple[list, list]:
    """The buffers the kernel writes its partial folds into: the result itself when one
    block covers the folded extent, else (M, column blocks) / (row blocks, N) fp32."""
    blocks_n, blocks_m = -(-n // TILE_N), -(-m // plan.geometry.tile_m)
    per_row = [buffers[name].view(m, 1) if blocks_n == 1 else
               torch.empty(m, blocks_n, dtype=torch.float32, device=dev) for name, _ in plan.per_row]
    per_col = [buffers[name].view(1, n) if blocks_m == 1 else
               torch.empty(blocks_m, n, dtype=torch.float32, device=dev) for name in plan.per_col]
    return per_row, per_col


def _call_tensors(plan: Plan, operands: dict[str, Any], buffers: dict[str, torch.Tensor],
                  per_row: list, per_col: list) -> tuple:
    return (*(operands[n] for n, _ in plan.tiles), *([] if plan.pair is None else [operands[plan.pair[0]]]),
            *(operands[n] for n, _ in plan.rows), *(operands[n] for n, _ in plan.cols),
            *(buffers[n] for n, _ in plan.stores), *per_row, *per_col)


def _grid(plan: Plan, operands: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
    """A tensor of the pass and the (M, N) it covers: a Tile's shape, or a PairedTile's pairs."""
    if plan.tiles:
        first = operands[plan.tiles[0][0]]
        return first, first.shape[0], first.shape[1]
    first = operands[plan.pair[0]]
    return first, first.shape[0], first.shape[1] // 2


def run(epi: Epilogue, plan: Plan, operands: dict[str, Any], buffers: dict[str, torch.Tensor]) -> None:
    """Launch the pass into ``buffers`` (gemm's result buffers) on the current stream."""
    first, m, n = _grid(plan, operands)
    if m == 0 or n == 0:
        for name, op in plan.per_row:
            buffers[name].fill_(0.0 if op == "add" else float("-inf"))
        for name in plan.per_col:
            buffers[name].zero_()
        return
    per_row, per_col = _partials(plan, m, n, buffers, first.device)
    kernel, _ = _compiled(epi, plan)
    kernel(_call_tensors(plan, operands, buffers, per_row, per_col), m, n)
    for (name, op), part in zip(plan.per_row, per_row):
        if part.shape[1] > 1:
            torch.sum(part, dim=1, out=buffers[name]) if op == "add" else torch.amax(part, dim=1, out=buffers[name])
    for name, part in zip(plan.per_col, per_col):
        if part.shape[0] > 1:
            torch.sum(part, dim=0, out=buffers[name])


def compile_call(epi: Epilogue, plan: Plan, shapes: dict[str, int]) -> None:
    """Compile for the compile-only lowering and record the kernel with its SASS report."""
    t0 = time.perf_counter()
    with compile_settings():
        _, cubin = _compiled(epi, plan, keep=True)
    record_compiled(CompiledKernel(epilogue=epi.name, config=str(plan.geometry), seconds=time.perf_counter() - t0,
                                   log="", sass=inspect_cubin(cubin) if cubin else None, shapes=shapes, kind="pass"))


_kernels: dict[Plan, tuple[Any, bytes | None]] = {}


def _compiled(epi: Epilogue, plan: Plan, keep: bool = False) -> tuple[Any, bytes | None]:
    """The compiled kernel of ``plan`` and its cubin (kept when compiled under ``keep``)."""
    hit = _kernels.get(plan)
    if hit is not None and (hit[1] is not None or not keep):
        return hit
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_stream, make_fake_tensor
    from quack.cute_dsl_utils import torch2cute_dtype_map

    from .pass_kernel_dsl import PassKernel  # loads cutlass

    m, n = cute.sym_int(), cute.sym_int()

    def fake(dtype: torch.dtype, shape: tuple, div: int) -> Any:
        return make_fake_tensor(torch2cute_dtype_map[dtype], shape, div)

    pair_n = cute.sym_int()  # 2 n: a separate symbol, which the kernel never needs to relate to n

    def store(name: str, dtype: torch.dtype) -> Any:
        return fake(dtype, (m, pair_n if plan.pair is not None and name == "D" else n), VEC)

    pair = [] if plan.pair is None else [fake(plan.pair[1], (m, pair_n), VEC)]
    tensors = (*(fake(dt, (m, n), VEC) for _, dt in plan.tiles), *pair, *(fake(dt, (n,), VEC) for _, dt in plan.rows),
               *(fake(dt, (m,), 1) for _, dt in plan.cols), *(store(n_, dt) for n_, dt in plan.stores),
               *(fake(torch.float32, (m, cute.sym_int()), 1) for _ in plan.per_row),
               *(fake(torch.float32, (cute.sym_int(), n), 1) for _ in plan.per_col))
    try:
        compiled = cute.compile(PassKernel(epi, plan), tensors, cutlass.Int32(1), cutlass.Int32(1),
                                make_fake_stream(), options="--enable-tvm-ffi")
    except CatalogueError:
        raise
    except Exception as e:  # noqa: BLE001 - the DSL raises many types; all are compile errors
        raise CompileError(epi, e, "") from None
    _kernels[plan] = (compiled, getattr(compiled, "__cubin__", None))
    return _kernels[plan]


__all__ = ["CONFIG", "GEOMETRY", "Geometry", "Plan", "compile_call", "geometry", "plan_for", "run"]
