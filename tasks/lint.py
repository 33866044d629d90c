"""What ``coda-agent tasks check`` finds in a task beyond its spec's validation: values the
reference treats apart that the verifier's draws never hold (:func:`undrawn_values`), float
params the verifier can never vary because the reference refuses every value near the written one
(:func:`unvaried_params`), float params written as whole numbers, which the verifier takes for
integers and never varies (:func:`whole_number_floats`), results whose rows no kernel can
store (:func:`unstorable_results`), a model's parameters drawn as activations
(:func:`parameters_as_activations`), and gradients through a kink on the default rule
(:func:`kinks_on_the_default_rule`)."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch

from coda_agent.errors import CodaError

from .dryrun import TORCH_DTYPES, draw_input
from .params import PARAM_SPREAD
from .recorder import Call, call_reference
from .skeleton import KINK_RULE, parameter_inputs, parameter_note, token_sizes


@lru_cache(maxsize=1)
def _cpu_call(task: Any) -> Call | None:
    """The reference called once on the task's CPU set, as recorded (the lints of one task share
    it); None where it fails, which the verifier's reference stage reports."""
    spec = task.spec
    inputs = {k: (list(t.shape), t.dtype) for k, t in spec.inputs.items()}
    try:
        return call_reference(task.reference_fn, inputs, spec.params_at(spec.cpu_shape_set),
                              spec.shapes[spec.cpu_shape_set], spec.cpu_shape_set)
    except CodaError:
        return None


def undrawn_values(task: Any) -> list[str]:
    """What the reference treats apart in an integer input but the task's draw never holds: a
    cross-entropy's ignore_index, or a value it compares the input with (``target == -100``) that
    is outside the input's ``randint`` range with no ``ignore`` drawing it.  A program that counts
    those rows, or sends them a gradient, would pass every check."""
    spec = task.spec
    binding = spec.shapes[spec.cpu_shape_set]
    if (call := _cpu_call(task)) is None:
        return []
    special = {k: set(v) for k, v in call.specials.items()}
    for k, (_, ignore_index) in call.targets.items():
        special.setdefault(k, set()).add(ignore_index)
    env = {n: float(v) for n, v in binding.items()}
    problems = []
    for k, values in sorted(special.items()):
        init = spec.inputs[k].init
        drawn = {init.ignore.value} if init.ignore is not None else set()
        high = (init.randint_high(spec.shape_of(spec.inputs[k], spec.cpu_shape_set), env)
                if init.dist == "randint" else None)
        missing = sorted(v for v in values if v not in drawn and not (high is not None and 0 <= v < high))
        if missing:
            problems.append(f"inputs.{k}.init: the reference treats {k} == {', '.join(map(str, missing))} apart "
                            f"(an ignore_index), but no draw holds it; add ignore: {{value: {missing[0]}, "
                            "fraction: 0.125}} so that a program counting those rows fails")
    return problems


def unvaried_params(task: Any) -> list[str]:
    """The float params the judge would keep as written on every check: the reference refuses the
    param scaled by 2**(+-u) at the smallest spread the judge halves down to (``PARAM_SPREAD``), the
    others as written.  A program that types such a value in would pass; either the value is a
    constant of the task (``fixed_params`` says so), or the reference refuses values it should take."""
    spec = task.spec
    set_name = spec.cpu_shape_set
    gen = torch.Generator().manual_seed(0)
    inputs = {n: draw_input(spec, t, set_name, gen) for n, t in spec.inputs.items()}
    written = spec.params_at(set_name)

    def takes(name: str, value: float) -> bool:
        try:
            with torch.no_grad():
                task.reference_fn(**inputs, **{**written, name: value})
        except Exception:  # noqa: BLE001 - the reference refusing the value is what is asked
            return False
        return True

    u = PARAM_SPREAD[0]
    return [f"params.{name}: the reference refuses {name} = {written[name]!r} x 2^+-{u} (tried "
            f"{written[name] * 2 ** -u:.6g} and {written[name] * 2 ** u:.6g}), so the verifier never varies it and a "
            f"program that types the value in would pass; list it in fixed_params if it is a constant of the task, "
            "else let the reference take nearby values"
            for name in spec.varied_params if not any(takes(name, written[name] * 2.0 ** s) for s in (-u, u))]


