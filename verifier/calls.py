"""One checked call, from the judge's side: draw, send, receive, compare.

A :class:`Case` is one draw of inputs (fresh seed, or edge rows,
:mod:`.inputs`) with the judge's own references computed from the judge's own
pristine copies, so nothing the program does to its inputs reaches them.
:class:`CpuCalls` and :class:`GpuCalls` send a case to the runner and return
what came back as the judge's tensors, rebuilt from the dtype and shape the
task declares; then :func:`verdict` compares every result.

The checks on what came back belong to the judge and hold whatever the runner
does: every declared result is there with its declared dtype and shape (the
runner's own checks only explain mistakes earlier); inputs and upstream
gradients are compared with the pristine copies after every call (on the GPU
the judge reads the runner's buffers itself; on the CPU the runner can only
report digests, so there the comparison is advice, and the references'
isolation is the guarantee); and on the GPU results may not share memory with
each other or with an input buffer, except a result that *is* an upstream
gradient buffer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from coda_agent.tasks.spec import Task, TaskSpec, Tolerance
from coda_agent.verifier.compare import compare
from coda_agent.verifier.cuda_ipc import Imports
from coda_agent.verifier.inputs import (EDGE_ROLES, aligned_grads, edge_inputs, make_grads, make_inputs,
                                        predicted_targets, result_bytes, result_dtypes, result_shapes, run_reference,
                                        scaled_inputs)
from coda_agent.verifier.noise import Noise, sample_noise
from coda_agent.verifier.outliers import outlier_inputs
from coda_agent.verifier.program import CandidateError, shares_memory
from coda_agent.verifier.report import Mismatch
from coda_agent.verifier.shape_sets import set_label
from coda_agent.verifier.wire import WireError, describe, nbytes, tensor_bytes, tensor_from_blob


class Runner(Protocol):
    """Where calls go: the check's runner, within the check's time budget (:mod:`.judge`)."""

    def request(self, header: dict[str, Any], blobs: Sequence[bytes | memoryview] = (),
                max_bytes: int = 0) -> dict[str, Any]: ...


DRAWS = {"seed": "fresh inputs",
         "outliers": "fresh inputs with outlier channels (one to three channels of every hidden state at 8 to "
                     "64 times the rest, one sign down the tokens, as trained models' features are)",
         "edge": "edge rows (norms of 2^-12, 2^5, between and 0, gradients along the output or 0, targets the "
                 "reference predicts)",
         "padded": "the first fresh inputs, which passed, now with each epilogue over whole tiles and padded "
                   "lanes as the kernel leaves them",
         "scaled": "fresh inputs at other magnitudes (activations and gradients times 2^u, half the rows "
                   "negated, centres moved farther; norm weights, scales, tables and biases spread over a "
                   "trained model's values: small, large, negative, zero; weight matrices at 2^-6 to 4 times their "
                   "scale; fp8 inputs over their format's range)",
         "forward": "the first fresh inputs, forward alone (no backward after it, as when the next layer or "
                    "an inference reads the output)"}
# The fix for an input written in place: most often a gemm's `out=` or `accumulate_into=`.
READ_ONLY = ("inputs are read-only: no `out=` or `accumulate_into=` on an input or a view of one (write "
             "a new output instead)")


@dataclass
class Case:
    shape_set: str
    draw: str  # a key of DRAWS
    inputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor] | None
    hi: dict[str, torch.Tensor]
    lo: dict[str, torch.Tensor]
    needs: frozenset[str] | None = None  # the gradients backward is asked for (None: all of them)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the params of the call
    task: Task | None = None  # the references' task, for more samples of their noise (noise_of)
    seed: int = 0

    def noise_of(self, names: list[str]) -> dict[str, Noise]:
        """More samples of the references' noise on ``names`` (:mod:`.noise`: the second look)."""
        hi_dtype = torch.float64 if self.device == "cpu" else torch.float32
        return sample_noise(self.task, self.inputs, self.grads, self.params, hi_dtype, self.seed, self.hi,
                            self.lo, names)

    @property
    def device(self) -> str:
        return next(iter(self.hi.values())).device.type

    def needing(self, spec: TaskSpec, needs: frozenset[str]) -> "Case":
        """This case with backward asked for ``needs`` alone: the references of the outputs and
        of those gradients."""
        left_out = {f"d{g}" for g in spec.gradients} - needs
        return dataclasses.replace(self, hi={k: v for k, v in self.hi.items() if k not in left_out},
                                   lo={k: v for k, v in self.lo.items() if k not in left_out}, needs=needs)

    def forward_alone(self, spec: TaskSpec) -> "Case":
        """This case's forward call without a backward: its outputs' references alone."""
        return dataclasses.replace(self, draw="forward", grads=None, needs=None,
                                   hi={k: self.hi[k] for k in spec.outputs}, lo={k: self.lo[k] for k in spec.outputs})


