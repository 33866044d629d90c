"""``gemm(A, B, epilogue, **operands)``: the fixed mainloop with a program's epilogue.

The mainloop is quack's SM90 warp-specialized TMA + WGMMA GEMM; this module
validates the call (operands against the epilogue's declarations, shapes,
dtypes), allocates what it returns, and launches through a ``torch.library``
custom op, which picks the tile configuration and hands off to the active
lowering (in eager mode the op's body is called directly where nothing could
tell the difference: :mod:`.dispatch`). Everything it returns is a fresh
tensor except ``accumulate_into`` (the TMA reduce-add store: ``D += result``)
and ``out`` (D written over it).

``out`` names a buffer that is dead after the call, and the catalogue holds a
program to that in two places.  While torch.compile traces, D gets a buffer of
its own instead: the buffer a backward writes over is a saved activation, an
input of the compiled backward graph, and inductor cannot write into a graph's
input, so it would copy the whole tensor first (a (T, 2I) pre-activation per
MLP layer, 0.25-0.45 ms at LLaMA-3 1B and 8B widths on the H200); a new D
costs no copy, and the dead buffer's storage is the compiler's to reuse.  The
reference lowering writes D to a new tensor too and fills ``out`` with NaN, so
a program that reads the buffer after the call fails the verifier's CPU stage
instead of computing something else under torch.compile than in the verifier.

Why custom ops: ``torch.compile`` traces a model that calls ``gemm`` (the
program's Python, the checks, the allocation) and keeps each launch as one
opaque op, so nothing breaks the graph and the rest of the model is compiled
around the launches.  The lowering, the tuning cache and the launch ledger
(ContextVars and files, which Dynamo cannot trace) are read inside the op, when
it runs.  Two ops:

- ``coda::gemm(epilogue key, A, B, tensors, scalars, ints, results, accumulate,
  config, fast_accum, kind)``: every launch with an epilogue, into a given
  tensor, or of fp8 operands, and every tile pass (``kind`` "pass": the zero
  mainloop of :mod:`.passes`, recorded as such in the ledger).  The
  epilogue travels as its registry key (``Epilogue.key``), its operands as
  three lists in declared order (``Kind.op_argument``), and the op fills
  ``results``, the buffers the wrapper allocated (``Epilogue.result_buffers``:
  a functionalised op may not return a list of tensors and mutate too, and
  preallocated results keep its fake a no-op).  No autograd: an epilogue has no
  generic derivative; a program's backward is its own (``coda_agent.kernels``).
- ``coda::mm(A, B, out_dtype, config)``: the plain 16-bit GEMM, functional, with
  its derivative registered (dA = dD @ B^T, dB = A^T @ dD, both coda::mm).

``config`` is the explicit TileConfig as five ints, or empty: chosen at launch.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any

import torch

from . import cute, fp8, pass_kernel, reference
from .dispatch import direct, mutated
from .epilogue import Epilogue, registered
from .destination import check_destination
from .errors import CatalogueError
from .lowering import current_lowering, launching, plain_gemm_library, profiler_range
from .operands import INPUT_DTYPES, OUTPUT_DTYPES, row_bytes
from .dsl_scope import StageShortage
from .tile_config import H100_SMS, MAX_TILE_N, TileConfig, default_config, lean_staging, tunable
from .tuning import lookup, tunable_now, tune

PLAIN = "plain"  # the op's name for "no epilogue"


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
                "of 16 bytes (8 elements of 16 bits, 16 of fp8). Pad that dimension to a multiple of 8 "
                "(16 for fp8) with `pad(x, rows=..., cols=...)` (zeros; mask what they add in the "
                "epilogue and read back the first columns, `[:, :n]`), or pad the model's (the vocabulary).")


def _sm_count(A: torch.Tensor) -> int:
    if A.is_cuda:
        return _device_sms(A.device.index if A.device.index is not None else torch.cuda.current_device())
    return H100_SMS


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemm(A: torch.Tensor, B: torch.Tensor, epilogue: Epilogue | None = None, *,
         out_dtype: str | None = None, config: TileConfig | None = None,
         accumulate_into: torch.Tensor | None = None, out: torch.Tensor | None = None,
         fast_accum: bool = False, **operands: Any) -> dict[str, torch.Tensor]:
    """C = A @ B (fp32 accumulate) with ``epilogue`` applied to the tile on chip.

    A is (M, K), B is (K, N) (a transposed view such as ``W.t()`` is fine), both
    bf16 or fp16, or both fp8 (e4m3/e5m2, K-major: see the FP8 section; their
    scales are epilogue operands).  Operands are passed by the names the
    epilogue declares.  ``out_dtype`` ("bf16", "fp16", "fp32", "fp8_e4m3",
    "fp8_e5m2") sets D's dtype (default: A's, bf16 for fp8 A; a PairedTile
    epilogue writes D in that tile's dtype).  ``accumulate_into`` adds D into
    an existing (M, N) tensor instead of returning a new one.
    ``out`` writes D over an existing tensor of D's shape and dtype: a buffer
    that is dead after this GEMM, which may be a Tile or the PairedTile the
    epilogue reads (each element is read before it is written), e.g. the saved
    pre-activation in the SwiGLU backward; never A or B.  Use the returned D:
    the reference lowering fills ``out`` with NaN after the call, and under
    torch.compile D gets a buffer of its own.  ``fast_accum`` (fp8
    only) keeps the whole K loop in the tensor core's accumulator instead of
    promoting to fp32 after every K tile: faster, fewer bits.
    Returns ``{"D": ..., <outputs>..., <reductions>...}``.
    """
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise CatalogueError("gemm: the third argument must be an @epilogue function (or None for a "
                             f"plain GEMM); got {type(epilogue).__name__}")
    if epilogue is not None and not epilogue.reads_acc:
        raise CatalogueError(f"gemm: epilogue {epilogue.name!r} takes no `acc`, so it is a pass without a "
                             f"GEMM: run it with tile_pass({epilogue.name}, ...) over tiles, or vector_pass over "
                             "per-row or per-column vectors (a GEMM epilogue's first parameter is `acc`)")
    return launch(epilogue, A, B, operands, out_dtype=out_dtype, config=config, accumulate_into=accumulate_into,
                  out=out, fast_accum=fast_accum, kind="gemm")


def launch(epilogue: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
           out_dtype: str | None, config: TileConfig | None, accumulate_into: torch.Tensor | None,
           kind: str, out: torch.Tensor | None = None, fast_accum: bool = False) -> dict[str, torch.Tensor]:
    """One mainloop + epilogue, recorded in the launch ledger as ``kind`` ("gemm",
    or "pass" for a tile pass): validation, the output dtype and
    buffers, and the custom op, which :func:`gemm` and
    :func:`coda_agent.primitives.passes.tile_pass` share."""
    head_eps = None  # a head statistic's eps given at the call: travels with the scalars
    if epilogue is not None:
        operands, head_eps = epilogue.call_eps(operands)
    name = epilogue.name if epilogue is not None else PLAIN
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
    dest = check_destination(what, epilogue, A, B, operands, m, n, dtype, accumulate_into, out)
    if accumulate_into is not None and epilogue is not None and epilogue.paired_operand and (
            kind == "gemm" or config is not None):
        # quack's kernel reads a PairedTile as its C operand, and its reduce-add store has none.
        raise CatalogueError(f"{what}: accumulate_into with a PairedTile operand runs on the pass kernel only, "
                             "a tile_pass without config; here, return D and add it yourself")
    poisoned = None  # ``out`` is dead after the call (module docstring): D gets its own buffer here
    if out is not None and (torch.compiler.is_compiling() or current_lowering(A, B) == "reference"):
        dest, poisoned = None, None if torch.compiler.is_compiling() else out
    cfg = [] if config is None else [config.tile_m, config.tile_n, config.cluster_m, config.cluster_n,
                                     int(config.pingpong)]
    if epilogue is None and dest is None and not on_fp8 and kind == "gemm":  # fp8 scales need an epilogue
        mm = _mm_body if direct((A, B), differentiable=True) else torch.ops.coda.mm
        results = {"D": mm(A, B, dtype, cfg)}
    else:
        tensors, scalars, ints = _pack(epilogue, operands, head_eps)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (A, B, *tensors)):
            raise CatalogueError(f"{what}: a GEMM with an epilogue (or into a given tensor) has no derivative of "
                                 "its own; run the program's forward and backward through "
                                 "coda_agent.kernels.Kernel, or call it under torch.no_grad()")
        if epilogue is not None:  # the partials' layout: N tiles of the config the launch will pick
            tiles = -(-n // (config or default_config(epilogue, operands, n, m, tile_pass=kind == "pass")).tile_n)
            # The buffers' pre-fills (a select's zeros) are device work of this call: a profiler range
            # of its own lets the verifier's launch audit attribute them (none while compiling).
            with profiler_range(f"coda::buffers::{name}"):
                results = epilogue.result_buffers(m, n, operands, dtype, tiles, A.device, dest)
        else:
            results = {"D": dest if dest is not None else torch.empty(m, n, dtype=dtype, device=A.device)}
        buffers = list(results.values())
        args = (epilogue.key if epilogue is not None else PLAIN, A, B, tensors, scalars, ints, buffers,
                accumulate_into is not None, cfg, fast_accum, kind)
        if direct((A, B, *tensors, *buffers)):
            _gemm_body(*args)
            mutated(buffers)
        else:
            torch.ops.coda.gemm(*args)
    if poisoned is not None:  # one exit: every launch path leaves a dead ``out`` NaN
        with profiler_range(f"coda::buffers::{name}"):
            poisoned.fill_(float("nan"))
    return results


def _pack(epi: Epilogue | None, operands: dict[str, Any], head_eps: float | None = None
          ) -> tuple[list, list[float], list[int]]:
    """An epilogue's operands as the op's three lists, in declared order; index operands last,
    and a head statistic's eps given at the call (``Epilogue.call_eps``) after the scalars."""
    lists: dict[str, list] = {"tensors": [], "scalars": [], "ints": []}
    for name, kind in epi.operands.items() if epi is not None else ():
        lists[kind.op_argument].append(operands[name])
    lists["tensors"] += [operands[i] for i in epi.index_operands] if epi is not None else []
    lists["scalars"] += [head_eps] if head_eps is not None else []
    return lists["tensors"], [float(v) for v in lists["scalars"]], [int(v) for v in lists["ints"]]


