"""The CuTeDSL side of :mod:`.pass_kernel` (this module imports cutlass; the
catalogue imports it only when a pass kernel compiles).

One CTA covers TILE_M x TILE_N of the output; thread ``t`` owns the VEC
columns starting at ``(t % LANES) * VEC`` in rows ``t // LANES + ROWS * i``
(with a PairedTile, VEC pairs: 2 x VEC elements of the paired tensors).
The kernel is straight-line at trace time except for the row and column
predicates (``if`` on traced values, which the DSL turns into branches): a
load, the fn's math and a store happen only for real elements, and a fold
accumulates only them; the warp shuffles and the barrier sit outside every
branch, where all lanes reach them.
"""

from __future__ import annotations

import math
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass import Float32, Int32, const_expr
from quack.cute_dsl_utils import torch2cute_dtype_map

from .epilogue import Epilogue
from .errors import CatalogueError
from .pair import Pair
from .pass_kernel import LANES, ROWS, THREADS, TILE_N, VEC, WARPS, Plan


class PassKernel:
    def __init__(self, epi: Epilogue, plan: Plan):
        self.fn = epi.fn
        self.plan = plan
        p = plan
        self.n_tiles, self.n_rows, self.n_cols = len(p.tiles) + (p.pair is not None), len(p.rows), len(p.cols)
        # Lanes per column of each store: a paired D holds both lanes of each pair.
        self.store_lanes = tuple(2 if p.pair is not None and name == "D" else 1 for name, _ in p.stores)
        self.tile_widths = (VEC,) * len(p.tiles) + ((2 * VEC,) if p.pair is not None else ())
        self.n_stores, self.n_per_row, self.n_per_col = len(p.stores), len(p.per_row), len(p.per_col)
        self.store_names = tuple(name for name, _ in p.stores)
        self.store_dtypes = tuple(torch2cute_dtype_map[dt] for _, dt in p.stores)
        self.identity = tuple(0.0 if op == "add" else -math.inf for _, op in p.per_row)
        self.rows_in_flight, self.chunks, self.tile_m = p.geometry.rows_in_flight, p.geometry.chunks, p.geometry.tile_m

    def _args(self, tiles: list, rows: list, cols: list, i: int, j: int) -> dict[str, Any]:
        """The fn's keyword arguments for element (row i of the thread, column j of its vector);
        ``tiles`` holds row i's values of each Tile, then of the PairedTile (two lanes a column)."""
        p = self.plan
        args: dict[str, Any] = {name: Float32(v) for name, v in p.scalars}
        args.update({name: tiles[k][j] for k, (name, _) in enumerate(p.tiles)})
        if p.pair is not None:
            lanes = tiles[len(p.tiles)]
            args[p.pair[0]] = Pair(lanes[2 * j], lanes[2 * j + 1])
        args.update({name: rows[k][j] for k, (name, _) in enumerate(p.rows)})
        args.update({name: cols[k][i] for k, (name, _) in enumerate(p.cols)})
        return args

    def _lanes(self, res: dict[str, Any], k: int) -> tuple[Any, ...]:
        """Store k's values of one column: both lanes of a paired D, else the one value."""
        name, value = self.store_names[k], res[self.store_names[k]]
        if self.store_lanes[k] == 2:
            if not isinstance(value, Pair):
                raise CatalogueError(f"a paired pass returns D as pack(a, b); got a single value for {name!r}")
            return Float32(value.a), Float32(value.b)
        if isinstance(value, Pair):
            raise CatalogueError(f"output {name!r} of a paired pass holds one value per pair, not a Pair: "
                                 "store both lanes through D")
        return (Float32(value),)

    @cute.jit
    def __call__(self, tensors: tuple, m: Int32, n: Int32, stream: Any):
        self.kernel(tensors, m, n).launch(grid=[cute.ceil_div(n, TILE_N), cute.ceil_div(m, self.tile_m), 1],
                                          block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tensors: tuple, m: Int32, n: Int32):
        p = self.plan
        nt, nr, nc, ns = self.n_tiles, self.n_rows, self.n_cols, self.n_stores
        mtiles = tensors[:nt]
        mrows = tensors[nt:nt + nr]
        mcols = tensors[nt + nr:nt + nr + nc]
        mstores = tensors[nt + nr + nc:nt + nr + nc + ns]
        mper_row = tensors[nt + nr + nc + ns:nt + nr + nc + ns + self.n_per_row]
        mper_col = tensors[nt + nr + nc + ns + self.n_per_row:]

        tidx, _, _ = cute.arch.thread_idx()
        bn, bm, _ = cute.arch.block_idx()
        lane_n = tidx % LANES
        row0 = bm * self.tile_m + tidx // LANES
        col = bn * TILE_N + lane_n * VEC
        vec = col // VEC

        # Per-column operands: this thread's VEC columns, once.
        rows = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(nr)]
        for k in cutlass.range_constexpr(nr):
            rows[k].fill(0.0)
            if col < n:
                raw = cute.make_rmem_tensor((VEC,), mrows[k].element_type)
                cute.autovec_copy(cute.local_tile(mrows[k], (VEC,), (vec,)), raw)
                rows[k].store(raw.load().to(Float32))
        # Folds down the columns (row_sum): this thread's VEC columns over its rows.
        col_acc = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(self.n_per_col)]
        for r in cutlass.range_constexpr(self.n_per_col):
            col_acc[r].fill(0.0)

        for c in cutlass.range_constexpr(self.chunks):
            base = row0 + c * ROWS * self.rows_in_flight
            # Raw 16-byte fragments (converted per row in the math below: half the registers of fp32).
            tiles = [[cute.make_rmem_tensor((self.tile_widths[k],), t.element_type)
                      for _ in range(self.rows_in_flight)] for k, t in enumerate(mtiles)]
            olds = [[cute.make_rmem_tensor((VEC * self.store_lanes[0],), mstores[0].element_type)
                     for _ in range(self.rows_in_flight)] for _ in range(1 if p.accumulate else 0)]
            cols = [cute.make_rmem_tensor((self.rows_in_flight,), Float32) for _ in range(nc)]
            row_acc = [cute.make_rmem_tensor((self.rows_in_flight,), Float32) for _ in range(self.n_per_row)]
            for k in cutlass.range_constexpr(self.n_per_row):
                row_acc[k].fill(self.identity[k])
            # Loads of rows_in_flight rows before any math: their latencies overlap.
            for i in cutlass.range_constexpr(self.rows_in_flight):
                row = base + i * ROWS
                if row < m:
                    for k in cutlass.range_constexpr(nc):
                        cols[k][i] = Float32(mcols[k][row])
                    if col < n:
                        for k in cutlass.range_constexpr(nt):
                            width = self.tile_widths[k]
                            cute.autovec_copy(cute.local_tile(mtiles[k], (1, width), (row, vec)), tiles[k][i])
                        if const_expr(p.accumulate):
                            width = VEC * self.store_lanes[0]
                            cute.autovec_copy(cute.local_tile(mstores[0], (1, width), (row, vec)), olds[0][i])
            for i in cutlass.range_constexpr(self.rows_in_flight):
                row = base + i * ROWS
                if row < m:
                    if col < n:
                        outs = [cute.make_rmem_tensor((VEC * self.store_lanes[k],), Float32) for k in range(ns)]
                        values = [t[i].load().to(Float32) for t in tiles]
                        before = [t[i].load().to(Float32) for t in olds]
                        for j in cutlass.range_constexpr(VEC):
                            res = self.fn(**self._args(values, rows, cols, i, j))
                            for k in cutlass.range_constexpr(ns):
                                for lane, value in enumerate(self._lanes(res, k)):
                                    at = self.store_lanes[k] * j + lane
                                    if const_expr(p.accumulate and k == 0):
                                        # D += the result rounded to D's dtype, as the TMA reduce-add store adds.
                                        value = before[0][at] + Float32(self.store_dtypes[0](value))
                                    outs[k][at] = value
                            for k in cutlass.range_constexpr(self.n_per_row):
                                name, op = p.per_row[k]
                                value = _folded(res[name], op)
                                if const_expr(op == "add"):
                                    row_acc[k][i] = row_acc[k][i] + value
                                else:
                                    row_acc[k][i] = cute.arch.fmax(row_acc[k][i], value)
                            for r in cutlass.range_constexpr(self.n_per_col):
                                col_acc[r][j] = col_acc[r][j] + Float32(res[p.per_col[r]])
                        for k in cutlass.range_constexpr(ns):
                            width = VEC * self.store_lanes[k]
                            raw = cute.make_rmem_tensor((width,), self.store_dtypes[k])
                            raw.store(outs[k].load().to(self.store_dtypes[k]))
                            cute.autovec_copy(raw, cute.local_tile(mstores[k], (1, width), (row, vec)))
            # Per-row folds: the row's 16 threads, by shuffles (every lane takes part).
            for k in cutlass.range_constexpr(self.n_per_row):
                op = p.per_row[k][1]
                for i in cutlass.range_constexpr(self.rows_in_flight):
                    value = row_acc[k][i]
                    for offset in (8, 4, 2, 1):
                        other = cute.arch.shuffle_sync_bfly(value, offset=offset)
                        if const_expr(op == "add"):
                            value = value + other
                        else:
                            value = cute.arch.fmax(value, other)
                    row = base + i * ROWS
                    if lane_n == 0:
                        if row < m:
                            mper_row[k][row, bn] = value

        if const_expr(self.n_per_col > 0):
            smem = cutlass.utils.SmemAllocator()
            warp = tidx // 32
            for r in cutlass.range_constexpr(self.n_per_col):
                buf = smem.allocate_tensor(Float32, cute.make_layout((WARPS, TILE_N), stride=(TILE_N, 1)),
                                           byte_alignment=16)
                for j in cutlass.range_constexpr(VEC):
                    # Lanes l and l + 16 of a warp hold the same columns.
                    col_acc[r][j] = col_acc[r][j] + cute.arch.shuffle_sync_bfly(col_acc[r][j], offset=16)
                if tidx % 32 < LANES:
                    for j in cutlass.range_constexpr(VEC):
                        buf[warp, lane_n * VEC + j] = col_acc[r][j]
                cute.arch.sync_threads()
                if tidx < TILE_N:
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        total = total + buf[w, tidx]
                    if bn * TILE_N + tidx < n:
                        mper_col[r][bm, bn * TILE_N + tidx] = total


def _folded(value: Any, op: str) -> Any:
    """A per-row fold's value of one column: a Pair's two lanes folded into one (sum or max)."""
    if not isinstance(value, Pair):
        return Float32(value)
    a, b = Float32(value.a), Float32(value.b)
    return a + b if op == "add" else cute.arch.fmax(a, b)
