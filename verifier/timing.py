"""Stage 6, performance: timing the program cannot steer, and speed in the verdict.

The program runs in the runner; the baselines (the plain GEMMs of the task's
shapes, eager and torch.compile of the reference) run in the judge.  On the
largest named shape set that fits the device (the correctness stage's
estimate; where the baselines' own memory, eager's full logits say, still
runs the card out of memory and the weighing in ``check.out_of_memory`` finds
the program within its share, on the next largest, named in the verdict, unless
the host's enqueue outlasts the program's call there: a verdict about the host,
so none):

1. **Every timed call on inputs the runner has never seen**: the judge writes
   a fresh draw into a buffer set before each timed call, and each call of a
   block has a buffer set of its own, written afresh before the block
   (:mod:`.timed_program`).  Inputs that rotate but keep their values let a
   runner answer from a memo of its results keyed by their contents, with no
   work and right results; counting calls or reading the clock to tell "being
   timed" from "being checked" buys nothing either.
2. **Per-call timing** (the project's method, ``primitives.timing.measure_each``):
   every round times each contender once in a fresh random order, each call
   after an L2 flush and a spin longer than the host needs to enqueue it,
   with CUDA events and the device synchronised around it.  For the program
   the runner takes these times, so they are its claim.
3. **Wall-clock blocks, the judge's own clock**: each contender also runs
   blocks of calls back to back (at least :data:`BLOCK_MS` of work), the device
   synchronised before and after (the runner's side: :func:`runner._block`),
   and the judge times the whole request from outside.  Work on a side stream
   the events never covered, work deferred until after the events, a timer
   patched to report less, all land inside the judge's wall clock; so does a
   host that cannot keep up (a host-bound program is measured at its host's
   pace there, as it runs in eager mode).  Each contender's block starts from
   its steady state: the judge empties its own allocator cache before the
   program's (the runner, another process, cannot use it, and keeps every
   call's results), and runs a baseline once untimed before its own.  The
   runner reports what it saw of each block (its host's share, its
   allocator's device calls) for the report, never for the verdict.
4. **Random results checked**: after a timed call or a block returns, the
   judge picks calls at random (the runner cannot know which before it
   answers) and compares their results with the reference of their draw,
   computed then from its seed; the runner keeps every result until then.
5. **A fresh recomputation** after timing, on a new draw.
6. **The baselines alone**: then the judge ends the runner (its process, its
   device context, and with them any work it left queued) and times the
   baselines again; in the verdict no baseline is slower than
   :data:`SOLO_SLACK` over its time alone.  A runner is idle while the judge
   times a baseline, and what it does then (kernels kept running, whose time
   slices the judge's kernels wait through; a busy host; the judge stopped
   and continued) slows the baselines, never the program, and no result
   check sees it.

Verdict: each regime compares contenders only with each other, never across
(back to back, big GEMMs run at the power cap, where the H200's SM clock
drops 10-25%, and how far depends on each kernel's power draw).  The
per-call times decide, unless the program's events cannot be trusted: when
its back-to-back time exceeds its per-call time by more than every
baseline's does, by :data:`HIDDEN_TOLERANCE`, some of its work escaped its
events (a side stream, a patched timer, work deferred past the end event),
and the back-to-back times decide instead, with a note saying so.  Faster
than the plain GEMMs by more than :data:`IMPOSSIBLE` in either regime is a
rejection (a fused epilogue cannot beat its own GEMMs: some GEMM did not
run); otherwise the stage passes when the program meets ``Target.vs_gemm``
and ``Target.vs_compile`` and is ``slow`` when it misses either (the outcome
``correct_slow``), with a performance report: per-catalogue-launch device
time and configuration from one profiled call, and what is over budget.

A process the runner started that left its session (a GPU runner shares the
judge's PID namespace) ends with the runner (:mod:`.strays`), before the
baselines are timed alone.

What it does not guarantee: work that escapes the program's events is caught
only past :data:`HIDDEN_TOLERANCE` of its time (an honest program's power draw
costs it up to about 11% back to back, and the two cannot be told apart).
GPU work a runner leaves running after it answers
(after escaping Python and skipping its own synchronisation) can overlap what
the judge does next; it is caught only by the result checks racing it.  A
single GPU context for judge and program would close this, which CUDA does
not offer across processes.
"""