def _unpack(epi: Epilogue, tensors: list, scalars: list, ints: list) -> tuple[Epilogue, dict[str, Any]]:
    """The epilogue the launch runs (with a call's head eps: ``Epilogue.with_head_eps``) and its operands."""
    lists = {"tensors": iter(tensors), "scalars": iter(scalars), "ints": iter(ints)}
    operands = {name: next(lists[kind.op_argument]) for name, kind in epi.operands.items()}
    operands.update({i: next(lists["tensors"]) for i in epi.index_operands})
    return epi.with_head_eps(next(lists["scalars"], None)), operands


def _result_names(epi: Epilogue | None, count: int) -> list[str]:
    """The names of the op's ``count`` result buffers (the order of ``Epilogue.result_buffers``)."""
    if epi is None:
        return ["D"]
    rest = [*epi.outputs, *(n for n, s in epi.head_stats.items() if s.save), *epi.reductions]
    return ["D", *rest] if count > len(rest) else rest


def _launch(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
            results: dict[str, torch.Tensor], accumulate: bool, config: TileConfig | None,
            fast_accum: bool = False, kind: str = "gemm") -> None:
    """The launch behind both ops: the tile configuration, then the active lowering."""
    m, k = A.shape
    n = B.shape[1]
    lowering = current_lowering(A, B)
    if lowering == "cute" and not A.is_cuda:
        raise CatalogueError("gemm: the cute lowering runs on CUDA tensors; move the inputs to the "
                             "GPU or use lowering('reference')")
    if lowering == "cute" and _on_cublas(epi, A, results, config, kind):
        D = results["D"]
        with launching(kind, PLAIN, "cublas"):
            D.addmm_(A, B) if accumulate else torch.mm(A, B, out=D)
        return
    if kind == "pass" and config is None and lowering in ("cute", "compile"):
        why = _pass_kernel(epi, operands, results, accumulate, lowering, {"M": m, "N": n})
        if not why:
            return
        if accumulate and epi.paired_operand:
            raise CatalogueError(f"tile_pass: accumulate_into with a PairedTile operand runs on the pass kernel "
                                 f"only, which does not take this call ({why})")
    cfg = config
    if cfg is None and lowering == "cute":
        cfg = lookup(epi, m, n, k, fp8.mainloop_key(A, B, fast_accum), A.device, operands)
        if cfg is None and not accumulate and tunable(epi) and tunable_now(A, (m, n, k)):
            cfg, _ = tune(epi, A, B, operands, out_dtype=results["D"].dtype if "D" in results else A.dtype,
                          fast_accum=fast_accum)
    on_fp8 = fp8.is_fp8(A.dtype)
    defaulted = cfg is None
    if defaulted:
        cfg = default_config(epi, operands, n, m, _sm_count(A), fp8_promote=on_fp8 and not fast_accum,
                             tile_pass=kind == "pass")
        cfg = _leaner(epi, A, B, operands, results).get(cfg, cfg)
    for name in epi.head_stats if epi is not None else ():
        hd = operands[name]
        if hd > MAX_TILE_N:
            raise CatalogueError(f"gemm: head statistic {name!r} needs a whole head in one tile, and quack's "
                                 f"SM90 tiles hold at most {MAX_TILE_N} columns: head_dim {hd} is wider "
                                 f"(head statistics support head_dim up to {MAX_TILE_N})")
        if cfg.tile_n % hd:
            raise CatalogueError(f"gemm: head statistic {name!r} needs whole heads in a tile: tile_n "
                                 f"{cfg.tile_n} is not a multiple of head_dim {hd}; use "
                                 f"TileConfig(tile_n={hd}) or a multiple of it")
    try:
        _run(epi, A, B, operands, results, accumulate, cfg, fast_accum, kind, lowering)
    except StageShortage:
        lean = lean_staging(cfg, epi, fp8_promote=on_fp8 and not fast_accum) if defaulted else None
        if lean is None:
            raise
        # The shortage is found while compiling, before anything launches; remembered per
        # epilogue and dtypes so that later calls compile the lean config straight away.
        _leaner(epi, A, B, operands, results)[cfg] = lean
        _run(epi, A, B, operands, results, accumulate, lean, fast_accum, kind, lowering)