def whole_number_floats(task: Any) -> list[str]:
    """The params written as an int (``alpha: 2``) whose default in the reference's signature is a
    float (``alpha=2.0``): the judge varies float params only, so it would keep this one as written
    and a program that types it in would pass."""
    try:
        signature = inspect.signature(task.reference_fn)
    except (TypeError, ValueError):
        return []
    spec = task.spec
    found = []
    for name, value in spec.params.items():
        p = signature.parameters.get(name)
        if (type(value) is int and name not in spec.fixed_params and p is not None
                and isinstance(p.default, float)):
            found.append(f"params.{name}: written {value} (an integer) where the reference's default is "
                         f"{p.default!r} (a float); the verifier varies only float params, so a program that "
                         f"types {value} in would pass: write {float(value)!r}")
    return found


def unstorable_results(task: Any) -> list[str]:
    """The outputs and gradients whose rows, on some shape set, are not a multiple of 16 bytes
    (three classes' logits, a vocabulary of 49155 in bf16): a GEMM or a pass stores D a row at a
    time with TMA, which moves 16-byte multiples, and a result must be dense, so no program can
    return them; the reference pads such a result, as models pad a vocabulary."""
    spec = task.spec
    results = {**spec.outputs, **{f"d{g}": spec.inputs[g] for g in spec.gradients}}
    found = []
    for name, t in results.items():
        size = TORCH_DTYPES[t.dtype].itemsize
        for shape_set in spec.shapes:
            shape = spec.shape_of(t, shape_set)
            if len(shape) >= 2 and shape[-1] * size % 16:
                where = "outputs" if name in spec.outputs else "gradients"
                found.append(f"{where}.{name}: on shape set {shape_set} its rows are {shape[-1]} {t.dtype} values, "
                             f"{shape[-1] * size} bytes, not a multiple of 16: no kernel stores such rows (TMA "
                             f"moves 16-byte multiples); pad its last dimension to a multiple of {16 // size} in "
                             "the reference (F.pad) and slice it where the result is used")
                break
    return found


def parameters_as_activations(task: Any) -> list[str]:
    """The inputs drawn as activations (no role, or ``role: activation``) whose shape holds no token
    size: a bias, a per-channel scale, a trained scalar (``tasks new`` writes these ``role:
    weight``).  The judge scales an activation whole, by up to 2^12 with the tokens, and a
    parameter elementwise over a trained model's values (small, large, negative, zero): drawn as an
    activation, a bias a program divides by is never near zero, and a softplus slope at -90 has a
    gradient no fp32 program computes."""
    spec = task.spec
    inputs = {k: ([str(d) for d in t.shape], t.dtype) for k, t in spec.inputs.items()}
    held = {k for k, t in spec.inputs.items() if t.role in ("weight", "norm_weight", "table", "index")}
    tokens = token_sizes(inputs, held)
    return [f"inputs.{k}: drawn as an activation, but {parameter_note(tokens)}"
            for k in parameter_inputs(inputs, held, tokens) if spec.inputs[k].role == "activation"]


def kinks_on_the_default_rule(task: Any) -> list[str]:
    """The gradients through a kink (those of the inputs a kink's argument is made of:
    :attr:`.recorder.Call.kinked_inputs`) that the task judges by an unwidened max rule: each
    rounding across the kink is one error of a whole term, in other elements than the bf16
    reference's own, so an honest program fails such a rule now and then."""
    spec = task.spec
    if not spec.gradients or (call := _cpu_call(task)) is None:
        return []
    return [f"tolerances.d{g}: d{g} passes through {', '.join(call.kinks)}, whose derivative jumps, and is judged "
            f"by the default max rule, which an honest program fails now and then (one whole term per rounding "
            f"across the kink); give it the kink's: tolerances: {{d{g}: {KINK_RULE}}}"
            for g in spec.gradients if g in call.kinked_inputs and not spec.tolerance_for(f"d{g}").kinked]