def draw_case(task: Task, spec: TaskSpec, shape_set: str, seed: int, device: str, draw: str = "seed",
              varied: dict[str, float] | None = None, magnitude: float = 0.0) -> Case:
    """Inputs for one call and the judge's references (fp64 on the CPU, fp32 on the GPU, and in
    the inputs' own dtype for the rounding noise that sets the tolerance), with the task's
    params on ``shape_set`` and the ``varied`` ones in their place
    (:func:`~.inputs.drawn_params`); a ``scaled`` draw's magnitudes are 2**``magnitude``
    (:func:`~.inputs.scaled_inputs`)."""
    hi_dtype = torch.float64 if device == "cpu" else torch.float32
    params = {**spec.params_at(shape_set), **(varied or {})}
    if draw == "scaled":
        inputs = scaled_inputs(spec, shape_set, seed, device, magnitude)
    else:
        inputs = {"edge": edge_inputs, "outliers": outlier_inputs}.get(draw, make_inputs)(spec, shape_set, seed, device)
    ref_task = _task_with(task, spec)
    if draw in ("edge", "scaled"):
        inputs = predicted_targets(ref_task, inputs, params, seed)
    grads = make_grads(spec, shape_set, seed, device) if spec.has_backward else None
    if grads is not None and draw == "scaled":
        grads = {k: (g.float() * 2.0 ** magnitude).to(g.dtype) for k, g in grads.items()}
    if grads is not None and draw == "edge":
        grads = aligned_grads(grads, run_reference(ref_task, inputs, None, hi_dtype, params=params), seed)
    return Case(shape_set, draw, inputs, grads, run_reference(ref_task, inputs, grads, hi_dtype, params=params),
                run_reference(ref_task, inputs, grads, None, params=params), params=params, task=ref_task,
                seed=seed)


def params_note(spec: TaskSpec, case: Case) -> str:
    """The params a case's call had, where they are not the task's as written."""
    written = spec.params_at(case.shape_set)
    varied = ", ".join(f"{k}={v:.6g}" for k, v in case.params.items() if v != written[k])
    return varied and (f", with params {varied} (the task's values varied by the judge: a program takes its "
                       "params from the call, never writes their values in)")


def _task_with(task: Task, spec: TaskSpec) -> Task:
    """``task`` with ``spec`` (the shape sets the judge added); the reference functions stay."""
    if task.spec is spec:
        return task
    view = Task.__new__(Task)
    view.__dict__.update(task.__dict__)
    view.spec = spec
    return view