def _on_cublas(epi: Epilogue | None, A: torch.Tensor, results: dict[str, torch.Tensor], config: TileConfig | None,
               kind: str) -> bool:
    """Whether :func:`~.lowering.plain_gemms` sends this launch to cuBLAS."""
    return (epi is None and kind == "gemm" and config is None and plain_gemm_library() == "cublas"
            and A.dtype in INPUT_DTYPES and results["D"].dtype == A.dtype)


def _pass_kernel(epi: Epilogue, operands: dict[str, Any], results: dict[str, torch.Tensor], accumulate: bool,
                 lowering: str, shapes: dict[str, int]) -> str:
    """Run (or, compiling, compile) an untuned tile pass on its own streaming kernel
    (:mod:`.pass_kernel`): "" once it ran, else why that kernel does not take it (quack's
    zero mainloop runs it instead)."""
    plan, why = pass_kernel.plan_for(epi, operands, results, accumulate)
    if plan is None:
        return why
    if lowering == "compile":
        pass_kernel.compile_call(epi, plan, shapes)
        return ""
    with launching("pass", epi.name, str(plan.geometry)):
        pass_kernel.run(epi, plan, operands, results)
    return ""


def _leaner(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
            results: dict[str, torch.Tensor]) -> dict[TileConfig, TileConfig]:
    """Default config -> the leaner one that replaced it, for calls with these dtypes
    (the staging that decides the stage count depends on the tile and the dtypes only)."""
    if epi is None:
        return {}
    dtypes = (A.dtype, B.dtype, *(t.dtype for t in (*operands.values(), *results.values())
                                  if isinstance(t, torch.Tensor)))
    return epi._lowered.setdefault(("lean_staging", dtypes), {})


