"""The program as a timed contender of the performance stage (:mod:`.timing`): every timed call
on inputs its runner has never seen.

The runner may be the program's (a program that escaped its Python rules answers for it).  A
runner that keeps each call's results keyed by its inputs' contents (a checksum costs one read of
the inputs, nothing beside the GEMMs) answers a call on inputs it has seen with no work at all,
padded with a sleep to the plain GEMMs' time; every result it returns is right, so no result
check sees it, and the judge's wall clock times the sleep.  Input sets that rotate but keep their
values are such inputs from the warm-up on (the stage drew three sets once and timed every call
on one of them).  So the judge writes a fresh draw into a buffer set before every timed call, and
a block runs each of its calls on a buffer set of its own, each written afresh before the block:
no timed call has inputs an earlier call had.  The buffers stay (a block's extra sets are
allocated once, and the runner's room for a block counts them, :func:`call_bytes`); only their
values change.  A fresh draw's references are computed for the calls the judge checks alone,
after they return, from the draw's seed: :func:`~.inputs.make_inputs` is deterministic in it, so
:func:`~.calls.draw_case` gives the same inputs with their references.

What this does not close: a runner that caches what depends on the weights alone (a transposed
or requantized copy) gains where a training step's weights would have changed; the fresh draws
change every input, weights included, so such a cache misses too.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from coda_agent.verifier.calls import Case, GpuCalls, draw_case, verdict
from coda_agent.verifier.check import Check
from coda_agent.verifier.inputs import make_grads, make_inputs, result_bytes, result_shapes
from coda_agent.verifier.program import CandidateError
from coda_agent.verifier.stages import mismatch_message
from coda_agent.verifier.wire import nbytes

CHECK_FRACTION = 0.25  # chance a per-call timing's results are compared
CHECKED_PER_BLOCK = 2


def reported(value: Any, what: str) -> float:
    """A number the runner reported (a time): finite and not negative, else the program's failure."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise CandidateError(f"the runner reported {value!r} as {what}")
    return float(value)


def seen_of(seen: Any, wall_ms: float) -> dict[str, float]:
    """What the runner says slowed a block (its host's time, its allocator's device calls), kept
    for the report when well formed: the runner's word, never the verdict's."""
    out = {k: v for k, v in (seen.items() if isinstance(seen, dict) else ())
           if isinstance(k, str) and len(k) < 40 and type(v) in (int, float) and math.isfinite(v)}
    return {**dict(list(out.items())[:8]), "judge_wall_ms": round(wall_ms, 3)}


def call_bytes(spec: Any, shape_set: str) -> int:
    """What one call of a block holds in the runner: its results and its own buffer set (inputs
    and upstream gradients)."""
    inputs = sum(nbytes(t.dtype, list(spec.shape_of(t, shape_set))) for t in spec.inputs.values())
    grads = sum(nbytes(spec.outputs[o].dtype, list(spec.shape_of(spec.outputs[o], shape_set)))
                for o in spec.grad_outputs) if spec.has_backward else 0
    return result_bytes(spec, shape_set) + inputs + grads


class TimedProgram:
    """The program as a timed contender: requests to the runner, each call on a fresh draw."""

    def __init__(self, check: Check, calls: GpuCalls, cases: list[Case], sets: list[int], tag: str):
        self.check, self.calls, self.tag = check, calls, tag
        self.n_sets = len(sets)  # the warm-up's buffer sets, keys 0..n_sets-1
        self.shape_set = cases[0].shape_set
        self.device = cases[0].device
        self.backward = cases[0].grads is not None
        self.shapes = result_shapes(check.spec, self.shape_set)
        self.seen: list[dict[str, float]] = []  # each block's diagnostics, as the runner reports them

    def _header(self, op: str) -> dict[str, Any]:
        return {"op": op, "tag": self.tag, "backward": self.backward, "shapes": self.shapes}

    def _fresh(self, key: int) -> tuple[int, int]:
        """(seed, set id): buffer set ``key`` written with a draw of a fresh seed, no references."""
        spec, seed = self.check.spec, self.check.seed()
        inputs = make_inputs(spec, self.shape_set, seed, self.device)
        grads = make_grads(spec, self.shape_set, seed, self.device) if self.backward else None
        return seed, self.calls.load(Case(self.shape_set, "seed", inputs, grads, {}, {}), key=key)

    def _check(self, reply_results: Any, seed: int, set_id: int, slot: int, where: str) -> None:
        case = draw_case(self.check.task, self.check.spec, self.shape_set, seed, self.device)
        got = self.calls.results({"results": reply_results}, case, slot, set_id)
        ms = verdict(self.check.spec, case, got)
        if ms:
            raise CandidateError(f"{where} returned wrong results: {mismatch_message(ms)}")

    def timed(self, spin: float, rep: int) -> float:
        seed, set_id = self._fresh(self.check.rng.randrange(self.n_sets))
        slot = self.calls.slot()
        reply = self.check.request({**self._header("time"), "set": set_id, "slot": slot, "spin_ms": spin})
        ms = reported(reply.get("ms"), "a call's time")
        if self.check.rng.random() < CHECK_FRACTION:
            self._check(reply.get("results"), seed, set_id, slot, f"timed call {rep + 1}")
        else:
            self.check.request({"op": "release", "slots": [slot]})
        return ms

    def ready(self) -> None:
        """Before a block: what the baselines' calls left in the judge's allocator cache goes back
        to the device.  A block keeps every call's results in the runner, a process of its own,
        which cannot use that cache: beside eager's cached peak (47 GiB for the soft-capped LM
        head at LLaMA-3 1B) the runner works at the edge of the card's memory, which costs the
        program, and no baseline, back-to-back time (BENCHMARKS, run 33)."""
        torch.cuda.empty_cache()

    def block(self, calls: int, ping_ms: float) -> float:
        drawn = [self._fresh(key) for key in range(calls)]  # a buffer set of its own per call
        slots = [self.calls.slot() for _ in drawn]
        t0 = time.perf_counter()
        reply = self.check.request({**self._header("block"), "sets": [s for _, s in drawn], "slots": slots})
        wall = (time.perf_counter() - t0) * 1e3 - ping_ms
        self.seen.append(seen_of(reply.get("seen"), wall))
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != calls:
            raise CandidateError("the runner's reply to `block` does not hold one result list per call")
        for i in sorted(self.check.rng.sample(range(calls), min(CHECKED_PER_BLOCK, calls))):
            self._check(results[i], drawn[i][0], drawn[i][1], slots[i], f"call {i + 1} of a block of {calls}")
        self.check.request({"op": "release", "slots": slots})
        return wall / calls
