"""Stages 2-6, run inside the worker process (never in the harness itself).

Each ``run_<stage>(ctx) -> StageResult`` turns whatever the candidate does
(raises, returns garbage, mutates inputs, smuggles PyTorch compute) into a
failed StageResult with the program's own line.  An exception escaping a stage
function is a harness bug and becomes an ``error`` result in the worker.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from coda_agent.tasks.spec import Task
from coda_agent.verifier.compare import compare
from coda_agent.verifier.inputs import TORCH_DTYPES, make_grads, make_inputs, run_reference
from coda_agent.verifier.report import Mismatch, StageResult
from coda_agent.verifier.static import epilogue_function_names

MAX_LOG = 4000


@dataclass
class Context:
    task: Task
    source: str
    seeds: list[int]  # secret, drawn by the harness per run
    shape_sets: list[str]
    reps: int = 20
    fail_on_target: bool = False
    compile_cache: bool = False  # reuse/store passed compile results (:mod:`.compile_cache`)
    program_name: str = "candidate"
    _loads: int = field(default=0)

    def next_seed(self) -> int:
        seed = self.seeds[self._loads % len(self.seeds)] + self._loads * 7919
        self._loads += 1
        return seed


class CandidateError(Exception):
    """The program failed in a way the stage reports as its verdict."""

    def __init__(self, message: str, line: int | None = None, log: str = ""):
        super().__init__(message)
        self.message, self.line, self.log = message, line, log


# --------------------------------------------------------------------------- program calls

def load(ctx: Context, tag: str):
    from coda_agent.primitives import load_program

    name = f"{ctx.program_name}_{tag}"
    try:
        return load_program(ctx.source, name)
    except Exception as e:  # noqa: BLE001 - the candidate's failure, reported with its line
        raise _candidate_error(e, name, "loading the program") from None


def _candidate_error(e: BaseException, name: str, doing: str) -> CandidateError:
    line = getattr(e, "line", None)
    if line is None and isinstance(e, SyntaxError):
        line = e.lineno
    frames = [(f, n) for f, n in traceback.walk_tb(e.__traceback__) if name in f.f_code.co_filename]
    if line is None and frames:
        line = frames[-1][1]
    where = f" (line {line})" if line else ""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return CandidateError(f"{doing} raised {type(e).__name__}: {e}{where}", line, _trim(tb))


def _trim(text: str, limit: int = MAX_LOG) -> str:
    return text if len(text) <= limit else text[:limit // 4] + "\n...\n" + text[-3 * limit // 4:]


def call_program(ctx: Context, mod, inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None,
                 audit: "TorchAudit | None" = None) -> dict[str, Any]:
    """forward (+ backward): the outputs and ``d<input>`` gradients in one dict."""
    spec = ctx.task.spec
    name = mod.__file__
    try:
        with audit or _nullcontext():
            outs = mod.forward(**inputs, **spec.params)
    except Exception as e:  # noqa: BLE001
        raise _candidate_error(e, name, "forward") from None
    if not isinstance(outs, dict):
        raise CandidateError(f"forward returned {type(outs).__name__}; return a dict with "
                             f"{sorted(spec.outputs)}")
    missing = [o for o in spec.outputs if o not in outs]
    if missing:
        raise CandidateError(f"forward's returned dict lacks {missing}; it must hold every task output "
                             f"{sorted(spec.outputs)} (extra entries are saved state for backward)")
    result = {o: outs[o] for o in spec.outputs}
    if grads:
        saved = MappingProxyType({**inputs, **spec.params, **outs})
        try:
            with audit or _nullcontext():
                back = mod.backward(saved, **grads)
        except Exception as e:  # noqa: BLE001
            raise _candidate_error(e, name, "backward") from None
        if not isinstance(back, dict):
            raise CandidateError(f"backward returned {type(back).__name__}; return a dict with "
                                 f"{['d' + g for g in spec.gradients]}")
        missing = [f"d{g}" for g in spec.gradients if f"d{g}" not in back]
        if missing:
            raise CandidateError(f"backward's returned dict lacks {missing}")
        result.update({f"d{g}": back[f"d{g}"] for g in spec.gradients})
    return result


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


# Metadata and free views a program may touch on a tensor directly.
_TORCH_OK = {"shape", "dtype", "device", "ndim", "T", "mT", "t", "size", "dim", "view", "is_cuda",
             "__get__", "__len__", "__iter__", "__format__", "__repr__"}


def _basic_index(index) -> bool:
    """Ints, slices, None and ... only: a free view (``x[r0:r1]``), not a gather."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


