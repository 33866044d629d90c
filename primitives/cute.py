"""The cute lowering: an :class:`Epilogue` becomes a quack ``EpiMod`` on SM90.

Every operand is *pinned* to an explicit quack EpiOp from its declared kind
(``Tile`` -> TileLoad, ``RowVec`` -> RowVecLoad, ``ColVec`` -> ColVecLoad,
``Scalar`` -> Scalar, ``PairedTile`` -> the GEMM's C operand in
``packed_cd_b16x2`` mode), so quack never infers a kind from a shape.
Reductions map to quack sinks (``col_sum`` -> ColVecReduce, ``row_sum`` ->
RowVecReduce, ``online_lse`` -> OnlineLSEReduce, ``select_col`` ->
ColVecSelect with a companion int ColVecLoad).

quack calls the fn with its operands by *parameter name* and reserves ``c``
for the C operand, so the user's fn is wrapped in a closure whose signature
quack reads (``__signature__``) and whose closure quack fingerprints (the user
fn's source and globals, the catalogue math through its semantic keys).

Compile-only mode (no GPU): ``EpiMod.plan`` with CPU tensors as shape/dtype
carriers compiles for sm_90a in-process; the only driver call on that path,
``get_max_active_clusters``, is answered with Hopper's 132 SMs.  The cubin is
then read with ``cuobjdump`` (pip wheel) for the SASS gate.
"""

from __future__ import annotations

import inspect
import io
import os
import re
import subprocess
import tempfile
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from functools import lru_cache
from typing import Any, Iterator

import torch

from .epilogue import Epilogue
from .errors import CatalogueError
from .gemm import TileConfig
from .lowering import CompiledKernel, SassReport, record_compiled

H100_SMS = 132


def _sink_op(name: str, red: Any) -> tuple[Any, tuple]:
    from quack.epilogue import ops

    if red.combine == "select":
        idx = ops.ColVecLoad(red.index)
        return ops.ColVecSelect(name, idx_op=idx), (idx,)
    if red.combine == "lse":
        return ops.OnlineLSEReduce(name), ()
    cls = ops.ColVecReduce if red.axis == "cols" else ops.RowVecReduce
    return cls(name, combine=red.combine), ()


