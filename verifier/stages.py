"""Stages 2-5, as the judge runs them (the performance stage is :mod:`.timing`).

Each ``stage(check) -> StageResult`` draws what it needs, asks the check's
runner, and decides; a :class:`CandidateError` raised anywhere below becomes
the stage's failure (:meth:`Judge._stage`).  What each stage guarantees is in
the package docstring (``coda_agent.verifier``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from coda_agent.kernels.contract import takes_needs
from coda_agent.verifier.calls import Case, CpuCalls, GpuCalls, draw_case, verdict
from coda_agent.verifier.check import Check
from coda_agent.verifier.program import CandidateError
from coda_agent.verifier.report import Mismatch, StageResult
from coda_agent.verifier.shape_sets import beyond_set, checked_sets, set_bytes, set_label, small_sets

SEEDS_PER_SET = 2  # the second with outlier channels (outliers.py); and one draw of edge rows


def mismatch_message(ms: list[Mismatch]) -> str:
    m = ms[0]
    more = f" (and {len(ms) - 1} more: {', '.join(x.tensor for x in ms[1:])})" if len(ms) > 1 else ""
    return (f"`{m.tensor}` differs from the reference on shape set {m.shape_set} with {m.inputs or 'fresh inputs'}: "
            f"{m.pattern}; max abs error {m.max_abs_err:.3g} (allowed {m.allowed:.3g}) at index {m.worst_index}"
            f"{'' if m.rel_norm_err is None else f', relative norm error {m.rel_norm_err:.3g}'}{more}")


def _identical(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], a: Case, b: Case) -> str | None:
    """A result that came out bit-identical for two different draws where the reference differs."""
    for k, v in second.items():
        if first[k].shape == v.shape and torch.equal(first[k], v) and not torch.equal(a.hi[k], b.hi[k]):
            return k
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (torch.equal(a, b) or (a.is_floating_point() and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())))


def _check_sets(check: Check, sets: list[str], device: str, call: Callable[[Case], dict[str, torch.Tensor]],
                determinism: bool, poisoned: bool, padded: bool = False,
                seconds: dict[str, float] | None = None) -> StageResult | None:
    """Every set: two fresh draws (the second with outlier channels), one of edge rows and two at other
    magnitudes, one small and one large (no result may come out identical for two different draws;
    all but the first with the check's varied params, :func:`~.inputs.drawn_params`); with
    ``padded``, the first draw's case again with the epilogues run over whole tiles
    (:func:`~coda_agent.primitives.lowering.padded_lanes`), where a reduction that folds padded
    lanes shows what the kernel would compute: the same inputs and references, so only the padded
    lanes differ from a call that passed (on a set whose sizes every tile divides it is that call
    again, which costs little and needs no rule for which sets are ragged under which of the
    program's tile configurations); and for a task with a backward, the first draw's forward alone,
    whose outputs must match without a backward after them. None when everything matched, else the
    failed StageResult's fields; ``seconds`` gets each finished set's time (judge and runner
    together).  Of the earlier draws the judge keeps the first draw's case (the padded and
    forward-alone calls reuse it) and, until this draw's results are compared with them (the
    identity rule), the previous draw's case and results, no more: on the GPU every draw's inputs,
    references and results are the size of the set."""
    spec = check.spec
    subsets = needs_sets(check)
    for index, shape_set in enumerate(sets):
        t0 = time.perf_counter()
        first: Case | None = None
        last: tuple[Case, dict[str, torch.Tensor]] | None = None
        case = got = None  # the previous set's, released before this set's references are drawn
        # The forward alone too: a backward may not mend in place what its forward returned wrong.
        draws = (["seed"] + ["outliers"] * (SEEDS_PER_SET - 1) + ["edge", "scaled", "scaled"]
                 + (["padded"] if padded else []) + (["forward"] if spec.has_backward else []))
        for i, draw in enumerate(draws):  # the first draw with the task's params, the rest the check's
            # every set at a small and a large magnitude, the set's first in turn
            magnitude = check.magnitude * (-1) ** (index + draws[:i].count("scaled"))
            if draw == "padded":
                case = dataclasses.replace(first, draw=draw)
            elif draw == "forward":
                case = first.forward_alone(spec)
            else:
                case = draw_case(check.task, spec, shape_set, check.seed(), device, draw,
                                 varied=check.params if i else None, magnitude=magnitude)
            got = call(case)
            if last is not None and (same := _identical(last[1], got, last[0], case)):
                return StageResult(name="reference", status="failed",
                                   message=f"`{same}` is identical for two different inputs "
                                           f"({set_label(spec, shape_set)}): "
                                           "results must be computed from the inputs of the call")
            last = None  # the previous draw has served: its results go before this draw's calls
            ms = verdict(spec, case, got, poisoned=poisoned)
            if ms:
                return StageResult(name="reference", status="failed", message=mismatch_message(ms), mismatches=ms)
            if determinism and first is None:
                again = call(case)
                diff = [k for k in got if not _same_bits(got[k], again[k])]
                del again
                if diff:
                    return StageResult(name="reference", status="failed",
                                       message=f"not deterministic: `{diff[0]}` differs between two runs on "
                                               f"the same inputs ({set_label(spec, shape_set)})")
            if draw not in ("padded", "forward") and (failed := _check_needs(check, subsets, case, call, poisoned)):
                return failed
            if first is None:
                first = case
            last = (case, got)
        if seconds is not None:
            seconds[shape_set] = round(time.perf_counter() - t0, 2)
    return None


def needs_sets(check: Check) -> list[frozenset[str]]:
    """The smaller gradient sets a caller may ask the program's backward for: none unless it
    declares ``needs`` (``kernels/contract.py``)."""
    spec = check.spec
    return spec.gradient_subsets[1:] if spec.has_backward and takes_needs(check.source) else []


def _check_needs(check: Check, subsets: list[frozenset[str]], case: Case,
                 call: Callable[[Case], dict[str, torch.Tensor]], poisoned: bool) -> StageResult | None:
    """A backward that declares ``needs`` (``kernels/contract.py``), asked for each smaller set of
    gradients a caller may ask for (``subsets``: :func:`needs_sets`), on ``case``'s inputs (every
    draw the whole set is checked on: a path for fewer gradients is held to the same inputs):
    every gradient asked for must match the reference, whatever the program leaves out."""
    spec = check.spec
    for needs in subsets:
        asked = case.needing(spec, needs)
        try:
            ms = verdict(spec, asked, call(asked), poisoned=poisoned)
        except CandidateError as e:
            if "needs=" not in e.message:
                e.message = f"backward called with needs={sorted(needs)}: {e.message}"
            raise
        if ms:
            return StageResult(name="reference", status="failed", mismatches=ms,
                               message=f"backward called with needs={sorted(needs)}: {mismatch_message(ms)}")
    return None


def _subsets_note(check: Check) -> str:
    n = len(needs_sets(check))
    return f"; backward also asked for {n} smaller gradient set{'s' * (n > 1)} (needs)" if n else ""


def _beyond_sizes(check: Check) -> dict[str, int]:
    """The sizes the judge drew for this check's beyond set (:func:`~.shape_sets.beyond_set`)."""
    return dict(check.spec.shapes[beyond_set(check.spec)[0]])


