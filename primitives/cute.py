"""The cute lowering: an :class:`Epilogue` becomes a quack ``EpiMod`` on SM90.

Every operand is *pinned* to an explicit quack EpiOp by its declared kind
(``Kind.quack_op``: ``Tile`` -> TileLoad, ``RowVec`` -> RowVecLoad,
``ColVec`` -> ColVecLoad, ``Scalar`` -> Scalar, ``HeadStat`` -> HeadRstd;
a ``PairedTile`` is the GEMM's C operand in ``packed_cd_b16x2`` mode), so
quack never infers a kind from a shape.  Reductions map to quack sinks
(``Reduction.quack_sink``: ``col_sum`` -> ColVecReduce, ``row_sum`` ->
RowVecReduce, ``online_lse`` -> OnlineLSEReduce, ``select_col`` ->
ColVecSelect with a companion int ColVecLoad).

quack calls the fn with its operands by *parameter name* and reserves ``c``
for the C operand, so the user's fn is wrapped in a closure whose signature
quack reads (``__signature__``) and whose closure quack fingerprints (the user
fn's source and globals, the catalogue math through its semantic keys).  The
wrapper is also where quack's ``Pair`` and the catalogue's meet: quack's are
converted on the way in, the catalogue's on the way out.

Every quack call runs inside the scoped settings of :mod:`.dsl_scope` (the
pipeline-depth guard; for compile-only calls also the kept cubin, the target
and the driver query).  Compile-only mode (no GPU): ``EpiMod.plan`` with CPU
tensors as shape/dtype carriers compiles for sm_90a in-process, and the cubin
is read with ``cuobjdump`` for the SASS gate (:mod:`.sass`).  quack is
imported inside the functions that use it, so importing the catalogue does
not load it.
"""

from __future__ import annotations

import inspect
import io
import re
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from functools import lru_cache
from typing import Any

import torch

from .dsl_scope import compile_settings, pipeline_guard
from .epilogue import Epilogue, epilogue
from .errors import CatalogueError
from .lowering import CompiledKernel, record_compiled
from .pair import Pair
from .sass import inspect_cubin
from .tile_config import TileConfig


def _wrap_fn(epi: Epilogue) -> Any:
    from quack.epilogue.math import Pair as QuackPair

    user = epi.fn
    # quack's parameter name -> the program's (a PairedTile arrives as "c")
    names = {kind.quack_parameter(name): name for name, kind in epi.operands.items()}

    def inbound(value):  # noqa: ANN001, ANN202 - traced by quack
        return Pair(value.a, value.b) if isinstance(value, QuackPair) else value

    def outbound(value):  # noqa: ANN001, ANN202 - traced by quack
        return QuackPair(value.a, value.b) if isinstance(value, Pair) else value

    reads_acc = epi.reads_acc  # a pass's fn takes no accumulator (its mainloop computes zeros)
    # In a pairs="acc" epilogue quack folds each reduction from a pair of lanes; one value per
    # pair (which the reference lowering takes as it is) goes as lanes that fold to it.
    paired = epi.reductions if epi.pairs == "acc" else {}

    def coda_epilogue(acc, **operands):  # noqa: ANN001, ANN202 - signature set below
        args = {names[k]: inbound(v) for k, v in operands.items()}
        result = user(inbound(acc), **args) if reads_acc else user(**args)
        result = {k: Pair(*paired[k].lanes_of(v)) if k in paired and not isinstance(v, Pair) else v
                  for k, v in result.items()}
        return {k: outbound(v) for k, v in result.items()}

    params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in ("acc", *names)]
    coda_epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    coda_epilogue.__name__ = coda_epilogue.__qualname__ = f"coda_{epi.name}"
    return coda_epilogue


def epimod(epi: Epilogue, fast_accum: bool = False) -> Any:
    """The quack EpiMod of an epilogue (built once per accumulation mode, cached
    on the epilogue)."""
    slot = "cute-fast-accum" if fast_accum else "cute"
    mod = epi._lowered.get(slot)
    if mod is not None:
        return mod
    from quack.epilogue.frontend import EpiMod

    if fast_accum:
        EpiMod = _fast_accum_epimod()  # noqa: N806 - the class this mod is built from

    pins = {name: op for name, kind in epi.operands.items()
            if (op := kind.quack_op(name, epi.head_stats.get(name))) is not None}
    prepass, extra = None, []
    for name, stat in epi.head_stats.items():
        prepass = _head_prepass(name)
        if stat.save:
            extra.append(pins[name].out(f"{name}_saved"))
    sinks = {}
    for name, red in epi.reductions.items():
        sinks[name], companions = red.quack_sink(name)
        extra.extend(companions)
    try:
        mod = EpiMod(_wrap_fn(epi), outputs=tuple(epi.outputs), ops=pins, outs=sinks,
                     mode=epi.mode, extra_ops=tuple(extra), prepass=prepass,
                     prepass_outs=(next(iter(epi.head_stats)),) if prepass else ())
    except TypeError as e:
        # quack's fail-closed fingerprint: the fn reached something without a semantic key.
        raise CatalogueError(f"epilogue {epi.name!r} uses a value the kernel cache cannot fingerprint "
                             f"(only catalogue math, numbers and operands may appear): {e}",
                             line=epi.line) from None
    epi._lowered[slot] = mod
    return mod