from __future__ import annotations

import math
import time
from statistics import median
from typing import Any, Callable, NamedTuple

import torch

from coda_agent.primitives.timing import FlushedCall, enqueue_ms, spin_ms
from coda_agent.tasks.spec import Task
from coda_agent.verifier.calls import Case, GpuCalls, draw_case, verdict
from coda_agent.verifier.inputs import result_shapes
from coda_agent.verifier.check import Check, out_of_memory, runner_out_of_memory
from coda_agent.verifier.program import CandidateError
from coda_agent.verifier.report import StageResult
from coda_agent.verifier.shape_sets import checked_sets, set_bytes
from coda_agent.verifier.stages import mismatch_message
from coda_agent.verifier.timed_program import TimedProgram, call_bytes, reported, seen_of
from coda_agent.verifier.wire import TORCH_DTYPES

INPUT_SETS = 3
BLOCK_ROUNDS, BLOCK_MS, BLOCK_CALLS = 5, 200.0, (4, 32)
BLOCK_BYTES = 32 << 30  # results a block may keep alive in the runner (and at most a third of free memory)
# A block's first call is enqueued while the device idles: a program whose host takes 40 ms to
# enqueue a 55 ms call (the soft-capped LM head's 32 token chunks on an H100) lost 17% back to
# back in blocks of 4, past HIDDEN_TOLERANCE.  Blocks grow until that wait is at most this share.
HOST_SHARE, HOST_CAP_MS = 0.03, 1000.0
IMPOSSIBLE = 0.9  # program / plain GEMMs below this: rejected
# How much more the program's back-to-back time may exceed its per-call time than the
# baselines' do before its events are not believed: what the program's own power draw
# costs it back to back (the quack kernels draw more than cuBLAS and inductor's, and the
# clock falls further), plus the runner's round trip.  Honest experts on the H200 at
# LLaMA-3 70B: 1.6-11.3% (bench/results/h200-2026-12-01-b: swiglu_fwd 11.3%, blocks of
# 7 calls).  So a program can hide at most this share of its time from the verdict.
HIDDEN_TOLERANCE = 0.15
# The most a fused program can gain on torch.compile is compile's own distance from the
# plain GEMMs; a target past it asks for the impossible, and the verdict asks for the cap
# instead, less this much measurement noise (never less than compile's own speed).
CAP_SLACK = 0.02
SPIN_CAP_MS = 20.0
PING_CAP_MS = 0.5  # what the judge grants as the channel's round trip, at most
# The baselines are timed again with no process of the program's left (module docstring, 6): beside
# the runner a baseline may be at most this much slower than alone (the clock's drift between the two
# measurements), and a runner that slows them (work it keeps on the GPU while idle, whose time slices
# the judge's kernels wait through; a host it keeps busy) buys no more.
SOLO_SLACK = 0.1
SOLO_SETTLE_S = 0.2