class TorchAudit(TorchFunctionMode):
    """Records PyTorch calls whose nearest Python caller is the program's own
    forward/backward (not an @epilogue body the catalogue traces, not the
    catalogue itself): tensor arithmetic an AST cannot tell from int math."""

    def __init__(self, program_file: str, epilogue_names: set[str]):
        super().__init__()
        self.program_file = program_file
        self.epilogue_names = epilogue_names
        self.calls: list[tuple[int, str]] = []
        self._torch_dir = torch.__file__.rsplit("/", 1)[0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in _TORCH_OK and not (name == "__getitem__" and _basic_index(args[1] if len(args) > 1 else None)):
            f = sys._getframe(1)
            while f is not None and f.f_code.co_filename.startswith(self._torch_dir):
                f = f.f_back
            if f is not None and f.f_code.co_filename == self.program_file \
                    and f.f_code.co_name not in self.epilogue_names:
                self.calls.append((f.f_lineno, name))
        return func(*args, **(kwargs or {}))

    def verdict(self) -> CandidateError | None:
        if not self.calls:
            return None
        line, name = self.calls[0]
        ops = sorted({n for _, n in self.calls})
        return CandidateError(f"PyTorch compute in the program at line {line} (`{name}`; in all: "
                              f"{', '.join(ops[:8])}): forward/backward may only call catalogue "
                              "functions; move the math into an @epilogue or use an auxiliary "
                              "catalogue kernel", line)


def inputs_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> CandidateError | None:
    for k, v in before.items():
        if not torch.equal(v, after[k]) and not _same_bits(v, after[k]):
            return CandidateError(f"the program modified its input `{k}` in place; inputs are read-only "
                                  "(write a new output instead)")
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()) \
        if a.is_floating_point() else False


def compare_all(ctx: Context, got: dict, hi: dict, lo: dict, shape_set: str,
                poisoned: bool = False) -> list[Mismatch]:
    out = []
    for k in hi:
        m = compare(k, shape_set, got[k], hi[k], lo[k], ctx.task.spec.tolerance_for(k), poisoned=poisoned)
        if m is not None:
            out.append(m)
    return out


def _mismatch_message(ms: list[Mismatch]) -> str:
    m = ms[0]
    more = f" (and {len(ms) - 1} more: {', '.join(x.tensor for x in ms[1:])})" if len(ms) > 1 else ""
    return (f"`{m.tensor}` differs from the reference on shape set {m.shape_set}: {m.pattern}; "
            f"max abs error {m.max_abs_err:.3g} (allowed {m.allowed:.3g}) at index {m.worst_index}"
            f"{'' if m.rel_norm_err is None else f', relative norm error {m.rel_norm_err:.3g}'}{more}")


def _stage(name: str, fn: Callable[[Context], StageResult]) -> Callable[[Context], StageResult]:
    def run(ctx: Context) -> StageResult:
        t0 = time.perf_counter()
        try:
            res = fn(ctx)
        except CandidateError as e:
            res = StageResult(name=name, status="failed", message=e.message, line=e.line, log=e.log)
        res.seconds = round(time.perf_counter() - t0, 3)
        return res
    run.__name__ = f"run_{name}"
    return run


def _gpu_required(name: str) -> StageResult | None:
    if not torch.cuda.is_available():
        return StageResult(name=name, status="skipped", message="no CUDA device: GPU stages skipped")
    return None


# --------------------------------------------------------------------------- 2. reference

