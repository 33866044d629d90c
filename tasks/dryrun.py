"""A task's reference, called once when the task loads, before anything is judged.

The verifier calls the reference to judge every program.  A reference that
raises, returns a tensor instead of a dict, names an output differently from
the spec, returns another shape than the spec declares, or takes other
arguments than the spec's inputs and params would otherwise show up there,
halfway through judging a program, as "the verifier itself failed" or as a
rejected program, when what is wrong is the task.  :func:`check_reference`
finds those first and names the field and the fix:

- the signature, before any call: every parameter without a default is an
  input or a param, and every input and param is a parameter (unless the
  reference takes ``**kwargs``);
- a call per shape set with the inputs at their declared shapes and dtypes:
  the CPU shape set on the CPU with drawn values (meta tensors do not check
  everything: a bf16 @ fp16 matmul passes on them), every other set on *meta*
  tensors (shapes and dtypes only: no data, no time, so a set sized for the GPU
  costs nothing).  Where a reference cannot run on meta tensors (an op that
  reads values, ``.item()``), that set too is called on the CPU if its inputs
  fit :data:`CPU_BYTES`, and left to the verifier if not;
- what it returns: a mapping with every declared output, each a tensor of the
  declared shape (a mismatch names the shape expression that fits every set)
  and of the declared kind, float or integer.  A float output's precision may
  differ from the declared dtype (a reference may keep bf16 where the program
  must write fp32 statistics): the verifier compares values, not dtypes;
- a ``backward_reference`` likewise, with the upstream gradients ``d<output>``:
  it returns ``d<input>`` for every input in ``gradients``, each of that
  input's shape.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .inits import draw
from .spec import FLOAT_DTYPES, Task, TaskSpec, TaskSpecError

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "int32": torch.int32, "int64": torch.int64,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# A set whose inputs pass this many bytes is not called on the CPU when meta tensors fail
# (the verifier's CPU checks use the same bound).
CPU_BYTES = 64 << 20


def check_reference(task: Task) -> None:
    """Raise :class:`TaskSpecError` naming the field and fix if the reference does not fit the spec."""
    spec = task.spec
    _check_signature(task, "reference", task.reference_fn, {**{n: "inputs" for n in spec.inputs},
                                                           **{n: "params" for n in spec.params}})
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # set -> output -> shape, for the suggestions
    for set_name in spec.shapes:
        outs = _call(task, "reference", task.reference_fn, set_name, lambda args, gen: {})
        if outs is None:
            continue
        _check_outputs(task, set_name, outs)
        shapes[set_name] = {o: tuple(outs[o].shape) for o in spec.outputs}
    _check_shapes(task, shapes)
    if task.backward_reference_fn is not None and spec.gradients:
        upstream = {f"d{o}": "upstream gradients" for o in spec.grad_outputs}
        _check_signature(task, "backward_reference", task.backward_reference_fn,
                         {**{n: "inputs" for n in spec.inputs}, **{n: "params" for n in spec.params}, **upstream})
        for set_name in spec.shapes:
            back = _call(task, "backward_reference", task.backward_reference_fn, set_name,
                         lambda args, gen: _upstream(spec, set_name, args, gen))
            if back is not None:
                _check_gradients(task, set_name, back)


# --------------------------------------------------------------------------- signature

def _check_signature(task: Task, field: str, fn: Callable, given: dict[str, str]) -> None:
    """``given``: the keyword arguments the verifier passes, each with the spec field it comes from."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    name = f"{getattr(fn, '__name__', 'the function')}()"
    takes = ", ".join(params) or "nothing"
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for n, where in given.items():
            if n not in params or params[n].kind is inspect.Parameter.POSITIONAL_ONLY:
                fix = (f"remove it from {where}, or add the parameter {n} to {name}" if where != "upstream gradients"
                       else f"add the parameter {n} (the upstream gradient of output {n[1:]}) to {name}")
                raise TaskSpecError(f"{task.path}: {field}: {name} takes no keyword argument {n!r} ({where} gives "
                                    f"it; {name} takes {takes}); {fix}")
    for n, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty or n in given:
            continue
        raise TaskSpecError(f"{task.path}: {field}: {name} takes {n!r}, which is neither an input nor a param of "
                            f"the task; add it to inputs (a tensor) or params (a scalar), or give it a default "
                            f"in {name}")


# --------------------------------------------------------------------------- calling

def _call(task: Task, field: str, fn: Callable, set_name: str,
          extra: Callable[[dict[str, torch.Tensor], torch.Generator | None], dict[str, torch.Tensor]]
          ) -> Mapping | None:
    """``fn`` on the set's inputs (meta tensors, else drawn CPU tensors), or None when neither can be had."""
    spec = task.spec
    meta = {n: torch.empty(spec.shape_of(t, set_name), dtype=TORCH_DTYPES[t.dtype], device="meta")
            for n, t in spec.inputs.items()}
    fits = sum(math.prod(t.shape) * t.element_size() for t in meta.values()) <= CPU_BYTES
    if set_name != spec.cpu_shape_set or not fits:
        try:
            with torch.no_grad():
                return _mapping(task, field, fn, fn(**meta, **spec.params_at(set_name), **extra(meta, None)))
        except TaskSpecError:
            raise
        except Exception:  # noqa: BLE001 - not every reference runs on meta tensors: call it for real
            if not fits:
                return None  # too large for a CPU call: the verifier calls it where it fits
    gen = torch.Generator().manual_seed(0)
    args = {n: draw_input(spec, t, set_name, gen) for n, t in spec.inputs.items()}
    try:
        with torch.no_grad():
            out = fn(**args, **spec.params_at(set_name), **extra(args, gen))
    except Exception as e:  # noqa: BLE001 - the reference failing is the task's problem, shown in full
        binding = ", ".join(f"{k}: {v}" for k, v in spec.shapes[set_name].items())
        raise TaskSpecError(f"{task.path}: {field}: calling {getattr(fn, '__name__', fn)}() on shape set {set_name} "
                            f"{{{binding}}} failed: {type(e).__name__}: {_flat(e)}; fix the reference, or the "
                            "declared shapes, dtypes and params it is called with") from None
    return _mapping(task, field, fn, out)