class _Local:
    """A baseline as a timed contender, in the judge."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        for _ in range(3):
            fn()
        self.spin_ms = spin_ms(enqueue_ms(fn), SPIN_CAP_MS)
        self.timer = FlushedCall()

    def timed(self, spin: float, rep: int) -> float:
        return self.timer(self.fn, self.spin_ms)[0]

    def ready(self) -> None:
        """Before a block: one untimed call, so that the block starts with its memory cached, as a
        training loop's steady state does (the program's turn emptied the cache)."""
        self.fn()
        torch.cuda.synchronize()

    def block(self, calls: int, ping_ms: float) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            self.fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / calls


def _timing_sets(check: Check) -> list[str]:
    """The sets the stage may time at, largest first: the named sets that fit the device."""
    total = torch.cuda.get_device_properties(0).total_memory
    sets, _ = checked_sets(check.spec, check.shape_sets, total)
    named = [s for s in sets if s in check.task.spec.shapes]
    return sorted(named or [max(sets, key=check.spec.flops)], key=check.spec.flops, reverse=True)


def _plain_gemms(spec: Any, shape_set: str) -> Callable[[], Any]:
    """The speed of light: the task's GEMMs, cuBLAS on the inputs' 16-bit type, or for a task whose
    GEMMs run in fp8 (``gemm_dtype``) ``torch._scaled_mm`` on e4m3 with row-wise scales and fast
    accumulation, the fastest fp8 GEMM PyTorch has."""
    shapes = spec.gemm_shapes(shape_set)
    if spec.gemm_dtype == "fp8_e4m3":
        fp8, cuda = torch.float8_e4m3fn, {"device": "cuda"}
        mats = [(torch.randn(m, k, **cuda).to(fp8), torch.randn(n, k, **cuda).to(fp8).t(),
                 torch.rand(m, 1, **cuda) + 0.5, torch.rand(1, n, **cuda) + 0.5) for m, n, k in shapes]
        return lambda: [torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
                        for a, b, sa, sb in mats]
    dtype = TORCH_DTYPES[next(iter(spec.inputs.values())).dtype]
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    pairs = [(torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype))
             for m, n, k in shapes]
    return lambda: [a @ b for a, b in pairs]


def _baselines(task: Task, spec: Any, case: Case, details: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    fns: dict[str, Callable[[], Any]] = {"gemm": _plain_gemms(spec, case.shape_set)}
    for base in spec.baselines:
        if base in ("eager", "compile"):
            try:
                fns[base] = _torch_baseline(task, case, compiled=base == "compile")
                fns[base]()  # compiles here, so a failure is the baseline's, not the timing's
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                fns.pop(base, None)
                details[f"{base}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return fns


def _torch_baseline(task: Task, case: Case, compiled: bool) -> Callable[[], Any]:
    # dynamic=False: a judge that already compiled this reference at another shape
    # would otherwise recompile it with dynamic shapes, a slower baseline.
    ref = torch.compile(task.reference_fn, dynamic=False) if compiled else task.reference_fn
    return reference_call(ref, task.spec, case.inputs, case.grads, case.params)


def reference_call(fn: Callable[..., Any], spec: Any, inputs: dict[str, torch.Tensor],
                   grads: dict[str, torch.Tensor] | None, params: dict[str, Any]) -> Callable[[], Any]:
    """A PyTorch reference (eager or compiled) as a timed contender, on its own copies of
    ``inputs`` with ``params``: forward, and given ``grads`` the backward autograd derives for the task's
    ``gradients`` from the upstream gradients of its ``grad_outputs``.  The verifier's
    baselines and the benchmark's (``bench/run.py``) are this one call."""
    x = {k: v.detach().clone() for k, v in inputs.items()}
    if not grads:
        return lambda: fn(**x, **params)
    for n in spec.gradients:
        x[n].requires_grad_(True)
    names = spec.grad_outputs

    def fwd_bwd() -> Any:
        outs = fn(**x, **params)
        return torch.autograd.grad([outs[o] for o in names], [x[n] for n in spec.gradients],
                                   [grads[f"d{o}"] for o in names], allow_unused=True)
    return fwd_bwd


def performance(check: Check) -> StageResult:
    """Times the program at the largest set that fits (module docstring); a set whose timing runs
    the card out of memory where the program is within its share gives way to the next one, unless
    the program's call there is mostly its host's (no speed verdict: the first set's error)."""
    sets = _timing_sets(check)
    too_large: list[str] = []
    first: StageResult | None = None  # the largest set's out-of-memory, weighed
    for shape_set in sets:
        try:
            res = _perform(check, shape_set)
        except (torch.OutOfMemoryError, CandidateError) as e:
            weighed = (out_of_memory("performance", check, str(e)) if isinstance(e, torch.OutOfMemoryError)
                       else runner_out_of_memory("performance", check, e.message))
            if weighed is None:
                raise
            if weighed.status != "error" or shape_set == sets[-1]:
                weighed.details["timing_sets_too_large"] = too_large
                return weighed
            too_large.append(shape_set)
            first = first or weighed
            torch.cuda.empty_cache()
            continue
        if first is not None and (host := _host_bound(res)):
            first.details.update(timing_sets_too_large=too_large, host_bound_at=shape_set)
            first.message += (f"; the sets that fit below it are too small to judge a speed: at {shape_set} the host "
                              f"takes {host[0]:.3f} ms to enqueue a call of {host[1]:.3f} ms (a verdict about the "
                              "host, not the kernels). A card with more memory times it")
            return first
        if too_large:
            res.details["timing_sets_too_large"] = too_large
            res.message += (f" (timed at {shape_set}: the judge's timing of {', '.join(too_large)} ran this GPU "
                            "out of memory with the program within its share; a card with more memory times it)")
        return res
    raise AssertionError("unreachable: the last set returns")