def _reference(ctx: Context) -> StageResult:
    from coda_agent.primitives import lowering

    spec = ctx.task.spec
    shape_set = spec.cpu_shape_set
    want_grads = spec.has_backward
    with lowering("reference"):
        mod = load(ctx, "reference")
        audit = TorchAudit(mod.__file__, epilogue_function_names(ctx.source))
        checked = []
        for _ in range(2):  # two secret seeds: a program that caches outputs fails the second
            seed = ctx.next_seed()
            inputs = make_inputs(spec, shape_set, seed)
            grads = make_grads(spec, shape_set, seed) if want_grads else None
            copies = {k: v.clone() for k, v in inputs.items()}
            got = call_program(ctx, mod, inputs, grads, audit)
            if (err := audit.verdict()) or (err := inputs_unchanged(copies, inputs)):
                raise err
            hi = run_reference(ctx.task, copies, grads, torch.float64)
            lo = run_reference(ctx.task, copies, grads, None)
            ms = compare_all(ctx, got, hi, lo, shape_set)
            if ms:
                return StageResult(name="reference", status="failed", message=_mismatch_message(ms),
                                   mismatches=ms)
            checked.append(shape_set)
    return StageResult(name="reference", status="passed",
                       message=f"matches the PyTorch reference on {shape_set} (2 seeds, "
                               f"{'forward+backward' if want_grads else 'forward'})",
                       details={"shape_set": shape_set, "tensors": sorted(hi)})


# --------------------------------------------------------------------------- 3. compile

def _compile(ctx: Context) -> StageResult:
    from coda_agent.primitives import compile_only

    spec = ctx.task.spec
    shape_set = spec.cpu_shape_set
    seed = ctx.next_seed()
    # CPU tensors suffice without a GPU; with one, quack's compile path wants CUDA tensors.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = make_inputs(spec, shape_set, seed, device)
    grads = make_grads(spec, shape_set, seed, device) if spec.has_backward else None
    with compile_only() as kernels:
        mod = load(ctx, "compile")
        try:
            call_program(ctx, mod, inputs, grads)
        except CandidateError as e:
            e.log = _trim("\n".join(k.log for k in kernels if k.log) + "\n" + e.log)
            raise
    log = _trim("\n\n".join(f"== {k.epilogue} [{k.config}] {k.seconds:.1f}s\n{k.log}" for k in kernels))
    per_kernel = [{"epilogue": k.epilogue, "config": k.config, "seconds": round(k.seconds, 2),
                   **(vars(k.sass) if k.sass is not None else {"sass": None})} for k in kernels]
    details = {"kernels": per_kernel, "shape_set": shape_set}
    if not kernels:
        return StageResult(name="compile", status="failed", log=log, details=details,
                           message="the program made no gemm() call; every task runs at least one GEMM")
    problems = []
    for k in kernels:
        s = k.sass
        if s is None:
            continue  # no cuobjdump here: noted below; the candidate is not blamed for the machine
        if not s.sm90a:
            problems.append(f"{k.epilogue}: not compiled for sm_90a")
        elif s.hgmma == 0:
            problems.append(f"{k.epilogue} [{k.config}]: no HGMMA instructions (the mainloop lost "
                            "its warpgroup MMA)")
    spills = {k.epilogue: k.sass.spill_stores + k.sass.spill_loads for k in kernels
              if k.sass is not None and (k.sass.spill_stores or k.sass.spill_loads)}
    if spills:
        details["spills"] = spills
    calls = {k.epilogue: k.sass.calls for k in kernels if k.sass is not None and k.sass.calls}
    if calls:
        details["slow_calls"] = calls
    if problems:
        return StageResult(name="compile", status="failed", message="; ".join(problems), log=log,
                           details=details)
    if any(k.sass is None for k in kernels):
        details["sass_unavailable"] = True
    note = ("; SASS gate NOT run (install nvidia-cuda-cuobjdump)" if details.get("sass_unavailable") else "")
    note += (f"; register spills in {', '.join(f'{e} ({n} STL/LDL)' for e, n in spills.items())}: "
            "simplify the epilogue or keep fewer values live") if spills else ""
    note += (f"; slow-path CALLs in {', '.join(f'{e} ({n})' for e, n in calls.items())}: an IEEE "
             "division `a / b` calls a subroutine per element; write `a * reciprocal(b)`, or pass "
             "a precomputed reciprocal as a Scalar/vector") if calls else ""
    return StageResult(name="compile", status="passed", log=log, details=details,
                       message=f"{len(kernels)} GEMM kernel(s) compiled for sm_90a with HGMMA{note}")


_compile_uncached = _stage("compile", _compile)