def verdict(spec: TaskSpec, case: Case, got: dict[str, torch.Tensor], poisoned: bool = False) -> list[Mismatch]:
    """Every result of a call compared with the references; a result that fails only by its
    size gets a second look against more samples of the references' noise (:mod:`.noise`)."""
    rules = {name: judged_by(spec, name, case.draw) for name in case.hi}
    found = {name: compare(name, case.shape_set, got[name], case.hi[name], case.lo[name], rules[name][0],
                           poisoned=poisoned, rows=rules[name][1]) for name in case.hi}
    again = [name for name, m in found.items() if m is not None and _sized(m, got[name], case.hi[name])]
    if again and case.task is not None:
        try:
            noise = case.noise_of(again)
        except Exception:  # noqa: BLE001 - a reference that refuses nudged values: the first look stands
            noise = {}
        for name in noise:
            found[name] = compare(name, case.shape_set, got[name], case.hi[name], case.lo[name], rules[name][0],
                                  poisoned=poisoned, noise=noise[name], rows=rules[name][1])
    out = []
    for m in found.values():
        if m is not None:
            out.append(m.model_copy(update={"inputs": DRAWS[case.draw] + params_note(spec, case),
                                            "shape_set": set_label(spec, case.shape_set)}))
    return out


def judged_by(spec: TaskSpec, name: str, draw: str) -> tuple[Tolerance, bool]:
    """The rules result ``name`` is judged by on ``draw``: its tolerance, and whether the whole-row
    rule (.compare) applies.  The edge draw puts rows at 2^-12 to 2^5 of their scale: the whole-row
    rule judges the results of those rows (:func:`edge_rows`).  A result through a kink
    (``Tolerance.kinked``) keeps its max rule alone there, its dense rules at the max rule's factor:
    a row at 32 times its scale clamps nearly all its terms, one flip of the few left is most of
    the row (a flip cannot be told from a row left out), and the few such rows carry the whole
    tensor's norm, which one flip moves by whole percent (a clamped MLP's dw_gu: 4 times the bf16
    reference's relative error, where the reference flipped elsewhere).  Every other draw, its rows
    at one scale, judges it by all its rules."""
    tol = spec.tolerance_for(name)
    if draw != "edge":
        return tol, False
    if tol.kinked:
        return tol.model_copy(update={"norm_factor": tol.factor}), False
    return tol, edge_rows(spec, name)


def edge_rows(spec: TaskSpec, name: str) -> bool:
    """Whether result ``name`` (an output, or a gradient ``d<input>``) has the edge draw's rows: its
    leading axis is that of an input the draw scales row by row (tokens).  A weight's gradient,
    or an output laid out like one (V, H), sums over the tokens: each of its rows mixes every scale,
    and one that nearly cancels errs by much of its own norm in an honest program."""
    t = spec.outputs.get(name) or spec.inputs.get(name[1:])
    scaled = {str(i.shape[0]) for i in spec.inputs.values() if i.shape and i.role in EDGE_ROLES}
    return t is not None and bool(t.shape) and str(t.shape[0]) in scaled


def _sized(m: Mismatch, out: Any, hi: torch.Tensor) -> bool:
    """Whether a failed result failed by the size of its errors alone: a float tensor of the
    right shape, every element a number where the reference's is."""
    return (isinstance(out, torch.Tensor) and hi.is_floating_point() and tuple(out.shape) == tuple(hi.shape)
            and m.nan_count == 0 and m.unwritten_count == 0 and math.isfinite(m.max_abs_err))


def _request_tensors(spec: TaskSpec, case: Case) -> list[tuple[str, torch.Tensor]]:
    return [*case.inputs.items(), *((case.grads or {}).items())]


def _call_header(spec: TaskSpec, tag: str, case: Case) -> dict[str, Any]:
    return {"op": "call", "tag": tag, "backward": case.grads is not None, "padded": case.draw == "padded",
            "shapes": result_shapes(spec, case.shape_set), "params": case.params,
            **({"needs": sorted(case.needs)} if case.needs is not None else {})}


def _result_list(reply: dict[str, Any], expected: list[str]) -> list[dict[str, Any]]:
    results = reply.get("results")
    if not isinstance(results, list) or [r.get("name") if isinstance(r, dict) else None for r in results] != expected:
        raise CandidateError(f"the runner's reply does not list the results {expected}")
    return results