@lru_cache(maxsize=1)
def _fast_accum_epimod() -> type:
    """quack's EpiMod with fp8 fast accumulation.  GemmSm90 has the switch
    (``fp8_fast_accum``: no promotion of the partial sums to fp32 after each K
    tile) but the epilogue frontend does not pass it on; its ``gemm`` takes
    ``post_init_attrs``, attributes set on the kernel object before it is traced
    and part of quack's plan and compile keys, so the kernel's
    ``fp8_slow_accum`` is switched off there, for every launch and compile of
    this mod.  (The register split quack chose for the promoting kernel stays:
    more registers for the MMA warps, none fewer.)"""
    from quack.epilogue.frontend import EpiMod

    class FastAccumEpiMod(EpiMod):
        def gemm(self, *args: Any, post_init_attrs: tuple = (), **kwargs: Any) -> Any:
            return super().gemm(*args, post_init_attrs=(*post_init_attrs, ("fp8_slow_accum", False)),
                                **kwargs)

    return FastAccumEpiMod


def _head_prepass(name: str) -> Any:
    def coda_head_sumsq(acc):  # noqa: ANN001, ANN202 - traced by quack before the stores
        return {name: acc * acc}

    return coda_head_sumsq


def _quack_operands(epi: Epilogue, operands: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(C, keyword operands) in quack's layout (``Kind.quack_value``), with the
    int index operands of select_col reductions as (1, M)."""
    kw = {kind.quack_parameter(name): kind.quack_value(operands[name]) for name, kind in epi.operands.items()}
    for idx in epi.index_operands:
        kw[idx] = operands[idx].reshape(1, -1)
    return kw.pop("c", None), kw


def _quack_buffers(epi: Epilogue, buffers: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """gemm's result buffers as quack takes them: (``out=``: D and the extra outputs,
    sinks: the buffers quack fills as operands, caller-owned reductions and the saved
    head statistics as ``<name>_saved``)."""
    out = {k: v for k, v in buffers.items() if k == "D" or k in epi.outputs}
    sinks = {name: buffers[name] for name, red in epi.reductions.items() if red.caller_owned}
    sinks.update({f"{name}_saved": buffers[name] for name, stat in epi.head_stats.items() if stat.save})
    return out, sinks


def run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
        buffers: dict[str, torch.Tensor], config: TileConfig, accumulate: bool, fast_accum: bool = False) -> None:
    """Launch into ``buffers`` (gemm's result buffers: ``Epilogue.result_buffers``);
    ``accumulate`` adds into D (the TMA reduce-add store)."""
    epi = epi or _plain()
    C, kw = _quack_operands(epi, operands)
    out, sinks = _quack_buffers(epi, buffers)
    D = buffers.get("D")
    with pipeline_guard():
        res = epimod(epi, fast_accum)(A, B, C, out=out, out_dtype=A.dtype if D is None else D.dtype,
                                      store_d=D is not None, config=config.to_quack(), tuned=False,
                                      add_to_output=accumulate, **kw, **sinks)
    for name, red in epi.reductions.items():
        if not red.caller_owned:  # a finished (M,) or (N,) vector quack allocated: O(M) to copy
            buffers[name].copy_(red.from_quack(res[name], pairs=epi.pairs == "acc"))


@lru_cache(maxsize=1)
def _plain() -> Epilogue:
    @epilogue()
    def plain(acc):
        return {"D": acc}

    return plain


# --------------------------------------------------------------------------- compile-only


def compile_call(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
                 buffers: dict[str, torch.Tensor], config: TileConfig, accumulate: bool,
                 fast_accum: bool = False, kind: str = "gemm") -> None:
    """Compile for sm_90a (no launch); ``buffers`` only carry shapes and stay uninitialised."""
    epi = epi or _plain()
    if torch.cuda.is_available() and not A.is_cuda:
        # quack reads the target architecture from the tensors' device; on a GPU
        # machine the shape carriers must live there (they stay uninitialised).
        A, B = _on_cuda(A), _on_cuda(B)
        operands = {k: _on_cuda(v) for k, v in operands.items()}
        buffers = {k: _on_cuda(v) for k, v in buffers.items()}
    m, n = A.shape[0], B.shape[1]
    C, kw = _quack_operands(epi, operands)
    out, sinks = _quack_buffers(epi, buffers)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with compile_settings(), pipeline_guard(), redirect_stdout(log), redirect_stderr(log):
            plan = epimod(epi, fast_accum).plan(A, B, C, out=out, config=config.to_quack(),
                                                add_to_output=accumulate, **kw, **sinks)
    except CatalogueError:
        raise
    except Exception as e:  # noqa: BLE001 - the DSL raises many types; all are compile errors
        raise CompileError(epi, e, log.getvalue()) from None
    seconds = time.perf_counter() - t0
    cubin = getattr(plan.gemm_plan.compiled_fn, "__cubin__", None)
    sass = inspect_cubin(cubin) if cubin else None
    record_compiled(CompiledKernel(epilogue=epi.name, config=str(config), seconds=seconds,
                                   log=log.getvalue(), sass=sass,
                                   shapes={"M": m, "N": n, "K": A.shape[1]}, kind=kind))


def _on_cuda(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


class CompileError(CatalogueError):
    """The DSL or ptxas rejected the lowered epilogue; carries the trimmed log."""

    def __init__(self, epi: Epilogue, exc: BaseException, log: str):
        line = None
        text = f"{type(exc).__name__}: {exc}"
        src = epi.fn.__code__.co_filename
        for m in re.finditer(rf'File "{re.escape(src)}", line (\d+)', _format_tb(exc)):
            line = int(m.group(1))
        super().__init__(f"compiling epilogue {epi.name!r} for sm_90a failed: {text[:2000]}",
                         line=line)
        self.log = log


def _format_tb(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