def _compile_stage(ctx: Context) -> StageResult:
    """The compile stage through the persistent compile cache (when ``ctx.compile_cache``).

    A hit still draws the seed the compile would have drawn, so later stages see
    the same seed sequence with or without the cache.  Nothing else the compile
    leaves behind is read by later stages (they load the program afresh); on a
    GPU they just compile, or load from quack's disk cache, on first launch."""
    from coda_agent.verifier import compile_cache

    t0 = time.perf_counter()
    key = None
    if ctx.compile_cache:
        try:
            key = compile_cache.compile_key(ctx.task, ctx.source)
        except Exception:  # noqa: BLE001 - fail closed: no key, no cache
            key = None
    if key is not None and (hit := compile_cache.get(key)) is not None:
        ctx.next_seed()
        hit.seconds = round(time.perf_counter() - t0, 3)
        return hit
    res = _compile_uncached(ctx)
    if key is not None:
        compile_cache.put(key, res)
    return res


# --------------------------------------------------------------------------- 4. correctness

def poison_allocator() -> None:
    """Fill the caching allocator's free memory with NaN bytes (0xFF), then free it:
    outputs the catalogue allocates next start as NaN, so unwritten tiles show."""
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(int(min(free * 0.6, 32 << 30)), dtype=torch.uint8, device="cuda").fill_(0xFF)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device="cuda").fill_(0xFF) for _ in range(64)]
    torch.cuda.synchronize()
    del big, small


def fitting_shape_sets(ctx: Context) -> tuple[list[str], list[str]]:
    spec = ctx.task.spec
    # Memory this process's caching allocator holds but does not use is free to
    # us: without counting it, the 70B tensors of the correctness stage made the
    # performance stage fall back to the ragged set (seen on the H200).
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    fits, skipped = [], []
    for s in ctx.shape_sets:
        if s not in spec.shapes:
            continue
        nbytes = 0
        for t in [*spec.inputs.values(), *spec.outputs.values()]:
            n = 1
            for d in spec.shape_of(t, s):
                n *= d
            nbytes += n * 4
        (fits if nbytes * 10 < free else skipped).append(s)
    return fits, skipped


def _correctness(ctx: Context) -> StageResult:
    if skip := _gpu_required("correctness"):
        return skip
    from coda_agent.primitives import lowering

    spec = ctx.task.spec
    sets, skipped = fitting_shape_sets(ctx)
    if not sets:
        return StageResult(name="correctness", status="error",
                           message=f"no shape set of {ctx.shape_sets} fits in GPU memory")
    with lowering("cute"):
        mod = load(ctx, "correctness")
        for shape_set in sets:
            first = None
            for probe in ("a", "b"):  # two seeds: cached or input-independent outputs fail
                seed = ctx.next_seed()
                inputs = make_inputs(spec, shape_set, seed, "cuda")
                grads = make_grads(spec, shape_set, seed, "cuda") if spec.has_backward else None
                copies = {k: v.clone() for k, v in inputs.items()}
                hi = run_reference(ctx.task, copies, grads, torch.float32)
                lo = run_reference(ctx.task, copies, grads, None)
                poison_allocator()
                got = call_program(ctx, mod, inputs, grads)
                torch.cuda.synchronize()
                if err := inputs_unchanged(copies, inputs):
                    raise err
                ms = compare_all(ctx, got, hi, lo, shape_set, poisoned=True)
                if ms:
                    return StageResult(name="correctness", status="failed", mismatches=ms,
                                       message=_mismatch_message(ms), details={"shape_sets": sets})
                if probe == "a":
                    first = {k: v.clone() for k, v in got.items()}
                    poison_allocator()
                    again = call_program(ctx, mod, inputs, grads)
                    torch.cuda.synchronize()
                    diff = [k for k in first if not _same_bits(first[k], again[k])
                            and not torch.equal(first[k], again[k])]
                    if diff:
                        return StageResult(name="correctness", status="failed",
                                           message=f"not deterministic: `{diff[0]}` differs between two "
                                                   f"runs on the same inputs ({shape_set})")
                    del again
                else:
                    same = [k for k in got if first[k].shape == got[k].shape and torch.equal(first[k], got[k])
                            and not torch.equal(hi[k], hi[k] * 0)]
                    if same:
                        return StageResult(name="correctness", status="failed",
                                           message=f"`{same[0]}` is identical for two different inputs "
                                                   f"({shape_set}): outputs must be computed from the inputs")
            del first
    return StageResult(name="correctness", status="passed",
                       message=f"matches the fp32 reference on {', '.join(sets)} (NaN-poisoned outputs, "
                               "inputs unmodified, deterministic, 2 seeds each)"
                               + (f"; NOT checked, too large for the free GPU memory: {', '.join(skipped)}"
                                  if skipped else ""),
                       details={"shape_sets": sets, "skipped_shape_sets": skipped})