def _dtype(spec: TaskSpec, result: dict[str, Any]) -> str:
    """The dtype a result came back in, if the task allows it for that result."""
    allowed = result_dtypes(spec)[result["name"]]
    if result.get("dtype") not in allowed:
        raise CandidateError(f"`{result['name']}` came back as {result.get('dtype')}; the task allows "
                             f"{' or '.join(allowed)}")
    return result["dtype"]


class CpuCalls:
    """Calls on the CPU: tensors travel as bytes both ways."""

    def __init__(self, remote: Runner, spec: TaskSpec, tag: str):
        self.remote, self.spec, self.tag = remote, spec, tag

    def __call__(self, case: Case, audit: bool = False) -> dict[str, torch.Tensor]:
        sent = _request_tensors(self.spec, case)
        header = {**_call_header(self.spec, self.tag, case), "audit": audit,
                  "tensors": [{"name": k, **describe(v)} for k, v in sent]}
        blobs = [tensor_bytes(v) for _, v in sent]
        expected = list(case.hi)
        reply = self.remote.request(header, blobs, max_bytes=result_bytes(self.spec, case.shape_set))
        results = _result_list(reply, expected)
        if len(reply["_blobs"]) != len(expected):
            raise CandidateError("the runner's reply does not carry one tensor per result")
        shapes = result_shapes(self.spec, case.shape_set)
        try:  # the bytes become tensors of the task's shape and of a dtype the task allows
            got = {r["name"]: tensor_from_blob(b, _dtype(self.spec, r), shapes[r["name"]])
                   for r, b in zip(results, reply["_blobs"])}
        except WireError as e:
            raise CandidateError(f"a result the runner sent is unusable: {e}") from None
        digests = reply.get("digests") if isinstance(reply.get("digests"), dict) else {}
        for (name, _), blob in zip(sent, blobs):
            if digests.get(name) != hashlib.sha256(blob).hexdigest():
                raise CandidateError(f"the program modified its input `{name}` in place; {READ_ONLY}")
        if isinstance(reply.get("torch_compute"), dict):
            err = reply["torch_compute"]
            raise CandidateError(str(err.get("message"))[:2000], err.get("line") if type(err.get("line")) is int
                                 else None)
        return got


@dataclass
class _Buffers:
    """One set of input buffers the runner allocated for one shape set."""

    id: int
    shape_set: str
    tensors: dict[str, torch.Tensor]  # the judge's views of the runner's buffers
    ranges: dict[str, tuple[str, int, int]]  # name -> (handle, offset, bytes)