def _mapping(task: Task, field: str, fn: Callable, out: Any) -> Mapping:
    if isinstance(out, Mapping) and out:
        return out
    first = next(iter(task.spec.outputs))
    got = "an empty dict" if isinstance(out, Mapping) else f"a {type(out).__name__}"
    raise TaskSpecError(f"{task.path}: {field}: {getattr(fn, '__name__', fn)}() returned {got}; a task's reference "
                        f"returns its outputs by name, e.g. return {{{first!r}: {first}}}")


def draw_input(spec: TaskSpec, t: Any, set_name: str, gen: torch.Generator) -> torch.Tensor:
    """Values drawn as the spec's init says (``inits.draw``, as the verifier draws them)."""
    env = {k: float(v) for k, v in spec.shapes[set_name].items()}
    return draw(t.init, spec.shape_of(t, set_name), TORCH_DTYPES[t.dtype], env, gen)


def _upstream(spec: TaskSpec, set_name: str, args: dict[str, torch.Tensor], gen: torch.Generator | None
              ) -> dict[str, torch.Tensor]:
    device = next(iter(args.values())).device
    out = {}
    for o in spec.grad_outputs:
        shape, dtype = spec.shape_of(spec.outputs[o], set_name), TORCH_DTYPES[spec.outputs[o].dtype]
        out[f"d{o}"] = (torch.empty(shape, dtype=dtype, device="meta") if gen is None or device.type == "meta"
                        else torch.randn(shape, generator=gen).to(dtype))
    return out


def _flat(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 400 else text[:400] + " ..."


# --------------------------------------------------------------------------- what it returns

def _check_outputs(task: Task, set_name: str, outs: Mapping) -> None:
    spec = task.spec
    returned = ", ".join(map(str, outs)) or "nothing"
    for o, t in spec.outputs.items():
        if o not in outs:
            raise TaskSpecError(f"{task.path}: outputs.{o}: the reference returns no {o!r} (it returns {returned}); "
                                "rename the output, or the reference's key")
        v = outs[o]
        if not isinstance(v, torch.Tensor):
            raise TaskSpecError(f"{task.path}: outputs.{o}: the reference returns a {type(v).__name__} for it, not a "
                                "tensor; return a tensor")
        declared_float = t.dtype in FLOAT_DTYPES or t.dtype.startswith("fp8")
        if v.is_floating_point() != declared_float:
            names = {d: n for n, d in TORCH_DTYPES.items()}
            fix = f"write dtype: {names[v.dtype]}" if v.dtype in names else "return one of " + ", ".join(TORCH_DTYPES)
            raise TaskSpecError(f"{task.path}: outputs.{o}.dtype: {t.dtype}, but the reference returns {v.dtype} "
                                f"(given the inputs' declared dtypes); {fix}, or cast it in the reference")


def _check_shapes(task: Task, shapes: dict[str, dict[str, tuple[int, ...]]]) -> None:
    from .skeleton import symbolic

    spec = task.spec
    for set_name, got in shapes.items():
        for o, shape in got.items():
            t = spec.outputs[o]
            want = spec.shape_of(t, set_name)
            if shape == want:
                continue
            fix = "fix the declared shape, or the reference"
            ranks = {len(s[o]) for s in shapes.values()}
            if len(ranks) == 1:
                dims = [symbolic({s: shapes[s][o][d] for s in shapes}, spec.shapes)[0] for d in range(len(shape))]
                if not any(str(d).startswith("TODO") for d in dims):
                    fix = f"write shape: [{', '.join(map(str, dims))}] (it fits every shape set), or fix the reference"
            declared = "[" + ", ".join(map(str, t.shape)) + "]"
            raise TaskSpecError(f"{task.path}: outputs.{o}.shape: {declared} is {list(want)} on shape set {set_name}, "
                                f"but the reference returns {list(shape)}; {fix}")


def _check_gradients(task: Task, set_name: str, back: Mapping) -> None:
    spec = task.spec
    for g in spec.gradients:
        d = back.get(f"d{g}")
        if not isinstance(d, torch.Tensor):
            raise TaskSpecError(f"{task.path}: backward_reference: it returns no tensor 'd{g}' (it returns "
                                f"{', '.join(map(str, back))}); return d<input> for every input in gradients "
                                f"({', '.join('d' + n for n in spec.gradients)})")
        want = spec.shape_of(spec.inputs[g], set_name)
        if tuple(d.shape) != want:
            raise TaskSpecError(f"{task.path}: backward_reference: d{g} is {list(d.shape)} on shape set {set_name}; "
                                f"a gradient has its input's shape, {list(want)}")