# --------------------------------------------------------------------------- 5. launch audit

_LAUNCH_API = ("LaunchKernel", "cuLaunch", "cudaLaunch", "Memcpy", "Memset", "memcpy", "memset")


def _launch_audit(ctx: Context) -> StageResult:
    if skip := _gpu_required("launch_audit"):
        return skip
    from torch.profiler import ProfilerActivity, profile

    from coda_agent.primitives import launch_ledger, lowering

    spec = ctx.task.spec
    shape_set = spec.cpu_shape_set
    seed = ctx.next_seed()
    inputs = make_inputs(spec, shape_set, seed, "cuda")
    grads = make_grads(spec, shape_set, seed, "cuda") if spec.has_backward else None
    with lowering("cute"):
        mod = load(ctx, "audit")
        call_program(ctx, mod, inputs, grads)  # warm-up: compile and autotune outside the profile
        torch.cuda.synchronize()
        audit = TorchAudit(mod.__file__, epilogue_function_names(ctx.source))
        with launch_ledger() as ledger, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call_program(ctx, mod, inputs, grads, audit)
            torch.cuda.synchronize()
    events = list(prof.events())
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("coda::")]
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                and any(a in e.name for a in _LAUNCH_API)]
    outside = []
    for e in launches:
        t = e.time_range.start
        if not any(s <= t <= end for s, end in ranges):
            parent = e.cpu_parent
            while parent is not None and parent.cpu_parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            outside.append(parent.name if parent is not None else e.name)
    details = {"ledger": [f"{l.kind}:{l.name}" for l in ledger], "kernels": kernels[:50],
               "n_kernels": len(kernels), "n_ledger": len(ledger)}
    if err := audit.verdict():
        err.message = "launch audit: " + err.message
        return StageResult(name="launch_audit", status="failed", message=err.message, line=err.line,
                           details=details)
    if outside:
        return StageResult(name="launch_audit", status="failed", details=details,
                           message=f"{len(outside)} device launch(es) outside any catalogue call "
                                   f"({', '.join(sorted(set(outside))[:5])}): only gemm() and the "
                                   "catalogue's auxiliary kernels may run device work")
    if len(kernels) < len(ledger):
        return StageResult(name="launch_audit", status="error", details=details,
                           message=f"the profiler saw {len(kernels)} kernels for {len(ledger)} catalogue "
                                   "launches; the audit cannot attribute them")
    return StageResult(name="launch_audit", status="passed", details=details,
                       message=f"{len(kernels)} kernel(s), all inside {len(ledger)} catalogue launch(es) "
                               f"({sum(l.kind == 'gemm' for l in ledger)} GEMM)")


# --------------------------------------------------------------------------- 6. performance