def _drawn_details(check: Check) -> dict[str, Any]:
    """What the judge drew for this check's CPU stage: the beyond and small sets' sizes
    (:mod:`.inputs`) and the varied params."""
    small = {name: dict(check.spec.shapes[name]) for name, _ in small_sets(check.spec)}
    return {"beyond_set": _beyond_sizes(check), "small_sets": small, "varied_params": check.params}


def _what(check: Check) -> str:
    return "forward+backward, and the forward alone" if check.spec.has_backward else "forward"


# --------------------------------------------------------------------------- 2. reference

def reference(check: Check) -> StageResult:
    """The program under the catalogue's PyTorch lowering against the reference, on the CPU."""
    sets, _ = checked_sets(check.spec, None, None)
    check.load("reference", "reference")
    calls = CpuCalls(check, check.spec, "reference")
    failed = _check_sets(check, sets, "cpu", lambda case: calls(case, audit=True), determinism=False,
                         poisoned=False, padded=True)
    if failed is not None:
        return failed
    return StageResult(name="reference", status="passed",
                       message=f"matches the PyTorch reference on {', '.join(sets)} ({SEEDS_PER_SET} fresh draws, "
                               f"one with outlier channels, edge rows, two at other magnitudes and whole tiles, {_what(check)}"
                               f"{_subsets_note(check)})",
                       details={"shape_sets": sets, "tensors": sorted(check.spec.outputs), **_drawn_details(check)})


# --------------------------------------------------------------------------- 3. compile

def _compile(check: Check) -> StageResult:
    spec = check.spec
    shape_set = spec.cpu_shape_set
    carriers = [{"name": n, "dtype": t.dtype, "shape": list(spec.shape_of(t, shape_set))}
                for n, t in spec.inputs.items()]
    carriers += [{"name": f"d{o}", "dtype": spec.outputs[o].dtype,
                  "shape": list(spec.shape_of(spec.outputs[o], shape_set))} for o in spec.grad_outputs]
    reply = check.request({"op": "compile", "source": check.source, "python_rules": check.python_rules,
                           "contract": check.contract(), "tensors": carriers, "backward": spec.has_backward,
                           "needs_sets": [sorted(s) for s in needs_sets(check)]})
    return compile_result(kernel_reports(reply), shape_set)