def _run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
         results: dict[str, torch.Tensor], accumulate: bool, cfg: TileConfig, fast_accum: bool, kind: str,
         lowering: str) -> None:
    if lowering == "compile":
        cute.compile_call(epi, A, B, operands, buffers=results, config=cfg, accumulate=accumulate,
                          fast_accum=fast_accum, kind=kind)
        return
    with launching(kind, epi.name if epi is not None else PLAIN, str(cfg)):
        if lowering == "cute":
            cute.run(epi, A, B, operands, buffers=results, config=cfg, accumulate=accumulate,
                     fast_accum=fast_accum)
            return
        D = results.get("D")
        got = reference.run(epi, A, B, operands, out_dtype=A.dtype if D is None else D.dtype, tile_m=cfg.tile_m,
                            tile_n=cfg.tile_n, accumulate_into=D if accumulate else None)
        for name, buf in results.items():
            if not (accumulate and name == "D"):
                buf.copy_(got[name])


def _config(ints: list[int]) -> TileConfig | None:
    return TileConfig(*ints[:4], pingpong=bool(ints[4])) if ints else None


def _gemm_body(epilogue: str, A: torch.Tensor, B: torch.Tensor, tensors: list[torch.Tensor], scalars: list[float],
               ints: list[int], results: list[torch.Tensor], accumulate: bool, config: list[int],
               fast_accum: bool, kind: str) -> None:
    epi, operands = _unpack(registered(epilogue), tensors, scalars, ints) if epilogue != PLAIN else (None, {})
    _launch(epi, A, B, operands, dict(zip(_result_names(epi, len(results)), results)), accumulate,
            _config(config), fast_accum, kind)


