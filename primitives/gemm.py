"""``gemm(A, B, epilogue, **operands)``: the fixed mainloop with a program's epilogue.

The mainloop is quack's SM90 warp-specialized TMA + WGMMA GEMM; this module
validates the call (operands against the epilogue's declarations, shapes,
dtypes), picks the tile configuration, and hands off to the active lowering.
Everything it returns is a fresh tensor except ``accumulate_into``, which is
updated in place (the TMA reduce-add store: ``D += result``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from . import reference
from .epilogue import Epilogue
from .errors import CatalogueError
from .lowering import current_lowering, launching
from .operands import INPUT_DTYPES, OUTPUT_DTYPES


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


WIDE_TILE_GAIN = 1.08  # 128x192 over 128x128 throughput at equal wave count (H200 sweep)
H100_SMS = 132  # H100/H200 SXM; the count when no GPU is visible (compiling for sm_90a on CPU)


def _wave_cost(m: int, n: int, tile_m: int, tile_n: int, sms: int) -> int:
    """Tile area each SM works through: full waves of output tiles.  A persistent
    kernel with fewer tiles than SMs leaves the rest idle, and a last partial
    wave costs a whole one."""
    tiles = -(-m // tile_m) * -(-n // tile_n)
    return -(-tiles // sms) * tile_m * tile_n


def default_config(epi: Epilogue | None, operands: dict[str, Any], n: int | None = None,
                   m: int | None = None, sms: int = H100_SMS) -> TileConfig:
    """The tile configuration when nothing is tuned: rules read off the H200
    tuning sweeps of the suite (bench/results/h200-2026-11-29-b, LLaMA-3 1B,
    times in ms for the best rule config vs the runner-up rule):

    - a PairedTile epilogue (reads a packed tile as C, writes packed pairs) keeps
      twice the live registers per element: 128x128, clustered along N (dSwiGLU
      with the fast reciprocal, bench/results/h200-2026-11-29-d: 0.867 at c1x2,
      0.885 at c2x1, 1.31 at 128x192, 1.68 at 256x128 cooperative; c1x2 was
      also ahead in the sweep before, 1.088 vs 1.100);
    - N of at most 128 (a head-dim wide output) wastes a third of a 192 tile:
      128x128 (RoPE backward, N = 128: 0.140 vs 0.179), and N of at most 64
      half of that: 128x64 (N = 64: 0.136 vs 0.161; cuBLAS's plain GEMM 0.133);
    - an epilogue exposing reduction partials keeps 128-wide tiles, because the
      partials' layout (one column per N tile) is part of the program's contract;
    - a head statistic needs whole heads per tile: 128 (QK-norm + RoPE at
      head_dim 64: 0.197 at 128x128 c2, spill-free; 0.191 at 128x192, which
      spills);
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
    """
    if epi is None:
        return _fill_the_sms(m, n, sms, wide=_wide_plain(n))
    if epi.head_stats:
        hd = operands[next(iter(epi.head_stats))]
        return TileConfig(tile_n=128 if 128 % hd == 0 else hd)
    if epi.pairs not in (None, "acc"):
        return PAIRED_TILE_CONFIG
    if any(r.partials for r in epi.reductions.values()):
        return PARTIALS_CONFIG
    if n is not None and n <= 64:
        return NARROWEST_CONFIG
    if n is not None and n <= 128:
        return NARROW_CONFIG
    return _fill_the_sms(m, n, sms)


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


def _check_matrix(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise CatalogueError(f"gemm: {name} must be a 2-D tensor; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in INPUT_DTYPES:
        raise CatalogueError(f"gemm: {name} has dtype {t.dtype}; the mainloop takes bf16 or fp16 "
                             "(cast once at the weight's source, not per call)")
    return t


def check_call(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor,
               operands: dict[str, Any]) -> tuple[int, int, int]:
    _check_matrix("A", A)
    _check_matrix("B", B)
    (m, k), (k2, n) = A.shape, B.shape
    if k != k2:
        raise CatalogueError(f"gemm: A is {tuple(A.shape)} and B is {tuple(B.shape)}; B must be (K, N) "
                             f"with K = {k} (pass W.t() for a weight stored (N, K))")
    if A.dtype != B.dtype:
        raise CatalogueError(f"gemm: A is {A.dtype} and B is {B.dtype}; use one dtype")
    declared = set(epi.operands) | set(epi.index_operands) if epi is not None else set()
    given = set(operands)
    for extra in sorted(given - declared):
        near = difflib.get_close_matches(extra, sorted(declared), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        where = f"epilogue {epi.name!r} declares {sorted(declared)}" if epi else "a plain gemm takes none"
        raise CatalogueError(f"gemm: operand {extra!r} is not declared ({where}){hint}")
    for missing in sorted(declared - given):
        raise CatalogueError(f"gemm: epilogue {epi.name!r} needs operand {missing!r}; pass "  # type: ignore[union-attr]
                             f"gemm(A, B, {epi.name}, {missing}=...)")  # type: ignore[union-attr]
    if epi is not None:
        for name, kind in epi.operands.items():
            kind.check(name, operands[name], m, n)
            v = operands[name]
            if isinstance(v, torch.Tensor) and v.device != A.device:
                raise CatalogueError(f"gemm: operand {name!r} is on {v.device}, A on {A.device}")
        for idx in epi.index_operands:
            v = operands[idx]
            if not (isinstance(v, torch.Tensor) and v.dtype in (torch.int32, torch.int64)
                    and tuple(v.shape) == (m,)):
                raise CatalogueError(f"gemm: operand {idx!r} is the column index of a select_col and "
                                     f"must be an int32/int64 tensor of shape ({m},); got "
                                     f"{getattr(v, 'dtype', type(v).__name__)} "
                                     f"{tuple(getattr(v, 'shape', ()))}")
        if epi.pairs == "acc" and n % 2:
            raise CatalogueError(f"gemm: epilogue {epi.name!r} pairs adjacent columns, so N must be "
                                 f"even; got N = {n}")
    _check_alignment(epi, A, B, operands, n)
    return m, n, k


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes between consecutive rows of the tensor's non-contiguous dimension."""
    major = t.stride(0) if t.stride(-1) == 1 else t.stride(-1)
    return major * t.element_size()


def _check_alignment(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor,
                     operands: dict[str, Any], n: int) -> None:
    """TMA moves rows in 16-byte units: every tensor the kernel reads or writes
    needs a leading dimension that is a multiple of 16 bytes.  Checked in both
    lowerings, so a CPU verdict never accepts a shape the GPU would refuse (seen
    on an H200: a SwiGLU output of 628 bf16 columns was refused at launch)."""
    rows = {"A": _row_bytes(A), "B": _row_bytes(B)}
    if epi is None or epi.stores_d:
        rows["D"] = n * A.element_size() * (2 if epi is not None and epi.pairs not in (None, "acc") else 1)
    if epi is not None:
        width = n // 2 if epi.pairs == "acc" else n
        for name, dtype in epi.outputs.items():
            rows[f"output {name!r} ({width} columns)"] = width * dtype.itemsize
        for name, kind in epi.operands.items():
            if kind.port in ("tile", "paired"):
                rows[f"operand {name!r}"] = _row_bytes(operands[name])
    for what, nbytes in rows.items():
        if nbytes % 16:
            raise CatalogueError(
                f"gemm: {what} has rows of {nbytes} bytes; the mainloop's TMA copies need a multiple "
                "of 16 bytes (8 elements of 16 bits). Pad that dimension (e.g. the vocabulary or the "
                "hidden size) to a multiple of 8.")


def _sm_count(A: torch.Tensor) -> int:
    if A.is_cuda:
        return _device_sms(A.device.index if A.device.index is not None else torch.cuda.current_device())
    return H100_SMS


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tunable(epi: Epilogue | None) -> bool:
    # Exposed partials are laid out per tile_n: part of the program's contract.
    return epi is None or not any(r.partials for r in epi.reductions.values())


def gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Epilogue | None = None, *,
         out_dtype: str | None = None, config: TileConfig | None = None,
         accumulate_into: torch.Tensor | None = None, **operands: Any) -> dict[str, torch.Tensor]:
    """C = A @ B (fp32 accumulate) with ``epilogue`` applied to the tile on chip.

    A is (M, K), B is (K, N) (a transposed view such as ``W.t()`` is fine), both
    bf16 or fp16.  Operands are passed by the names the epilogue declares.
    ``out_dtype`` ("bf16", "fp16", "fp32") sets D's dtype (default: A's; a
    PairedTile epilogue writes D in that tile's dtype).  ``accumulate_into``
    adds D into an existing (M, N) tensor instead of returning a new one.
    Returns ``{"D": ..., <outputs>..., <reductions>...}``.
    """
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise CatalogueError("gemm: the third argument must be an @epilogue function (or None for a "
                             f"plain GEMM); got {type(epilogue).__name__}")
    m, n, _ = check_call(epilogue, A, B, operands)
    if out_dtype is not None and out_dtype not in OUTPUT_DTYPES:
        raise CatalogueError(f"gemm: out_dtype {out_dtype!r} is not one of {sorted(OUTPUT_DTYPES)}")
    dtype = OUTPUT_DTYPES[out_dtype] if out_dtype else A.dtype
    if epilogue is not None and epilogue.pairs not in (None, "acc"):
        dtype = operands[epilogue.pairs].dtype
    if accumulate_into is not None:
        if epilogue is not None and not epilogue.stores_d:
            raise CatalogueError(f"gemm: accumulate_into adds D, but epilogue {epilogue.name!r} "
                                 "returns no 'D'")
        want = (m, 2 * n) if epilogue is not None and epilogue.pairs not in (None, "acc") else (m, n)
        if not isinstance(accumulate_into, torch.Tensor) or tuple(accumulate_into.shape) != want:
            raise CatalogueError(f"gemm: accumulate_into must be a tensor of shape {want}")
    lowering = current_lowering(A, B)
    cfg = config
    if cfg is None and lowering == "cute":
        from .tuning import lookup

        cfg = lookup(epilogue, m, n, A.shape[1], A.dtype, A.device, operands)
        if cfg is None and accumulate_into is None and _tunable(epilogue):
            from .tuning import autotuning, tune

            if autotuning():
                cfg, _ = tune(epilogue, A, B, operands, out_dtype=out_dtype)
    cfg = cfg or default_config(epilogue, operands, n, m, _sm_count(A))
    for name in epilogue.head_stats if epilogue is not None else ():
        hd = operands[name]
        if cfg.tile_n % hd:
            raise CatalogueError(f"gemm: head statistic {name!r} needs whole heads in a tile: tile_n "
                                 f"{cfg.tile_n} is not a multiple of head_dim {hd}; use "
                                 f"TileConfig(tile_n={hd}) or a multiple of it")
    name = epilogue.name if epilogue is not None else "plain"
    if lowering == "reference":
        with launching("gemm", name, str(cfg)):
            return reference.run(epilogue, A, B, operands, out_dtype=dtype, tile_n=cfg.tile_n,
                                 accumulate_into=accumulate_into)
    from . import cute

    if lowering == "compile":
        return cute.compile_call(epilogue, A, B, operands, out_dtype=dtype, config=cfg,
                                 accumulate_into=accumulate_into)
    if not A.is_cuda:
        raise CatalogueError("gemm: the cute lowering runs on CUDA tensors; move the inputs to the "
                             "GPU or use lowering('reference')")
    with launching("gemm", name, str(cfg)):
        return cute.run(epilogue, A, B, operands, out_dtype=dtype, config=cfg,
                        accumulate_into=accumulate_into)