SASS_COUNTS = ("hgmma", "spill_stores", "spill_loads", "calls")  # the SASS report's numbers the gate adds


def kernel_reports(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernels of the runner's reply to ``compile``, each a dict whose SASS report (if any)
    holds counts where the gate adds counts: the reply is the runner's word, and a field of
    another JSON type would raise in the judge, which reports its own error, not the program's
    failure."""
    kernels = reply.get("kernels")
    if not isinstance(kernels, list) or not all(isinstance(k, dict) and _sass_ok(k.get("sass")) for k in kernels):
        raise CandidateError("the runner's reply to `compile` is not a list of kernel reports with their SASS "
                             "counts: the program tampered with its runner")
    return kernels


def _sass_ok(sass: Any) -> bool:
    return sass is None or (isinstance(sass, dict) and all(
        isinstance(sass.get(f, 0), int) and sass.get(f, 0) >= 0 for f in SASS_COUNTS))


def _runner_list(prof: dict[str, Any], key: str) -> list[Any]:
    """``prof[key]`` (default empty), which must be a list (see :func:`kernel_reports`)."""
    value = prof.get(key, [])
    if not isinstance(value, list):
        raise CandidateError(f"the runner's `profile` reply holds a {type(value).__name__} as `{key}`, not a "
                             "list: the program tampered with its runner")
    return value


def compile_result(kernels: list[dict[str, Any]], shape_set: str) -> StageResult:
    """The SASS gate over the kernels the runner compiled (its report: a diagnostic, see the
    package docstring)."""
    log = "\n\n".join(f"== {k.get('epilogue')} [{k.get('config')}] {k.get('seconds')}s\n{k.get('log', '')}"
                      for k in kernels)[-4000:]
    per_kernel = [{"epilogue": k.get("epilogue"), "config": k.get("config"), "seconds": k.get("seconds"),
                   "kind": "pass" if k.get("kind") == "pass" else "gemm",
                   **(k["sass"] if isinstance(k.get("sass"), dict) else {"sass": None})} for k in kernels]
    details: dict[str, Any] = {"kernels": per_kernel, "shape_set": shape_set}
    if not kernels:
        return StageResult(name="compile", status="failed", log=log, details=details,
                           message="the program made no gemm() call; every task runs at least one GEMM")
    sass = [(f"{k.get('epilogue')}", k["sass"]) for k in kernels if isinstance(k.get("sass"), dict)]
    problems = [f"{name}: not compiled for sm_90a" for name, s in sass if not s.get("sm90a")]
    # A tile pass's own kernel streams its operands and has no mainloop; every GEMM keeps its MMA.
    gemms = [(f"{k.get('epilogue')}", k["sass"]) for k in kernels
             if isinstance(k.get("sass"), dict) and k.get("kind") != "pass"]
    problems += [f"{name}: no HGMMA instructions (the mainloop lost its warpgroup MMA)"
                 for name, s in gemms if s.get("sm90a") and not s.get("hgmma")]
    spills: dict[str, int] = {}
    calls: dict[str, int] = {}
    for name, s in sass:
        if s.get("spill_stores") or s.get("spill_loads"):
            spills[name] = spills.get(name, 0) + s.get("spill_stores", 0) + s.get("spill_loads", 0)
        if s.get("calls"):
            calls[name] = calls.get(name, 0) + s["calls"]
    if spills:
        details["spills"] = spills
    if calls:
        details["slow_calls"] = calls
    if problems:
        return StageResult(name="compile", status="failed", message="; ".join(problems), log=log, details=details)
    if len(sass) < len(kernels):
        details["sass_unavailable"] = True
    note = "; SASS gate NOT run (install nvidia-cuda-cuobjdump)" if details.get("sass_unavailable") else ""
    note += (f"; register spills in {', '.join(f'{e} ({n} STL/LDL)' for e, n in spills.items())}: "
             "keep fewer values live in the epilogue, or give that GEMM a cooperative tile, whose "
             "threads hold more registers (`config=TileConfig(tile_m=128, tile_n=128, pingpong=False)`)"
             ) if spills else ""
    note += (f"; slow-path CALLs in {', '.join(f'{e} ({n})' for e, n in calls.items())}: an IEEE "
             "division `a / b` calls a subroutine per element; write `a * reciprocal(b)`, or pass "
             "a precomputed reciprocal as a Scalar/vector") if calls else ""
    return StageResult(name="compile", status="passed", log=log, details=details,
                       message=f"{len(kernels)} kernel(s) compiled for sm_90a, every GEMM with HGMMA{note}")


def compile_stage(check: Check) -> StageResult:
    """The compile stage through the persistent compile cache (when ``check.compile_cache``)."""
    from coda_agent.verifier import compile_cache

    t0 = time.perf_counter()
    key = None
    if check.compile_cache:
        try:
            key = compile_cache.compile_key(check.task, check.source)
        except Exception:  # noqa: BLE001 - fail closed: no key, no cache
            key = None
    if key is not None and (hit := compile_cache.get(key)) is not None:
        hit.seconds = round(time.perf_counter() - t0, 3)
        return hit
    res = _compile(check)
    res.seconds = round(time.perf_counter() - t0, 3)
    if key is not None:
        compile_cache.put(key, res)
    return res


# --------------------------------------------------------------------------- 4. correctness

def correctness(check: Check) -> StageResult:
    """The cute lowering on the GPU against the fp32 reference: every set that fits the
    device, NaN-poisoned outputs, inputs unmodified, deterministic."""
    total = torch.cuda.get_device_properties(0).total_memory
    sets, skipped = checked_sets(check.spec, check.shape_sets, total)
    torch.cuda.reset_peak_memory_stats()  # the judge's own peak, reported for GPU_MEMORY_FACTOR
    check.load("correctness", "cute")
    calls = GpuCalls(check, check.spec, "correctness")
    seconds: dict[str, float] = {}
    try:
        failed = _check_sets(check, sets, "cuda", calls, determinism=True, poisoned=True, seconds=seconds)
    finally:
        calls.close()
    if failed is not None:
        return failed.model_copy(update={"name": "correctness", "details": {"shape_sets": sets}})
    return StageResult(name="correctness", status="passed",
                       message=f"matches the fp32 reference on {', '.join(sets)} ({SEEDS_PER_SET} fresh draws, one with "
                               f"outlier channels, edge rows, two at other magnitudes{_subsets_note(check)}, NaN-poisoned outputs, "
                               "inputs unmodified, deterministic)"
                               + (f"; NOT checked, too large for this GPU's {total / 2**30:.0f} GiB: "
                                  f"{', '.join(skipped)}" if skipped else ""),
                       details={"shape_sets": sets, "skipped_shape_sets": skipped, "seconds_by_set": seconds,
                                "beyond_set": _beyond_sizes(check),
                                "judge_peak_over_set": round(torch.cuda.max_memory_allocated() / max(
                                    set_bytes(check.spec, s, itemsize=4) for s in sets), 2)})


# --------------------------------------------------------------------------- 5. launch audit

def launch_audit(check: Check) -> StageResult:
    """Where the device work came from, as the runner's profiler saw it (a diagnostic)."""
    spec = check.spec
    check.load("audit", "cute")
    calls = GpuCalls(check, spec, "audit")
    try:
        case = draw_case(check.task, spec, spec.cpu_shape_set, check.seed(), "cuda")
        prof = check.request({"op": "profile", "tag": "audit", "set": calls.load(case),
                              "backward": case.grads is not None, "params": case.params,
                              "shapes": {k: list(v.shape) for k, v in case.hi.items()}})
    finally:
        calls.close()
    return audit_result(prof)


def audit_result(prof: dict[str, Any]) -> StageResult:
    ledger = [str(x) for x in _runner_list(prof, "ledger")][:200]
    kernels = [str(x) for x in _runner_list(prof, "kernels")][:50]
    n_kernels = prof.get("n_kernels") if type(prof.get("n_kernels")) is int else len(kernels)
    details = {"ledger": ledger, "kernels": kernels, "n_kernels": n_kernels, "n_ledger": len(ledger)}
    err = prof.get("torch_compute")
    if isinstance(err, dict):
        return StageResult(name="launch_audit", status="failed", details=details,
                           message="launch audit: " + str(err.get("message"))[:2000],
                           line=err.get("line") if type(err.get("line")) is int else None)
    outside = [str(x) for x in _runner_list(prof, "outside")]
    if outside:
        return StageResult(name="launch_audit", status="failed", details=details,
                           message=f"{len(outside)} device launch(es) outside any catalogue call "
                                   f"({', '.join(sorted(set(outside))[:5])}): only gemm() and the "
                                   "catalogue's auxiliary kernels may run device work")
    if n_kernels < len(ledger):
        return StageResult(name="launch_audit", status="error", details=details,
                           message=f"the profiler saw {n_kernels} kernels for {len(ledger)} catalogue "
                                   "launches; the audit cannot attribute them")
    return StageResult(name="launch_audit", status="passed", details=details,
                       message=f"{n_kernels} kernel(s), all inside {len(ledger)} catalogue launch(es) "
                               f"({sum(x.startswith('gemm:') for x in ledger)} GEMM)")


def _performance(check: Check) -> StageResult:
    from coda_agent.verifier.timing import performance

    return performance(check)


STAGE_FUNCTIONS: dict[str, Callable[[Check], StageResult]] = {
    "reference": reference, "compile": compile_stage, "correctness": correctness,
    "launch_audit": launch_audit, "performance": _performance}