def _host_bound(res: StageResult) -> tuple[float, float] | None:
    """(host ms, program ms) of a timed set where the host's enqueue of a call outlasts the call."""
    host, prog = res.details.get("host_ms"), res.details.get("ms", {}).get("program")
    return (host, prog) if host is not None and prog is not None and host >= prog else None


def _perform(check: Check, shape_set: str) -> StageResult:
    spec = check.spec
    check.load("performance", "cute")
    calls = GpuCalls(check, spec, "performance")
    details: dict[str, Any] = {"reps": check.reps}
    try:
        cases = [draw_case(check.task, spec, shape_set, check.seed(), "cuda") for _ in range(INPUT_SETS)]
        sets = [calls.load(case, key=i) for i, case in enumerate(cases)]
        for case, sid in zip(cases, sets):  # warm-up (compiles, tuning lookups), and a first check
            if ms := verdict(spec, case, calls.run(case, sid, poison=False)):
                return StageResult(name="performance", status="failed", mismatches=ms,
                                   message="before timing: " + mismatch_message(ms))
        program = TimedProgram(check, calls, cases, sets, "performance")
        # every timed call draws afresh (timed_program): the baselines and the profile keep the first case
        del cases[1:], case
        host = check.request({**program._header("enqueue"), "set": sets[0]})
        host_ms = reported(host.get("host_ms"), "the host time of a call")
        spin = spin_ms(host_ms, SPIN_CAP_MS)
        contenders: dict[str, Any] = {"program": program}
        contenders.update({k: _Local(fn) for k, fn in _baselines(check.task, spec, cases[0], details).items()})
        times = _measure(check, contenders, spin, host_ms, details, shape_set)
        fresh = draw_case(check.task, spec, shape_set, check.seed(), "cuda")
        if ms := verdict(spec, fresh, calls.run(fresh, calls.load(fresh, key=0), poison=False)):
            return StageResult(name="performance", status="failed", mismatches=ms,
                               message="after timing, on fresh inputs: " + mismatch_message(ms))
        del fresh
        details["host_ms"] = round(host_ms, 4)
        profile = _profile_reply(check, calls, cases[0])  # for a slow verdict: the runner ends next
        calls.close()
        check.end_runner()  # its process, its device context and whatever it left queued on the GPU
        baselines = {k: v for k, v in contenders.items() if k != "program"}
        times = capped(times, _solo(check, baselines, details["block_calls"]), details)
        res = _verdict(check, shape_set, times, details, cases[0], calls, profile)
    finally:
        calls.close()
    return res


class Times(NamedTuple):
    """Each contender's median ms in the two regimes (module docstring, 2 and 3)."""

    per_call: dict[str, float]  # CUDA events around one flushed call on a rested GPU
    back_to_back: dict[str, float]  # the judge's wall clock over a block, per call


def _per_call(check: Check, contenders: dict[str, Any], spin: float) -> dict[str, list[float]]:
    """Each contender's event times, one call of each per round in a fresh random order."""
    names = list(contenders)
    events: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(check.reps):
        for name in check.rng.sample(names, len(names)):
            events[name].append(contenders[name].timed(spin, rep))
    return events


def _blocks(check: Check, contenders: dict[str, Any], n_calls: int, ping_ms: float) -> dict[str, list[float]]:
    """Each contender's wall time per call over blocks of ``n_calls``, one block of each per round."""
    names = list(contenders)
    walls: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(BLOCK_ROUNDS):
        for name in check.rng.sample(names, len(names)):
            contenders[name].ready()
            walls[name].append(contenders[name].block(n_calls, ping_ms if name == "program" else 0.0))
    return walls


def _measure(check: Check, contenders: dict[str, Any], spin: float, host_ms: float, details: dict[str, Any],
             shape_set: str) -> Times:
    event_ms = {n: median(v) for n, v in _per_call(check, contenders, spin).items()}
    ping_ms = min(PING_CAP_MS, min(_ping(check) for _ in range(5)))
    n_calls = _block_calls(check, event_ms, host_ms, shape_set)
    walls = _blocks(check, contenders, n_calls, ping_ms)
    wall_ms = {n: median(v) for n, v in walls.items()}
    details["event_ms"] = {n: round(v, 4) for n, v in event_ms.items()}
    details["wall_ms"] = {n: round(v, 4) for n, v in wall_ms.items()}
    details["wall_spread"] = {n: round((max(v) - min(v)) / median(v), 3) for n, v in walls.items()}
    details["block_calls"] = n_calls
    details["program_blocks"] = contenders["program"].seen
    return Times(event_ms, wall_ms)


