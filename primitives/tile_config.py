"""Tile configurations of quack's SM90 GEMM, and the rule that picks one.

:class:`TileConfig` is what a program may pin (``gemm(..., config=...)``);
:func:`default_config` is what an untuned call gets, the rules read off the
H200 tuning sweeps of the suite; the tuner (:mod:`.tuning`) picks among
:data:`~.tuning.CANDIDATES` where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from .epilogue import Epilogue


PINGPONG_MAX_N = 208  # quack's SM90 pingpong kernel at 128-row tiles holds at most 208 columns
MAX_TILE_N = 256  # and its cooperative kernel 256 (at 16-column granularity)


@dataclass(frozen=True)
class TileConfig:
    """The knobs of quack's SM90 GEMM that decide epilogue-heavy speed.

    Measured on an H200 (the team's GPU notes, 2026-11-29): the dSwiGLU backward with a
    row reduction ran 2.86 ms at 128x192 pingpong, 1.26 ms at 128x128 pingpong;
    plain GEMMs prefer 128x192 with a 2-CTA cluster.
    """

    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True

    def __str__(self) -> str:
        return (f"{self.tile_m}x{self.tile_n} c{self.cluster_m}x{self.cluster_n} "
                f"{'pingpong' if self.pingpong else 'cooperative'}")

    def cooperative(self) -> TileConfig:
        """The same tile on quack's cooperative kernel (two warpgroups share it)."""
        return replace(self, pingpong=False)

    def to_quack(self) -> Any:
        """quack's GemmConfig, one object per distinct config: quack's eager fast
        path keys pinned configs by identity, so a fresh object per call would
        miss it every time (a full cold dispatch per GEMM) and grow its cache."""
        return _quack_config(self)


@lru_cache(maxsize=None)
def _quack_config(cfg: TileConfig) -> Any:
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=cfg.tile_m, tile_n=cfg.tile_n, cluster_m=cfg.cluster_m,
                      cluster_n=cfg.cluster_n, pingpong=cfg.pingpong, is_dynamic_persistent=False)


PLAIN_CONFIG = TileConfig()
SQUARE_CONFIG = TileConfig(tile_n=128, cluster_m=2)
PAIRED_TILE_CONFIG = TileConfig(tile_n=128, cluster_m=1, cluster_n=2)
NARROW_CONFIG = TileConfig(tile_n=128, cluster_m=1)
NARROWEST_CONFIG = TileConfig(tile_n=64, cluster_m=1)
PARTIALS_CONFIG = NARROW_CONFIG
WIDE_COOPERATIVE_CONFIG = TileConfig(tile_n=256, cluster_m=1, pingpong=False)
PASS_CONFIG = TileConfig(tile_m=256, tile_n=128, cluster_m=2, pingpong=False)


# Accumulator elements per thread that a promoting fp8 GEMM holds twice (the running fp32 sums and
# the promoted ones) without spilling: 128x192 cooperative (96) and 128x64 pingpong (64) compile
# spill-free, 128x128 pingpong, 128x256 and 256x128 cooperative (128) spill 96-270 STL/LDL in the
# sm_90a compile (the dSwiGLU, RMSNorm dx and dequantize epilogues alike).
PROMOTED_ACC_PER_THREAD = 96


def fits_promoted(cfg: TileConfig) -> bool:
    """Whether a promoting fp8 GEMM runs ``cfg`` without spilling its two accumulators: a
    pingpong tile lives in one warpgroup (128 threads), a cooperative one in two."""
    return cfg.tile_m * cfg.tile_n // (128 if cfg.pingpong else 256) <= PROMOTED_ACC_PER_THREAD


WIDE_TILE_GAIN = 1.08  # 128x192 over 128x128 throughput at equal wave count (H200 sweep)
H100_SMS = 132  # H100/H200 SXM; the count when no GPU is visible (compiling for sm_90a on CPU)