def _wrap_fn(epi: Epilogue) -> Any:
    user = epi.fn
    paired = epi.pairs if epi.pairs not in (None, "acc") else None

    def coda_epilogue(acc, **operands):  # noqa: ANN001 - signature set below
        if paired is not None:
            operands[paired] = operands.pop("c")
        return user(acc, **operands)

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name in epi.operands:
        pname = "c" if name == paired else name
        params.append(inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    coda_epilogue.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    coda_epilogue.__name__ = coda_epilogue.__qualname__ = f"coda_{epi.name}"
    return coda_epilogue


def epimod(epi: Epilogue) -> Any:
    """The quack EpiMod of an epilogue (built once, cached on the epilogue)."""
    mod = epi._lowered.get("cute")
    if mod is not None:
        return mod
    from quack.epilogue import ops
    from quack.epilogue.frontend import EpiMod

    pins: dict[str, Any] = {}
    prepass, extra = None, []
    for name, stat in epi.head_stats.items():
        from quack.epilogue.head_rmsnorm import HeadRstd

        pins[name] = HeadRstd(name, eps=stat.eps)
        prepass = _head_prepass(name)
        if stat.save:
            extra.append(pins[name].out(f"{name}_saved"))
    for name, kind in epi.operands.items():
        if kind.port in ("paired", "head"):
            continue
        op_cls = {"tile": ops.TileLoad, "row": ops.RowVecLoad, "col": ops.ColVecLoad,
                  "scalar": ops.Scalar}[kind.port]
        pins[name] = op_cls(name)
    sinks = {}
    for name, red in epi.reductions.items():
        sinks[name], companions = _sink_op(name, red)
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
    epi._lowered["cute"] = mod
    return mod


def _head_prepass(name: str) -> Any:
    def coda_head_sumsq(acc):  # noqa: ANN001, ANN202 - traced by quack before the stores
        return {name: acc * acc}

    return coda_head_sumsq


def _quack_operands(epi: Epilogue, operands: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(C, keyword operands) in quack's layout: vectors as (1, len), the PairedTile as C,
    a head statistic as its head width (quack computes it)."""
    C = None
    out: dict[str, Any] = {}
    for name, kind in epi.operands.items():
        v = operands[name]
        if kind.port == "head":
            out[name] = v  # the head width; quack computes the statistic
            continue
        if kind.port == "paired":
            C = v
        elif kind.port in ("row", "col"):
            out[name] = v.reshape(1, -1)
        else:
            out[name] = v
    for idx in epi.index_operands:
        out[idx] = operands[idx].reshape(1, -1)
    return C, out


def _buffers(epi: Epilogue | None, m: int, n: int, operands: dict[str, Any], config: TileConfig,
             device: torch.device, empty: bool) -> dict[str, torch.Tensor]:
    """Output buffers the catalogue owns (declared dtypes; raw partials; select pre-fill)."""
    bufs: dict[str, torch.Tensor] = {}
    if epi is None:
        return bufs
    width = n // 2 if epi.pairs == "acc" else n
    for name, dtype in epi.outputs.items():
        bufs[name] = torch.empty(m, width, dtype=dtype, device=device)
    for name, stat in epi.head_stats.items():
        if stat.save:
            bufs[f"{name}_saved"] = torch.empty(m, n // operands[name], dtype=torch.float32, device=device)
    for name, red in epi.reductions.items():
        if red.partials:
            bufs[name] = torch.empty(m, -(-n // config.tile_n), dtype=torch.float32, device=device)
        elif red.combine == "select":
            make = torch.empty if empty else torch.zeros
            bufs[name] = make(m, dtype=torch.float32, device=device)
    return bufs


def _d_buffer(epi: Epilogue | None, A: torch.Tensor, m: int, n: int, dtype: torch.dtype,
              operands: dict[str, Any], accumulate_into: torch.Tensor | None) -> torch.Tensor | None:
    if accumulate_into is not None:
        return accumulate_into
    if epi is not None and not epi.stores_d:
        return None
    if epi is not None and epi.pairs not in (None, "acc"):
        return torch.empty_like(operands[epi.pairs])
    return torch.empty(m, n, dtype=dtype, device=A.device)


def _pop_caller_buffers(epi: Epilogue, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers quack takes as operands, not outputs: reduction partials, select
    targets and saved head statistics (quack returns those raw)."""
    return {k: out.pop(k) for k in list(out) if k in epi.reductions or k.endswith("_saved")}


def _caller_results(epi: Epilogue, bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    result = {}
    for k, buf in bufs.items():
        if k.endswith("_saved"):
            result[k[: -len("_saved")]] = buf
        elif epi.reductions[k].partials or epi.reductions[k].combine == "select":
            result[k] = buf
    return result


MIN_AB_STAGES = 2


@lru_cache(maxsize=1)
def _guard_pipeline_depth() -> None:
    """Refuse, at compile time, a kernel left with fewer than MIN_AB_STAGES A/B
    pipeline stages.

    quack sizes the mainloop's A/B ring from the shared memory the epilogue's
    staging buffers leave over.  An epilogue with many wide outputs (five fp32
    tiles besides D) on a cooperative 256-wide tile leaves room for one stage,
    and that kernel never finished on the H200: a deadlock, not a slow kernel
    (bench/results/h200-2026-11-29-f, ``hang.log``).  The same epilogue gets four
    stages at 128x128 pingpong.  With a Tile operand loaded as well there is
    room for none, and quack fails with a bare "size ... got 0".  The tuner
    tries cooperative configs, so a one-stage kernel would hang it; refusing
    both while compiling turns them into one error that names the fix, which
    ``tune()`` skips and the verifier reports.  The check wraps quack's stage
    computation (``GemmSm90._compute_stages``, whose first result is the A/B
    stage count); if a later quack changes it, the guard stays off and the
    verifier's timeout is what catches a hang.
    """
    try:
        from quack.gemm_sm90 import GemmSm90
    except ImportError:
        return
    compute = GemmSm90.__dict__.get("_compute_stages")
    if not isinstance(compute, classmethod) or getattr(compute.__func__, "_coda_guard", False):
        return
    stages_of = compute.__func__

    def checked(cls: Any, cta_tile_shape_mnk: Any, *args: Any, **kwargs: Any) -> Any:
        result = stages_of(cls, cta_tile_shape_mnk, *args, **kwargs)
        stages = result[0] if isinstance(result, tuple) and result else None
        if isinstance(stages, int) and stages < MIN_AB_STAGES:
            tile = "x".join(str(d) for d in tuple(cta_tile_shape_mnk)[:2])
            raise CatalogueError(
                f"tile config {tile} leaves {stages} A/B pipeline stage{'s' if stages != 1 else ''} once "
                f"this epilogue's staging buffers take their shared memory; the SM90 mainloop needs at "
                f"least {MIN_AB_STAGES} (with one it deadlocked on the H200). Use a 128-wide pingpong "
                "config (the default), or stage less: fewer or narrower extra outputs (bf16 instead of "
                "fp32), fewer Tile operands.")
        return result

    checked._coda_guard = True  # type: ignore[attr-defined]
    GemmSm90._compute_stages = classmethod(checked)


def _prepare(epi: Epilogue, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any],
             out_dtype: torch.dtype, config: TileConfig, accumulate_into: torch.Tensor | None,
             empty: bool) -> tuple:
    """(mod, C, operand kwargs, output buffers, D, caller-owned sink buffers) for one call."""
    _guard_pipeline_depth()
    m, n = A.shape[0], B.shape[1]
    C, kw = _quack_operands(epi, operands)
    out = _buffers(epi, m, n, operands, config, A.device, empty=empty)
    D = _d_buffer(epi, A, m, n, out_dtype, operands, accumulate_into)
    if D is not None:
        out["D"] = D
    return epimod(epi), C, kw, out, D, _pop_caller_buffers(epi, out)


def run(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
        out_dtype: torch.dtype, config: TileConfig,
        accumulate_into: torch.Tensor | None) -> dict[str, torch.Tensor]:
    epi = epi or _plain()
    mod, C, kw, out, D, sinks = _prepare(epi, A, B, operands, out_dtype, config, accumulate_into,
                                         empty=False)
    res = mod(A, B, C, out=out, out_dtype=out_dtype, store_d=D is not None, config=config.to_quack(),
              tuned=False, add_to_output=accumulate_into is not None, **kw, **sinks)
    result = {k: v for k, v in res.items() if not k.endswith("_saved")}
    result.update(_caller_results(epi, sinks))
    for name, red in epi.reductions.items():
        if red.axis == "cols" and result[name].dim() > 1 and not red.partials:
            result[name] = result[name].reshape(-1)
    if D is None:
        result.pop("D", None)
    return result


@lru_cache(maxsize=1)
def _plain() -> Epilogue:
    from .epilogue import epilogue

    @epilogue()
    def plain(acc):
        return {"D": acc}

    return plain


# --------------------------------------------------------------------------- compile-only


@contextmanager
def _compile_in_process() -> Iterator[None]:
    import quack.cache
    import quack.gemm_runtime.host as host

    if not torch.cuda.is_available():
        # The only driver query on the compile path; answer for Hopper.
        host.get_max_active_clusters = lambda cluster_size, *a, **k: H100_SMS // cluster_size
    # quack's disk cache hands back a loaded object without the cubin; the SASS
    # gate needs the in-process compile (2-4 s per kernel on 2 cores).  Restored
    # afterwards, so later launches in the same process keep the cache.
    enabled = quack.cache.CACHE_ENABLED
    quack.cache.CACHE_ENABLED = False
    try:
        yield
    finally:
        quack.cache.CACHE_ENABLED = enabled


def compile_call(epi: Epilogue | None, A: torch.Tensor, B: torch.Tensor, operands: dict[str, Any], *,
                 out_dtype: torch.dtype, config: TileConfig,
                 accumulate_into: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Compile for sm_90a (no launch); return uninitialised outputs of the right shapes."""
    epi = epi or _plain()
    if torch.cuda.is_available() and not A.is_cuda:
        # quack reads the target architecture from the tensors' device; on a GPU
        # machine the shape carriers must live there (they stay uninitialised).
        A, B = _on_cuda(A), _on_cuda(B)
        operands = {k: _on_cuda(v) for k, v in operands.items()}
        accumulate_into = _on_cuda(accumulate_into)
    m, n = A.shape[0], B.shape[1]
    mod, C, kw, out, D, sinks = _prepare(epi, A, B, operands, out_dtype, config, accumulate_into,
                                         empty=True)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with _compile_in_process(), redirect_stdout(log), redirect_stderr(log):
            plan = mod.plan(A, B, C, out=out, config=config.to_quack(),
                            add_to_output=accumulate_into is not None, **kw, **sinks)
    except CatalogueError:
        raise
    except Exception as e:  # noqa: BLE001 - the DSL raises many types; all are compile errors
        raise CompileError(epi, e, log.getvalue()) from None
    seconds = time.perf_counter() - t0
    cubin = getattr(plan.gemm_plan.compiled_fn, "__cubin__", None)
    sass = inspect_cubin(cubin) if cubin else None
    record_compiled(CompiledKernel(epilogue=epi.name, config=str(config), seconds=seconds,
                                   log=log.getvalue(), sass=sass,
                                   shapes={"M": m, "N": n, "K": A.shape[1]}))
    result: dict[str, torch.Tensor] = dict(out)
    result.update(_caller_results(epi, sinks))
    for name, red in epi.reductions.items():
        if name not in result:
            result[name] = torch.empty(n if red.axis == "rows" else m, dtype=torch.float32, device=A.device)
    if D is None:
        result.pop("D", None)
    return result


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
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@lru_cache(maxsize=1)
def _cuobjdump() -> str | None:
    from importlib import metadata

    try:
        files = metadata.distribution("nvidia-cuda-cuobjdump").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "cuobjdump":
            path = str(f.locate())
            os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    return None


_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", re.M)


def inspect_cubin(cubin: bytes) -> SassReport | None:
    """Registers, spills and HGMMA count of a cubin (None without cuobjdump)."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    ops = _SASS_OP.findall(sass)
    return SassReport(
        sm90a="sm_90a" in sass,
        hgmma=sum(o.startswith("HGMMA") for o in ops),
        spill_stores=sum(o.startswith("STL") for o in ops),
        spill_loads=sum(o.startswith("LDL") for o in ops),
        registers=int(usage.get("REG", -1)),
        local_bytes=int(usage.get("LOCAL", 0)),
        instructions=len(ops),
        calls=sum(o.startswith("CALL") for o in ops),
    )
