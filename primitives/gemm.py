"""``gemm(A, B, epilogue, **operands)``: the fixed mainloop with a program's epilogue.

The mainloop is quack's SM90 warp-specialized TMA + WGMMA GEMM; this module
validates the call (operands against the epilogue's declarations, shapes,
dtypes), picks the tile configuration, and hands off to the active lowering.
Everything it returns is a fresh tensor except ``accumulate_into``, which is
updated in place (the TMA reduce-add store: ``D += result``).
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any

import torch

from . import cute, fp8, reference
from .epilogue import Epilogue
from .errors import CatalogueError
from .lowering import current_lowering, launching
from .operands import INPUT_DTYPES, OUTPUT_DTYPES, row_bytes
from .tile_config import H100_SMS, TileConfig, default_config, tunable
from .tuning import autotuning, lookup, tune


def _check_matrix(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise CatalogueError(f"gemm: {name} must be a 2-D tensor; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in INPUT_DTYPES and not fp8.is_fp8(t.dtype):
        raise CatalogueError(f"gemm: {name} has dtype {t.dtype}; the mainloop takes bf16, fp16 or fp8 "
                             "(e4m3/e5m2; cast once at the weight's source, not per call)")
    return t


def check_operands(epi: Epilogue, operands: dict[str, Any], m: int, n: int, device: torch.device,
                   call: str) -> None:
    """The operands given to ``call`` against the epilogue's declarations: names,
    kinds and shapes for an (m, n) output, and one device."""
    what = call.split("(")[0]
    declared = set(epi.operands) | set(epi.index_operands)
    for extra in sorted(set(operands) - declared):
        near = difflib.get_close_matches(extra, sorted(declared), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise CatalogueError(f"{what}: operand {extra!r} is not declared (epilogue {epi.name!r} declares "
                             f"{sorted(declared)}){hint}")
    for missing in sorted(declared - set(operands)):
        raise CatalogueError(f"{what}: epilogue {epi.name!r} needs operand {missing!r}; pass "
                             f"{call.replace('...', f'{missing}=...')}")
    for name, kind in epi.operands.items():
        kind.check(name, operands[name], m, n)
        v = operands[name]
        if isinstance(v, torch.Tensor) and v.device != device:
            raise CatalogueError(f"{what}: operand {name!r} is on {v.device}, the call's tensors on {device}")
    for idx in epi.index_operands:
        v = operands[idx]
        if not (isinstance(v, torch.Tensor) and v.dtype in (torch.int32, torch.int64)
                and tuple(v.shape) == (m,)):
            raise CatalogueError(f"{what}: operand {idx!r} is the column index of a select_col and "
                                 f"must be an int32/int64 tensor of shape ({m},); got "
                                 f"{getattr(v, 'dtype', type(v).__name__)} "
                                 f"{tuple(getattr(v, 'shape', ()))}")


def check_call(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
               call: str, out_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
    """Validate ``call`` (``out_dtype``: D's, default A's) and return (M, N, K)."""
    _check_matrix("A", A)
    _check_matrix("B", B)
    (m, k), (k2, n) = A.shape, B.shape
    if k != k2:
        raise CatalogueError(f"gemm: A is {tuple(A.shape)} and B is {tuple(B.shape)}; B must be (K, N) "
                             f"with K = {k} (pass W.t() for a weight stored (N, K))")
    if fp8.is_fp8(A.dtype) or fp8.is_fp8(B.dtype):
        fp8.check_operands(A, B)
    elif A.dtype != B.dtype:
        raise CatalogueError(f"gemm: A is {A.dtype} and B is {B.dtype}; use one dtype")
    if epi is None and operands:
        raise CatalogueError(f"gemm: operand {sorted(operands)[0]!r} is not declared (a plain gemm takes none)")
    if epi is not None:
        check_operands(epi, operands, m, n, A.device, call)
        if epi.pairs_acc and n % 2:
            raise CatalogueError(f"gemm: epilogue {epi.name!r} pairs adjacent columns, so N must be "
                                 f"even; got N = {n}")
    _check_alignment(epi, A, B, operands, n, out_dtype or A.dtype, call.split("(")[0])
    return m, n, k


def _check_alignment(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor,
                     operands: dict[str, Any], n: int, d_dtype: torch.dtype, caller: str) -> None:
    """TMA moves rows in 16-byte units: every tensor the kernel reads or writes
    needs a leading dimension that is a multiple of 16 bytes.  Checked in both
    lowerings, so a CPU verdict never accepts a shape the GPU refuses (on an
    H200 quack refuses a SwiGLU output of 628 bf16 columns at launch)."""
    rows = {"A": row_bytes(A), "B": row_bytes(B)}
    if epi is None:
        rows["D"] = n * d_dtype.itemsize
    else:
        if epi.stores_d:
            rows["D"] = epi.d_shape(1, n)[1] * d_dtype.itemsize
        width = epi.output_width(n)
        for name, dtype in epi.outputs.items():
            rows[f"output {name!r} ({width} columns)"] = width * dtype.itemsize
        for name, kind in epi.operands.items():
            if (nbytes := kind.tma_row_bytes(operands[name])) is not None:
                rows[f"operand {name!r}"] = nbytes
    for what, nbytes in rows.items():
        if nbytes % 16:
            raise CatalogueError(
                f"{caller}: {what} has rows of {nbytes} bytes; the mainloop's TMA copies need a multiple "
                "of 16 bytes (8 elements of 16 bits, 16 of fp8). Pad that dimension (e.g. the "
                "vocabulary or the hidden size) to a multiple of 8 (16 for fp8).")


def _sm_count(A: torch.Tensor) -> int:
    if A.is_cuda:
        return _device_sms(A.device.index if A.device.index is not None else torch.cuda.current_device())
    return H100_SMS


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Epilogue | None = None, *,
         out_dtype: str | None = None, config: TileConfig | None = None,
         accumulate_into: torch.Tensor | None = None, fast_accum: bool = False,
         **operands: Any) -> dict[str, torch.Tensor]:
    """C = A @ B (fp32 accumulate) with ``epilogue`` applied to the tile on chip.

    A is (M, K), B is (K, N) (a transposed view such as ``W.t()`` is fine), both
    bf16 or fp16, or both fp8 (e4m3/e5m2, K-major: see the FP8 section; their
    scales are epilogue operands).  Operands are passed by the names the
    epilogue declares.  ``out_dtype`` ("bf16", "fp16", "fp32", "fp8_e4m3",
    "fp8_e5m2") sets D's dtype (default: A's, bf16 for fp8 A; a PairedTile
    epilogue writes D in that tile's dtype).  ``accumulate_into`` adds D into
    an existing (M, N) tensor instead of returning a new one.  ``fast_accum``
    (fp8 only) keeps the whole K loop in the tensor core's accumulator instead
    of promoting to fp32 after every K tile: faster, fewer bits.
    Returns ``{"D": ..., <outputs>..., <reductions>...}``.
    """
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise CatalogueError("gemm: the third argument must be an @epilogue function (or None for a "
                             f"plain GEMM); got {type(epilogue).__name__}")
    if epilogue is not None and not epilogue.reads_acc:
        raise CatalogueError(f"gemm: epilogue {epilogue.name!r} takes no `acc`, so it is a pass without a "
                             f"GEMM: run it with tile_pass({epilogue.name}, ...) over tiles, or vector_pass over "
                             "per-row or per-column vectors (a GEMM epilogue's first parameter is `acc`)")
    return launch(epilogue, A, B, operands, out_dtype=out_dtype, config=config,
                  accumulate_into=accumulate_into, fast_accum=fast_accum, kind="gemm")


def launch(epilogue: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
           out_dtype: str | None, config: TileConfig | None, accumulate_into: torch.Tensor | None,
           kind: str, fast_accum: bool = False) -> dict[str, torch.Tensor]:
    """One mainloop + epilogue through the active lowering, recorded in the
    launch ledger as ``kind`` ("gemm", or "pass" for a tile pass's zero
    mainloop): validation, the output dtype, the tile configuration (tuned,
    cached or the default) and the dispatch that :func:`gemm` and
    :func:`coda_agent.primitives.passes.tile_pass` share."""
    name = epilogue.name if epilogue is not None else "plain"
    what = "tile_pass" if kind == "pass" else "gemm"
    if out_dtype is not None and out_dtype not in OUTPUT_DTYPES:
        raise CatalogueError(f"{what}: out_dtype {out_dtype!r} is not one of {sorted(OUTPUT_DTYPES)}")
    _check_matrix("A", A)
    on_fp8 = fp8.is_fp8(A.dtype)
    if not isinstance(fast_accum, bool) or (fast_accum and not on_fp8):
        raise CatalogueError(f"{what}: fast_accum=True is a choice of the fp8 mainloop (A and B in fp8); "
                             "drop it for a 16-bit GEMM")
    dtype = OUTPUT_DTYPES[out_dtype] if out_dtype else (torch.bfloat16 if on_fp8 else A.dtype)
    if epilogue is not None and isinstance(operands.get(epilogue.paired_operand), torch.Tensor):
        dtype = operands[epilogue.paired_operand].dtype
    m, n, _ = check_call(epilogue, A, B, operands,
                         f"tile_pass({name}, ...)" if kind == "pass" else f"gemm(A, B, {name}, ...)", dtype)
    if accumulate_into is not None:
        if epilogue is not None and not epilogue.stores_d:
            raise CatalogueError(f"{what}: accumulate_into adds D, but epilogue {epilogue.name!r} "
                                 "returns no 'D'")
        want = epilogue.d_shape(m, n) if epilogue is not None else (m, n)
        if not isinstance(accumulate_into, torch.Tensor) or tuple(accumulate_into.shape) != want:
            raise CatalogueError(f"{what}: accumulate_into must be a tensor of shape {want}")
        if fp8.is_fp8(accumulate_into.dtype):
            raise CatalogueError(f"{what}: accumulate_into adds with the TMA reduce-add store, which takes "
                                 "fp32, bf16 or fp16; accumulate in one of those")
    lowering = current_lowering(A, B)
    cfg = config
    if cfg is None and lowering == "cute":
        cfg = lookup(epilogue, m, n, A.shape[1], fp8.mainloop_key(A, B, fast_accum), A.device, operands)
        if cfg is None and accumulate_into is None and tunable(epilogue) and autotuning():
            cfg, _ = tune(epilogue, A, B, operands, out_dtype=dtype, fast_accum=fast_accum)
    cfg = cfg or default_config(epilogue, operands, n, m, _sm_count(A), fp8_promote=on_fp8 and not fast_accum)
    for stat in epilogue.head_stats if epilogue is not None else ():
        hd = operands[stat]
        if cfg.tile_n % hd:
            raise CatalogueError(f"gemm: head statistic {stat!r} needs whole heads in a tile: tile_n "
                                 f"{cfg.tile_n} is not a multiple of head_dim {hd}; use "
                                 f"TileConfig(tile_n={hd}) or a multiple of it")
    if lowering == "reference":
        with launching(kind, name, str(cfg)):
            return reference.run(epilogue, A, B, operands, out_dtype=dtype, tile_m=cfg.tile_m, tile_n=cfg.tile_n,
                                 accumulate_into=accumulate_into)
    if lowering == "compile":
        return cute.compile_call(epilogue, A, B, operands, out_dtype=dtype, config=cfg,
                                 accumulate_into=accumulate_into, fast_accum=fast_accum)
    if not A.is_cuda:
        raise CatalogueError(f"{what}: the cute lowering runs on CUDA tensors; move the inputs to the "
                             "GPU or use lowering('reference')")
    with launching(kind, name, str(cfg)):
        return cute.run(epilogue, A, B, operands, out_dtype=dtype, config=cfg,
                        accumulate_into=accumulate_into, fast_accum=fast_accum)