def _performance(ctx: Context) -> StageResult:
    if skip := _gpu_required("performance"):
        return skip
    from coda_agent.primitives import launch_ledger, lowering
    from coda_agent.primitives.timing import measure_each

    spec = ctx.task.spec
    sets, _ = fitting_shape_sets(ctx)
    shape_set = sets[-1]  # the largest that fits
    seed = ctx.next_seed()
    inputs = make_inputs(spec, shape_set, seed, "cuda")
    grads = make_grads(spec, shape_set, seed, "cuda") if spec.has_backward else None
    details: dict[str, Any] = {"shape_set": shape_set, "reps": ctx.reps}
    with lowering("cute"):
        mod = load(ctx, "performance")

    def program() -> Any:
        with lowering("cute"):
            return call_program(ctx, mod, inputs, grads)

    dtype = TORCH_DTYPES[next(iter(spec.inputs.values())).dtype]
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    mats = [(torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype))
            for m, n, k in spec.gemm_shapes(shape_set)]
    contenders: dict[str, Callable[[], Any]] = {"program": program,
                                                "gemm": lambda: [a @ b for a, b in mats]}
    for base in spec.baselines:
        if base in ("eager", "compile"):
            try:
                contenders[base] = _torch_baseline(ctx.task, inputs, grads, compiled=base == "compile")
                contenders[base]()  # compiles here, so a failure is the baseline's, not the timing's
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                contenders.pop(base, None)
                details[f"{base}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # Interleaved (measure_each): program and baselines at the same clock, and the
    # device synchronized between calls, so none runs inside another's window.
    measured = measure_each(contenders, ctx.reps)
    times = {name: t[len(t) // 2] for name, (t, _) in measured.items()}
    t_prog, host_ms = times["program"], measured["program"][1]
    with lowering("cute"), launch_ledger() as ledger:
        got = call_program(ctx, mod, inputs, grads)  # re-check after timing
    torch.cuda.synchronize()
    details["configs"] = [f"{entry.name}: {entry.config}" for entry in ledger if entry.kind == "gemm"]
    details["host_ms"] = round(host_ms, 4)
    hi = run_reference(ctx.task, inputs, grads, torch.float32)
    lo = run_reference(ctx.task, inputs, grads, None)
    ms = compare_all(ctx, got, hi, lo, shape_set)
    if ms:
        return StageResult(name="performance", status="failed", mismatches=ms,
                           message="after timing: " + _mismatch_message(ms))
    flops = spec.flops(shape_set)
    details["ms"] = {k: round(v, 4) for k, v in times.items()}
    details["tflops"] = round(flops / (t_prog * 1e-3) / 1e12, 1)
    nbytes = sum(t.numel() * t.element_size() for t in [*inputs.values(), *got.values()]
                 if isinstance(t, torch.Tensor))
    details["gbytes_per_s"] = round(nbytes / (t_prog * 1e-3) / 1e9, 1)
    ratio = t_prog / times["gemm"]
    details["vs_gemm"] = round(ratio, 3)
    details["target_vs_gemm"] = spec.target.vs_gemm
    if "compile" in times:
        details["compile_speedup"] = round(times["compile"] / t_prog, 3)
    if ratio < 0.9:
        details["suspicious"] = (f"{1 / ratio:.2f}x faster than the plain GEMMs of the same shapes: "
                                 "faster than a fused epilogue can be; check that every GEMM runs")
    summary = (f"{t_prog:.3f} ms on {shape_set} = {ratio:.2f}x the plain GEMMs ({times['gemm']:.3f} ms; "
               f"target <= {spec.target.vs_gemm}), {details['tflops']} TFLOP/s"
               + (f", torch.compile {times['compile']:.3f} ms" if "compile" in times else "")
               + (f", eager {times['eager']:.3f} ms" if "eager" in times else ""))
    if host_ms > t_prog:
        details["launch_bound"] = (f"the host takes {host_ms:.3f} ms to enqueue one call that the GPU "
                                   f"runs in {t_prog:.3f} ms: in eager mode the GPU waits; fewer "
                                   "launches or a CUDA graph would help")
    missed = ratio > spec.target.vs_gemm
    details["target_met"] = not missed
    status = "failed" if missed and ctx.fail_on_target else "passed"
    return StageResult(name="performance", status=status, details=details,
                       message=("missed the target: " if missed else "") + summary)


def _torch_baseline(task: Task, inputs, grads, compiled: bool) -> Callable[[], Any]:
    spec = task.spec
    # dynamic=False: a worker that already compiled this reference at another shape
    # would otherwise recompile it with dynamic shapes, a slower baseline.
    ref = torch.compile(task.reference_fn, dynamic=False) if compiled else task.reference_fn
    x = {k: v.detach().clone() for k, v in inputs.items()}
    if not grads:
        return lambda: ref(**x, **spec.params)
    for n in spec.gradients:
        x[n].requires_grad_(True)
    names = spec.grad_outputs

    def fwd_bwd():
        outs = ref(**x, **spec.params)
        return torch.autograd.grad([outs[o] for o in names], [x[n] for n in spec.gradients],
                                   [grads[f"d{o}"] for o in names], allow_unused=True)
    return fwd_bwd


STAGE_FUNCTIONS: dict[str, Callable[[Context], StageResult]] = {
    "reference": _stage("reference", _reference),
    "compile": _compile_stage,
    "correctness": _stage("correctness", _correctness),
    "launch_audit": _stage("launch_audit", _launch_audit),
    "performance": _stage("performance", _performance),
}