class GpuCalls:
    """Calls on the GPU: the runner allocates input buffers (:meth:`load`, one set per key and
    shape set), the judge fills them per case and imports each result, copying it into its own
    memory at once (:mod:`.cuda_ipc`)."""

    def __init__(self, remote: Runner, spec: TaskSpec, tag: str):
        self.remote, self.spec, self.tag = remote, spec, tag
        self.sets: dict[int, _Buffers] = {}  # key -> buffers
        self.imports = Imports()  # the buffers' mappings, open while the sets live
        self.next_id = self.next_slot = 0

    def load(self, case: Case, key: int = 0) -> int:
        """The id of buffer set ``key``, holding ``case``'s inputs (allocated on first use)."""
        bufs = self.sets.get(key)
        names = {name for name, _ in _request_tensors(self.spec, case)}  # a forward alone sends no gradients
        if bufs is None or bufs.shape_set != case.shape_set or set(bufs.tensors) != names:
            if bufs is not None:
                self._free(bufs)
            bufs = self.sets[key] = self._alloc(case)
        for name, t in _request_tensors(self.spec, case):
            bufs.tensors[name].copy_(t)
        torch.cuda.synchronize()
        return bufs.id

    def _alloc(self, case: Case) -> _Buffers:
        self.next_id += 1
        tensors = _request_tensors(self.spec, case)
        reply = self.remote.request({"op": "alloc", "set": self.next_id,
                                     "tensors": [{"name": k, **describe(v)} for k, v in tensors]})
        descs = reply.get("buffers")
        if not isinstance(descs, dict):
            raise CandidateError("the runner's reply to `alloc` holds no buffers")
        bufs = _Buffers(self.next_id, case.shape_set, {}, {})
        for name, t in tensors:
            d, dtype = descs.get(name), describe(t)["dtype"]
            bufs.tensors[name] = self._import(d, dtype, list(t.shape))  # validates d
            bufs.ranges[name] = (str(d.get("handle")), d.get("offset"), nbytes(dtype, list(t.shape)))
        return bufs

    def _free(self, bufs: _Buffers) -> None:
        bufs.tensors.clear()
        self.remote.request({"op": "free", "set": bufs.id})

    def _by_id(self, set_id: int) -> _Buffers:
        return next(b for b in self.sets.values() if b.id == set_id)

    def _import(self, desc: Any, dtype: str, shape: list[int], imports: Imports | None = None) -> torch.Tensor:
        try:
            return (imports or self.imports).tensor(desc, dtype, shape)
        except WireError as e:
            raise CandidateError(f"a device tensor the runner described is unusable: {e}") from None

    def results(self, reply: dict[str, Any], case: Case, slot: int, set_id: int) -> dict[str, torch.Tensor]:
        """The judge's copies of the results ``reply`` describes; the runner's slot is released."""
        shapes = result_shapes(self.spec, case.shape_set)
        expected = list(case.hi)
        descs = _result_list(reply, expected)
        grads = set(case.grads or {})
        # (who, (handle, offset, bytes), may be returned as it is)
        seen = [(f"the input `{k}`", r, k in grads) for k, r in self._by_id(set_id).ranges.items()]
        got = {}
        with Imports() as imports:
            for d in descs:
                name, dtype = d["name"], _dtype(self.spec, d)
                view = self._import(d, dtype, shapes[name], imports)
                span = (str(d.get("handle")), d.get("offset"), nbytes(dtype, shapes[name]))
                for who, other, passthrough in seen:
                    if passthrough and other == span:
                        continue
                    if span[2] and other[2] and span[0] == other[0] \
                            and span[1] < other[1] + other[2] and other[1] < span[1] + span[2]:
                        raise CandidateError(shares_memory(name, who))
                seen.append((f"the result `{name}`", span, False))
                got[name] = view.clone()
        self.remote.request({"op": "release", "slots": [slot]})
        return got

    def unchanged(self, case: Case, set_id: int) -> None:
        """Every input buffer still holds what the judge wrote (read by the judge itself)."""
        bufs = self._by_id(set_id).tensors
        for name, t in _request_tensors(self.spec, case):
            b = bufs[name]
            if not (torch.equal(b, t) or (b.is_floating_point() and bool(((b == t) | (b.isnan() & t.isnan())).all()))):
                raise CandidateError(f"the program modified its input `{name}` in place; {READ_ONLY}")

    def run(self, case: Case, set_id: int, poison: bool) -> dict[str, torch.Tensor]:
        """One call on buffer set ``set_id`` (which holds ``case``): its results, inputs checked."""
        slot = self.slot()
        reply = self.remote.request({**_call_header(self.spec, self.tag, case), "set": set_id,
                                     "poison": poison, "slot": slot})
        got = self.results(reply, case, slot, set_id)
        self.unchanged(case, set_id)
        return got

    def __call__(self, case: Case, poison: bool = True) -> dict[str, torch.Tensor]:
        return self.run(case, self.load(case), poison)

    def slot(self) -> int:
        self.next_slot += 1
        return self.next_slot

    def close(self) -> None:
        """Unmap and free every buffer set (the runner empties its cache: others need the memory)."""
        self.imports.close()
        for bufs in list(self.sets.values()):
            self._free(bufs)
        self.sets.clear()