def _solo(check: Check, baselines: dict[str, "_Local"], n_calls: int) -> Times:
    """The baselines timed again as :func:`_measure` times them (blocks of the same size; a baseline
    spins by its own enqueue time), with no process of the program's left (module docstring, 6)."""
    torch.cuda.synchronize()
    time.sleep(SOLO_SETTLE_S)  # the ended runner's context is torn down by the driver
    events, walls = _per_call(check, baselines, 0.0), _blocks(check, baselines, n_calls, 0.0)
    return Times({n: median(v) for n, v in events.items()}, {n: median(v) for n, v in walls.items()})


def capped(times: Times, solo: Times, details: dict[str, Any]) -> Times:
    """``times`` with each baseline's time in each regime at most :data:`SOLO_SLACK` over its time
    alone (``solo``); the program's as measured.  The names of the baselines it capped go in
    ``details`` (``baselines_capped``), with the solo times."""
    regimes = []
    for beside, alone in ((times.per_call, solo.per_call), (times.back_to_back, solo.back_to_back)):
        regimes.append({n: v if n not in alone else min(v, alone[n] * (1 + SOLO_SLACK)) for n, v in beside.items()})
    details["solo_ms"] = {"per_call": {n: round(v, 4) for n, v in solo.per_call.items()},
                          "back_to_back": {n: round(v, 4) for n, v in solo.back_to_back.items()}}
    slowed = sorted(n for n in solo.per_call if regimes[0][n] < times.per_call[n]
                    or regimes[1].get(n, 0) < times.back_to_back.get(n, 0))
    if slowed:
        details["baselines_capped"] = slowed
    return Times(*regimes)


def _ping(check: Check) -> float:
    t0 = time.perf_counter()
    check.request({"op": "ping"})
    return (time.perf_counter() - t0) * 1e3