_gemm_op = torch.library.custom_op("coda::gemm", _gemm_body, mutates_args=("results",))


@_gemm_op.register_fake
def _gemm_fake(epilogue: str, A: torch.Tensor, B: torch.Tensor, tensors: list[torch.Tensor],
               scalars: list[float], ints: list[int], results: list[torch.Tensor], accumulate: bool,
               config: list[int], fast_accum: bool, kind: str) -> None:
    return None  # the results are the caller's buffers: nothing to allocate


def _mm_body(A: torch.Tensor, B: torch.Tensor, out_dtype: torch.dtype, config: list[int]) -> torch.Tensor:
    D = torch.empty(A.shape[0], B.shape[1], dtype=out_dtype, device=A.device)
    _launch(None, A, B, {}, {"D": D}, False, _config(config))
    return D


_mm_op = torch.library.custom_op("coda::mm", _mm_body, mutates_args=())


@_mm_op.register_fake
def _mm_fake(A: torch.Tensor, B: torch.Tensor, out_dtype: torch.dtype, config: list[int]) -> torch.Tensor:
    return A.new_empty(A.shape[0], B.shape[1], dtype=out_dtype)


def _mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _mm_backward(ctx: Any, dD: torch.Tensor) -> tuple:
    A, B = ctx.saved_tensors
    g = dD.to(A.dtype)  # the mainloop takes 16-bit operands
    dA = torch.ops.coda.mm(g, B.t(), A.dtype, []) if ctx.needs_input_grad[0] else None
    dB = torch.ops.coda.mm(A.t(), g, B.dtype, []) if ctx.needs_input_grad[1] else None
    return dA, dB, None, None


_mm_op.register_autograd(_mm_backward, setup_context=_mm_setup)