def _wave_cost(m: int, n: int, tile_m: int, tile_n: int, sms: int) -> int:
    """Tile area each SM works through: full waves of output tiles.  A persistent
    kernel with fewer tiles than SMs leaves the rest idle, and a last partial
    wave costs a whole one."""
    tiles = -(-m // tile_m) * -(-n // tile_n)
    return -(-tiles // sms) * tile_m * tile_n


def default_config(epi: Epilogue | None, operands: dict[str, Any], n: int | None = None,
                   m: int | None = None, sms: int = H100_SMS, fp8_promote: bool = False,
                   tile_pass: bool = False) -> TileConfig:
    """The tile configuration when nothing is tuned: rules read off the H200
    tuning sweeps of the suite (bench/results/h200-2026-11-29-b, LLaMA-3 1B,
    times in ms for the best rule config vs the runner-up rule):

    - a PairedTile epilogue (reads a packed tile as C, writes packed pairs) keeps
      twice the live registers per element: 128x128, clustered along N (dSwiGLU
      with the fast reciprocal, bench/results/h200-2026-11-29-d: 0.867 at c1x2,
      0.885 at c2x1, 1.31 at 128x192, 1.68 at 256x128 cooperative; c1x2 also
      leads with an IEEE-division sigmoid, 1.088 vs 1.100 in -b);
    - N of at most 128 (a head-dim wide output) wastes a third of a 192 tile:
      128x128 (RoPE backward, N = 128: 0.140 vs 0.179), and N of at most 64
      half of that: 128x64 (N = 64: 0.136 vs 0.161; cuBLAS's plain GEMM 0.133);
    - an epilogue exposing reduction partials keeps 128-wide tiles, because the
      partials' layout (one column per N tile) is part of the program's contract;
    - a head statistic needs whole heads per tile: 128 (QK-norm + RoPE at
      head_dim 64: 0.197 at 128x128 c2, spill-free; 0.191 at 128x192, which
      spills); a head wider than a pingpong tile holds (:data:`PINGPONG_MAX_N`,
      head_dim 256) runs cooperative;
    - a tile pass on quack's zero mainloop (one k-step: a pass the pass kernel does not
      stream, see primitives/pass_kernel.py) is bound by its epilogue's
      loads and stores alone, and both warpgroups of a cooperative kernel run that epilogue:
      256x128 c2x1 cooperative (bench/results/h200-2026-12-01-d, tuned at T = 16384: dGELU of
      an incoming (16384, 16384) gradient with its bias gradient 0.762 ms against 1.421 at
      128x192 c2x1 pingpong and 0.837 at 128x256 cooperative; the row moments of a
      (16384, 4096) activation 0.086 vs 0.097; the LayerNorm weight fold 0.135 vs 0.159);
    - an epilogue that folds reductions in both directions (a ``row_sum`` down the columns
      and a ``col_sum`` along the rows: dGELU with its bias gradient and LayerNorm-backward
      statistics) runs 128x128 c2x1: at (16384, 16384, 4096) 3.09 ms against 6.27 at
      128x192 c2x1 (-d, tuned), where the single-direction LayerNorm backward (three
      ``row_sum``) keeps 128x192 (3.15 vs 3.20);
    - everything else, row reductions included, runs best on quack's plain
      128x192 with a 2-CTA cluster (online LSE + target select 12.1 vs 16.1 at
      128x128; the RMSNorm dx epilogue 1.47 vs 2.06), even where the wider tile
      spills a few registers (the logits + LSE epilogue: 26 STL/LDL, still the
      fastest).  The compile stage reports spills; ``bench/run.py`` tunes.
    - except where that tile leaves SMs idle: with few output tiles (the dx GEMM
      of a 1024-row LM-head chunk: 88 tiles of 128x192 on 132 SMs, 128 of
      128x128), 128x128 c2 when its whole waves cost less, counting the wide
      tile's better throughput (WIDE_TILE_GAIN).  (1024, 2048, 128256): 0.679
      vs 0.879; N = 4096: 1.379 vs 1.863; N = 8192, about even: 2.987 vs 3.036.
    - a plain GEMM whose N the 192 tile pads by 10% or more (N = 512, 1024: the
      K/V projections) and a 256 tile divides: 128x256 cooperative, which pads
      nothing and has the wide tile's throughput (bench/results/h200-2026-11-29-f
      and -b, tuned; 128x256 coop / 128x128 c2 / 128x192 c2): (16384, 1024,
      4096) 0.181 / 0.199 / 0.207; K = 8192: 0.366 / 0.390 / 0.407; (16384,
      512, 2048) 0.050 / 0.052 / 0.057.  Not with an epilogue: both warpgroups
      of a cooperative kernel run the epilogue while its tensor cores idle
      (dSwiGLU 1.62 vs 1.09 at 128x128), and not where 192 pads little: (16384, 8192,
      2048) 0.716 vs 0.684, (2048, 16384, 16384) 1.543 vs 1.427.
    - an fp8 GEMM that promotes its partial sums (``fast_accum=False``) keeps a
      second fp32 accumulator: the tile of any rule above that would spill
      (:func:`fits_promoted`) runs cooperative (two warpgroups per tile, half
      the accumulator registers each), and at 128x128 where even that spills
      (the 256-wide and 256-row cooperative tiles).  Pingpong 128x192 holds 384
      accumulator registers per thread and spilled 313/409 STL/LDL in the
      sm_90a compile; cooperative compiled spill-free.
    """
    cfg = _rule_config(epi, operands, n, m, sms, tile_pass)
    if fp8_promote and not fits_promoted(cfg):
        cfg = cfg.cooperative()
        if not fits_promoted(cfg) and not (epi is not None and epi.head_stats):  # a head fixes tile_n
            cfg = replace(cfg, tile_m=128, tile_n=128)
    return cfg


def _rule_config(epi: Epilogue | None, operands: dict[str, Any], n: int | None, m: int | None,
                 sms: int, tile_pass: bool) -> TileConfig:
    if epi is None:
        return _fill_the_sms(m, n, sms, wide=_wide_plain(n))
    if epi.head_stats:
        hd = operands[next(iter(epi.head_stats))]
        tile_n = 128 if 128 % hd == 0 else hd
        return TileConfig(tile_n=tile_n, pingpong=tile_n <= PINGPONG_MAX_N)
    if epi.paired_operand:
        return PAIRED_TILE_CONFIG
    if any(r.partials for r in epi.reductions.values()):
        return PARTIALS_CONFIG
    if tile_pass:
        return PASS_CONFIG
    if _both_directions(epi):
        return SQUARE_CONFIG
    if n is not None and n <= 64:
        return NARROWEST_CONFIG
    if n is not None and n <= 128:
        return NARROW_CONFIG
    return _fill_the_sms(m, n, sms)


def lean_staging(cfg: TileConfig, epi: Epilogue | None, fp8_promote: bool = False) -> TileConfig | None:
    """The config an untuned call falls back to when ``cfg`` leaves too few
    mainloop stages (:class:`.dsl_scope.StageShortage`): 128x128 c1x1 pingpong,
    whose epilogue stages one 128-row tile per warpgroup, the least shared memory
    of the 128-wide tiles (an erf/GELU pass over an fp32 tile with three fp32
    outputs compiles there and leaves no stage at the pass rule's 256x128), or
    for a promoting fp8 GEMM, whose two accumulators that tile cannot hold, its
    cooperative form.  None where nothing leaner applies: ``cfg`` is that config
    already, or a head statistic fixes its tile_n."""
    if epi is not None and epi.head_stats:
        return None
    lean = NARROW_CONFIG.cooperative() if fp8_promote else NARROW_CONFIG
    return None if cfg == lean else lean


def _both_directions(epi: Epilogue) -> bool:
    """Whether the epilogue folds a total per output column and another per output row."""
    return len({r.per_column for r in epi.reductions.values()}) > 1


def _wide_plain(n: int | None) -> TileConfig:
    """The wide tile for a plain GEMM: 128x192, or 128x256 cooperative where
    192 would pad N by 10% or more and 256 pads nothing."""
    if n is not None and n % 256 == 0 and -(-n // PLAIN_CONFIG.tile_n) * PLAIN_CONFIG.tile_n >= 1.1 * n:
        return WIDE_COOPERATIVE_CONFIG
    return PLAIN_CONFIG


def _fill_the_sms(m: int | None, n: int | None, sms: int, wide: TileConfig = PLAIN_CONFIG) -> TileConfig:
    """``wide``, or 128x128 c2 where its whole waves cost less (see default_config)."""
    if m is None or n is None:
        return wide
    wide_cost = _wave_cost(m, n, wide.tile_m, wide.tile_n, sms)
    square = _wave_cost(m, n, SQUARE_CONFIG.tile_m, SQUARE_CONFIG.tile_n, sms)
    return SQUARE_CONFIG if square * WIDE_TILE_GAIN < wide_cost else wide


def tunable(epi: Epilogue | None) -> bool:
    """Whether the tuner may pick this call's config: exposed reduction partials
    are laid out per ``tile_n``, part of the program's contract."""
    return epi is None or not any(r.partials for r in epi.reductions.values())