def _block_calls(check: Check, event_ms: dict[str, float], host_ms: float, shape_set: str) -> int:
    room = min(BLOCK_BYTES, torch.cuda.mem_get_info()[0] // 3)
    return block_calls(max(event_ms.values()), event_ms["program"], host_ms, room,
                       max(call_bytes(check.spec, shape_set), 1))


def block_calls(slowest_ms: float, program_ms: float, host_ms: float, room: int, per_call: int) -> int:
    """Calls per block: enough for :data:`BLOCK_MS` of the slowest contender's work (the
    request's fixed costs and its round trip spread thin), and enough that the first call's
    enqueue, which no GPU work hides, is at most :data:`HOST_SHARE` of the program's block
    (``host_ms``: the runner's own report, so it only ever lengthens blocks, never shortens
    a time); as many as the runner may keep results of (``room`` bytes, ``per_call`` each)."""
    lo, hi = BLOCK_CALLS
    n = max(math.ceil(BLOCK_MS / max(slowest_ms, 1e-3)),
            math.ceil(min(host_ms, HOST_CAP_MS) / (HOST_SHARE * max(program_ms, 1e-3))))
    return max(lo, min(hi, n, room // per_call))


def _verdict(check: Check, shape_set: str, times: Times, details: dict[str, Any], case: Case,
             calls: GpuCalls, profile: dict[str, Any] | None = None) -> StageResult:
    spec = check.spec
    per_call, back = times
    excess = {n: back[n] / per_call[n] for n in per_call}
    honest = max(v for n, v in excess.items() if n != "program")
    trusted = excess["program"] <= honest * (1 + HIDDEN_TOLERANCE)
    ms = per_call if trusted else back
    t_prog, t_gemm = ms["program"], ms["gemm"]
    flops = spec.flops(shape_set)
    details["shape_set"] = shape_set
    details["events_trusted"] = trusted
    details["ms"] = {k: round(v, 4) for k, v in ms.items()}
    details["tflops"] = round(flops / (t_prog * 1e-3) / 1e12, 1)
    details["gbytes_per_s"] = round(set_bytes(spec, shape_set) / (t_prog * 1e-3) / 1e9, 1)
    ratio = t_prog / t_gemm
    details["vs_gemm"] = round(ratio, 3)
    details["target_vs_gemm"] = spec.target.vs_gemm
    details["target_vs_compile"] = spec.target.vs_compile
    want = spec.target.vs_compile
    if "compile" in ms:
        details["compile_speedup"] = round(ms["compile"] / t_prog, 3)
        cap = ms["compile"] / t_gemm
        want = min(want, max(1.0, cap * (1 - CAP_SLACK)))
        details["compile_cap"] = round(cap, 3)
        details["target_vs_compile_applied"] = round(want, 3)
    how = (f" (baselines capped at {100 * SOLO_SLACK:.0f}% over their times alone, {', '.join(details['baselines_capped'])}: "
           "they ran slower beside the program's runner than with no process of it left)"
           if details.get("baselines_capped") else "")
    how += ("" if trusted else
           f" (judged back to back: its events saw {100 * (1 - 1 / excess['program']):.0f}% less than the judge's "
           f"clock, against at most {100 * max(0.0, 1 - 1 / honest):.0f}% for the baselines; work its events did "
           "not cover)")
    summary = (f"{t_prog:.3f} ms on {shape_set} = {ratio:.2f}x the plain GEMMs ({t_gemm:.3f} ms; target <= "
               f"{spec.target.vs_gemm})" + (f", torch.compile {ms['compile']:.3f} ms = "
                                             f"{details['compile_speedup']:.2f}x (target >= {_target(spec, want)})"
                                             if "compile" in ms else "")
               + (f", eager {ms['eager']:.3f} ms" if "eager" in ms else "") + f", {details['tflops']} TFLOP/s"
               + how)
    fastest = min(ratio, back["program"] / back["gemm"])  # events that are not believed claim nothing
    if fastest < IMPOSSIBLE:
        return StageResult(name="performance", status="failed", details=details,
                           message=f"impossibly fast: {summary}.  A fused epilogue runs its GEMMs and more, so "
                                   f"it cannot be {1 / fastest:.2f}x faster than the plain GEMMs of the same "
                                   "shapes: some GEMM did not run, or the timing was not of the whole call")
    missed = [f"vs the plain GEMMs {ratio:.2f}x > {spec.target.vs_gemm}"] if ratio > spec.target.vs_gemm else []
    if "compile" in ms and details["compile_speedup"] < want:
        missed.append(f"vs torch.compile {details['compile_speedup']:.2f}x < {want:.3g}")
    details["target_met"] = not missed
    if not missed:
        return StageResult(name="performance", status="passed", details=details, message=summary)
    details["profile"] = _profile(profile if profile is not None else _profile_reply(check, calls, case), t_gemm)
    return StageResult(name="performance", status="slow", details=details,
                       message=f"correct but slow ({'; '.join(missed)}): {summary}")


def _target(spec: Any, want: float) -> str:
    if want >= spec.target.vs_compile:
        return f"{spec.target.vs_compile}"
    return (f"{want:.3g}: the task's {spec.target.vs_compile} is past the cap, torch.compile's own distance from "
            f"the plain GEMMs")


def _profile_reply(check: Check, calls: GpuCalls, case: Case) -> dict[str, Any]:
    """The runner's report of one profiled call."""
    return check.request({"op": "profile", "tag": "performance", "set": calls.load(case, key=0),
                          "backward": case.grads is not None, "params": case.params,
                          "shapes": result_shapes(check.spec, case.shape_set)})


def _profile(prof: dict[str, Any], t_gemm: float) -> dict[str, Any]:
    """Where the time goes, from one profiled call (the runner's report, for the feedback)."""
    kernel_ms = {str(k): float(v) for k, v in (prof.get("kernel_ms") or {}).items()
                 if type(v) in (int, float)}
    gemm_ms = sum(v for k, v in kernel_ms.items() if k.startswith("coda::gemm::"))
    return {"kernel_ms": dict(sorted(kernel_ms.items(), key=lambda kv: -kv[1])[:12]),
            "configs": [str(c) for c in prof.get("configs", [])][:12],
            "gemm_launches_ms": round(gemm_ms, 4),
            "aux_launches_ms": round(sum(kernel_ms.values()) - gemm_ms, 4),
            "plain_gemms_ms": round(t_gemm, 4)}
