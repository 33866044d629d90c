"""``coda-agent tasks new``: a task file written from its reference.

Given the reference (``ref.py:fn``), its tensor inputs with symbolic shapes
(``x=T,H``) and shape sets binding the symbols (``small=T:256,H:128``), the
reference is called once per shape set (on the CPU; a set whose inputs pass
:data:`META_SET_BYTES`, one sized for the GPU, on meta tensors, which give
shapes and dtypes at no cost), and what it returns fills in the outputs:
names, dtypes, and symbolic shapes (each dimension is matched against
expressions of the symbols, ``T``, ``4*H``, ``T*H``, ``H//2``..., that fit
*every* shape set, so two sets that differ tell ``T`` from ``2*H``).
Params are the reference's keyword defaults, or ``--param name=value``.
Inputs are drawn from N(0, 1), except a matmul's right operand (a weight:
``x @ w``, ``F.linear(x, w)``, views of it included), drawn at
``1 / sqrt(K)``: products of the order of the inputs, so that what the
reference adds to them (a residual, a bias) is larger than their rounding and a
program that leaves it out fails; a normalisation's weights, biases and centred
input (F.layer_norm's and F.rms_norm's, on the input or a cast of it, and a norm
written out as HF writes RMSNorm: :data:`.recorder.STATS`), the inputs an angle
of ``sin``/``cos`` is made of (positions and frequencies), a cross-entropy's
targets and an index's inputs are drawn as what they are
(:class:`.recorder.Call` sees each use); a float input whose shape holds no
token size (a bias, a per-channel scale, a trained scalar) is a model's
parameter, ``role: weight``.  A reference with a kink (``relu``,
``clamp``, ``abs``, ...) gets the kink's tolerance for the gradients through it
(those of the inputs its argument is made of), with a comment on why.

What a call cannot tell is left as a ``TODO ...`` value for a person:
``families``, ``gemms`` (with the reference's own matmuls as a hint),
``target``, the range of an integer input the reference uses as no index (a
target, ``gather``, ``embedding``, ``index_select`` and ``x[i]`` show theirs),
and a summary if the reference has no docstring.  ``load_task`` reports every
TODO by name, so ``coda-agent tasks check`` fails until each is filled in.
"""

from __future__ import annotations

import inspect
import itertools
import keyword
import math
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import yaml

from coda_agent.errors import CodaError

from .dryrun import TORCH_DTYPES
from .messages import DTYPE_ALIASES, TODO
from .recorder import DTYPE_NAMES, Call, call_reference
from .sources import ReferenceImportError, import_reference
from .spec import Scalar

FAMILIES = "elementwise, pairwise, vector, tile, reduction, stateful"
def parse_shapes(specs: list[str]) -> dict[str, dict[str, int]]:
    """``["small=T:256,H:128", ...]`` -> ``{"small": {"T": 256, "H": 128}, ...}``."""
    out: dict[str, dict[str, int]] = {}
    for spec in specs:
        name, sep, binding = spec.partition("=")
        if name.strip() in out:
            raise CodaError(f"--shapes {spec!r}: a shape set {name.strip()!r} is given already; give each set once")
        try:
            pairs = [[x.strip() for x in p.split(":")] for p in binding.split(",")]
            out[name.strip()] = {k: int(v) for k, v in pairs}
            if len(out[name.strip()]) != len(pairs) or not all(k.isidentifier() for k, _ in pairs):
                raise ValueError("a symbol twice, or not a name")
        except ValueError:
            sep = ""
        if not sep or not name.strip() or not out.get(name.strip()):
            raise CodaError(f"--shapes {spec!r}: write NAME=SYMBOL:INT,SYMBOL:INT..., each symbol once, e.g. "
                            "--shapes small=T:256,H:128")
        negative = [f"{k}:{v}" for k, v in out[name.strip()].items() if v < 0]
        if negative:
            raise CodaError(f"--shapes {spec!r}: {', '.join(negative)}; sizes are integers >= 0")
    return out


def parse_inputs(specs: list[str]) -> dict[str, tuple[list[str], str]]:
    """``["x=T,H", "w=H,4*H:bf16"]`` -> ``{"x": (["T", "H"], "bf16"), ...}`` (dtype bf16 by default)."""
    out: dict[str, tuple[list[str], str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        shape, colon, dtype = rest.rpartition(":")
        if not colon:
            shape, dtype = rest, "bf16"
        dtype = dtype.strip()
        if dtype not in TORCH_DTYPES:
            alias = DTYPE_ALIASES.get(dtype.lower())
            raise CodaError(f"--input {spec!r}: {dtype!r} is not a dtype here" +
                            (f"; write {name}={shape}:{alias}" if alias else "") +
                            f" (dtypes: {', '.join(TORCH_DTYPES)})")
        dims = [d.strip() for d in shape.split(",") if d.strip()]
        name = name.strip()
        if not sep or not name.isidentifier() or keyword.iskeyword(name) or not dims:
            raise CodaError(f"--input {spec!r}: write NAME=DIM,DIM[:DTYPE] with NAME a Python name, e.g. --input "
                            f"x=T,H or --input target=T:int64 (dtypes: {', '.join(TORCH_DTYPES)})")
        if name in out:
            raise CodaError(f"--input {spec!r}: {name} is given already; give each input once")
        out[name] = (dims, dtype)
    return out


def parse_params(specs: list[str]) -> dict[str, Scalar]:
    """``["eps=1e-6", "causal=true", "act=gelu"]`` -> ``{"eps": 1e-06, "causal": True, "act": "gelu"}``."""
    out: dict[str, Scalar] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or keyword.iskeyword(name) or not value.strip():
            raise CodaError(f"--param {spec!r}: write NAME=VALUE with a number, true/false or a word, "
                            "e.g. --param eps=1e-6")
        if name in out:
            raise CodaError(f"--param {spec!r}: {name} is given already; give each param once")
        out[name] = _scalar(value.strip())
    return out


def _scalar(text: str) -> Scalar:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def _check_dims(inputs: dict[str, tuple[list[str], str]], shapes: dict[str, dict[str, int]]) -> None:
    """Every dimension a size on every set: a symbol each set binds, a whole number >= 0."""
    from .expr import ExprError, evaluate, expr_symbols, value_text

    for name, (dims, _) in inputs.items():
        for d in dims:
            try:
                symbols = expr_symbols(d)
            except ExprError as e:
                raise CodaError(f"--input {name}: {e}") from None
            for set_name, binding in shapes.items():
                if symbols - set(binding):
                    raise CodaError(f"--input {name}: {d} uses {', '.join(sorted(symbols - set(binding)))}, which "
                                    f"--shapes {set_name} does not bind (it binds {', '.join(binding)})")
                try:
                    v = evaluate(f"--input {name}", d, {k: float(x) for k, x in binding.items()}, set_name)
                except ValueError as e:
                    raise CodaError(str(e)) from None
                if v != int(v) or v < 0:
                    raise CodaError(f"--input {name}: {value_text(d, v, set_name)}, not a size; "
                                    + ("use // (floor division) or sizes it divides" if v >= 0 else
                                       "a size cannot be negative"))


# --------------------------------------------------------------------------- symbolic shapes

def _candidates(symbols: list[str]) -> Iterator[str]:
    """Shape expressions over the symbols, simplest first."""
    yield from symbols
    for s, k in itertools.product(symbols, range(2, 9)):
        yield f"{k}*{s}"
        yield f"{s}//{k}"
    for a, b in itertools.permutations(symbols, 2):
        if a < b:
            yield f"{a}*{b}"
            yield f"{a}+{b}"
        yield f"{a}-{b}"


def symbolic(values: dict[str, int], shapes: dict[str, dict[str, int]],
             known: tuple[str, ...] = ()) -> tuple[str | int, list[str]]:
    """The simplest expression equal to ``values[set]`` in every shape set, and the others
    that fit as well (an ambiguity a further shape set would settle): expressions of one or
    two symbols, then the ``known`` ones (the inputs' own dimensions, ``3*NH*D``), their
    small multiples and their sums.  A constant when the dimension is the same everywhere and no expression
    gives it; ``TODO`` if nothing fits."""
    from .expr import eval_expr

    symbols = sorted(set.intersection(*(set(b) for b in shapes.values())), key=lambda s: (len(s), s))
    known = tuple(dict.fromkeys(known))
    tiers = (_candidates(symbols),  # the inputs' own dimensions only where no simpler expression fits
             itertools.chain(known, (f"{k}*({e})" for e in known for k in range(2, 9)),
                             (f"{a}+{b}" for a, b in itertools.combinations(known, 2))))
    for exprs in tiers:
        # ``S//k`` fits only where k divides S: compared through the true quotient.
        fits = list(dict.fromkeys(expr for expr in exprs if all(
            eval_expr(expr.replace("//", "/"), b) == values[name] for name, b in shapes.items())))
        if fits:
            return fits[0], fits[1:]
    if len(set(values.values())) == 1:
        return next(iter(values.values())), []
    return f"{TODO} a shape expression giving {', '.join(f'{v} on {k}' for k, v in values.items())}", []


def _signature_inputs(fn: Callable, inputs: dict, params: dict) -> dict[str, Scalar]:
    """The params: ``--param`` values, then the reference's scalar keyword defaults (a default
    such as None stays the reference's own); every other parameter must be an ``--input``."""
    found = dict(params)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in inputs or name in found:
            continue
        if isinstance(p.default, (bool, int, float, str)):
            found[name] = p.default
        elif p.default is p.empty:
            raise CodaError(f"the reference takes {name!r}: give --input {name}=SHAPE (e.g. --input {name}=T,H) "
                            f"or --param {name}=VALUE")
    unknown = [n for n in [*inputs, *params] if n not in inspect.signature(fn).parameters]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
        raise CodaError(f"the reference does not take {', '.join(unknown)} (its parameters: "
                        f"{', '.join(inspect.signature(fn).parameters)})")
    return found


# --------------------------------------------------------------------------- the file

def _on_every_set(calls: dict[str, Call], shapes: dict[str, dict[str, int]],
                  values: Callable[[Call], dict[str, int]]) -> dict[str, str]:
    """The inputs a call's ``values`` name on every shape set, each with its value as an expression
    of the symbols, in the order the first call met them (inputs no expression gives are left out)."""
    names = set.intersection(*(set(values(c)) for c in calls.values()))
    out = {}
    for name in sorted(names, key=list(values(next(iter(calls.values())))).index):
        expr, _ = symbolic({s: values(c)[name] for s, c in calls.items()}, shapes)
        if not str(expr).startswith(TODO):
            out[name] = str(expr)
    return out


def _fan_in(calls: dict[str, Call], shapes: dict[str, dict[str, int]]) -> dict[str, str]:
    """The inputs that are a matmul's right operand on every shape set, with that matmul's K
    as an expression of the symbols."""
    return _on_every_set(calls, shapes, lambda c: c.weights)


# What a normalisation reads an input as -> (its role, its init), and why, for the file's comment.
NORM_INITS = {"norm_weight": ("norm_weight", {"dist": "ones_plus_noise", "scale": 0.1}),
              "offset_weight": ("norm_weight", {"dist": "normal", "scale": 0.1}),
              "norm_bias": ("norm_weight", {"dist": "normal", "scale": 0.5}),
              "centred": ("", {"dist": "normal", "mean": 1.0, "scale": 1.0}),
              "positions": ("index", {"dist": "positions", "high": 4096}),
              "frequencies": ("table", {"dist": "uniform", "mean": 0.5, "scale": 0.5})}
NORM_NOTES = {"norm_weight": "a norm's weight, drawn near 1 as a trained one is",
              "offset_weight": "a norm's weight applied as 1 + w (Gemma's, LayerNorm1P), drawn near 0 as a "
                               "trained one is",
              "norm_bias": "a norm's bias, drawn at 0.5 (a bias the program drops then shows)",
              "centred": "a LayerNorm's input, drawn with mean 1 (at mean 0 its centring is barely tested)",
              "positions": "positions a rotation's angles are made of, drawn as packed sequences' below 4096 "
                           "(angles of every size: at N(0, 1) sin is nearly its angle and a wrong rotation passes)",
              "frequencies": "a rotation's frequencies, drawn in (0, 1) as base ** (-2j / d) are"}


def _targets(calls: dict[str, Call], shapes: dict[str, dict[str, int]]) -> dict[str, tuple[str, int]]:
    """The inputs a cross-entropy takes as its target on every shape set, with its number of classes
    as an expression of the symbols and its ignore_index."""
    classes = _on_every_set(calls, shapes, lambda c: {k: v[0] for k, v in c.targets.items()})
    return {k: (expr, next(iter(calls.values())).targets[k][1]) for k, expr in classes.items()}


def _index_init(k: str, targets: dict[str, tuple[str, int]], ranges: dict[str, str],
                specials: dict[str, set[int]], positions: bool) -> tuple[str | None, dict[str, Any]]:
    """An integer input's role and init: a cross-entropy's target drawn among its classes with its
    padding, an index (``gather``, ``embedding``, ``x[i]``...) below the size it indexes (positions
    as packed sequences'), padded where the reference tells a value outside that range apart
    (``targets == -100``); else a TODO."""
    if k in targets:
        return "index", {"dist": "randint", "high": targets[k][0],
                         "ignore": {"value": targets[k][1], "fraction": 0.125}}
    if positions or "pos" in k.lower() and k in ranges:  # an angle's, or a table's rows'
        return "index", {"dist": "positions", "high": ranges.get(k, 4096)}
    if k not in ranges:
        # a loss's targets usually hold padding: ignore: {value: -100, fraction: 0.125} draws it
        return None, {"dist": "randint", "high": f"{TODO} the exclusive upper bound of {k}'s values (an "
                                                 "expression; targets with padding add ignore: {value: -100})"}
    init: dict[str, Any] = {"dist": "randint", "high": ranges[k]}
    outside = sorted(v for v in specials.get(k, ()) if v < 0)
    if outside:  # a value the reference masks (the index it gathers with is clamped or replaced first)
        init["ignore"] = {"value": outside[0], "fraction": 0.125}
    return "index", init


def _rotary_roles(rotary: set[str], inputs: dict[str, tuple[list[str], str]], binding: dict[str, int]
                  ) -> dict[str, str]:
    """The inputs an angle is made of: positions (named so, else the largest) and frequencies."""
    from .expr import eval_expr

    size = {k: math.prod(eval_expr(d, {n: float(v) for n, v in binding.items()}) for d in inputs[k][0])
            for k in rotary}
    positions = {k for k in rotary if "pos" in k.lower()} or ({max(rotary, key=size.get)} if rotary else set())
    return {k: "positions" if k in positions else "frequencies" for k in sorted(rotary)}


def token_sizes(inputs: dict[str, tuple[list[str], str]], held: Collection[str]) -> set[str]:
    """The symbols of the token axis: the leading size of each input of two or more dimensions
    but those ``held`` (a model's: a matmul's right operand, a table) (``x=T,H``; ``h=B,S,H`` gives B)."""
    from .expr import expr_symbols

    leading = [dims[0] for k, (dims, _) in inputs.items() if len(dims) > 1 and k not in held]
    return set().union(*map(expr_symbols, leading))


def parameter_inputs(inputs: dict[str, tuple[list[str], str]], held: Collection[str], tokens: set[str]
                     ) -> list[str]:
    """The float inputs not ``held`` already (a model's: a matmul's right operand, a norm's weight)
    that are a model's parameters all the same: those whose shape holds no token size
    (``tokens``: :func:`token_sizes`; where no input has a token axis, those of a fixed size).  Activations
    follow the tokens; a bias (N), a per-channel scale (H) and a trained scalar (1) do not.  As
    activations the judge's scaled draw took them to 2^12 times their scale whole (a softplus slope
    at -90 has a gradient under fp32's smallest normal); as parameters it spreads their elements
    over a trained model's values."""
    from .expr import expr_symbols

    found = []
    for k, (dims, dtype) in inputs.items():
        sizes = set().union(*(expr_symbols(d) for d in dims))
        if not dtype.startswith("int") and k not in held and not (sizes & tokens if tokens else sizes):
            found.append(k)
    return found


def parameter_note(tokens: set[str]) -> str:
    """Why an input :func:`parameter_inputs` finds is drawn as a model's parameter, for a task
    file's comment or a check's problem."""
    why = f"no token size ({', '.join(sorted(tokens))}) in the shape" if tokens else "a fixed size (no symbol)"
    return (f"{why}, so a model's parameter (a bias, a per-channel scale, a trained scalar), drawn and varied as "
            "one (role: weight): the judge spreads a parameter's elements over a trained model's values, where it "
            "scales an activation whole by up to 2^12")


# The tolerance of a gradient through a kink: its max rule widened alone (Tolerance says why)
KINK_RULE = "{factor: 1000, norm_factor: 2}"


def _kink_tolerances(call: Call, gradients: list[str]) -> list[str]:
    """The kink's tolerance for each gradient through a kink the reference calls (the gradients of
    the inputs upstream of it: :attr:`.recorder.Call.kinked_inputs`), with why."""
    through = [g for g in gradients if g in call.kinked_inputs]
    if not through:
        return []
    grads = ", ".join(f"d{g}" for g in through)
    return [f"# The reference calls {', '.join(call.kinks)}, whose derivative jumps: a gradient through it ({grads})",
            "# differs from the fp64 reference wherever a rounding moves a value across the kink, by one whole term "
            "(dy * w) each time,",
            "# in other elements than the bf16 reference's own flips. So their max rule is widened alone; their norm "
            "and bias rules",
            "# stay at twice the reference's noise and their median element within 4x its error. Where a weight's or "
            "a bias's gradient,",
            "# which sums the flips, still fails its 2% norm rule now and then, give it alone rel_norm: 0.06 (the "
            "suite's ReLU tasks do).",
            "tolerances:", *(f"  d{g}: {KINK_RULE}" for g in through)]


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip().removesuffix("...").strip()


def skeleton(name: str, reference: str, folder: Path, shapes: dict[str, dict[str, int]],
             inputs: dict[str, tuple[list[str], str]], params: dict[str, Scalar],
             gradients: list[str]) -> str:
    """The task file's text; ``reference`` is as the YAML will name it (relative to ``folder``)."""
    try:
        fn = import_reference(reference, folder)
    except ReferenceImportError as e:
        raise CodaError(f"--reference {reference}: {e}") from None
    params = _signature_inputs(fn, inputs, params)
    _check_dims(inputs, shapes)
    for g in gradients:
        if g not in inputs or inputs[g][1].startswith("int"):
            raise CodaError(f"--gradients: {g!r} is not a float --input")
    calls = {s: call_reference(fn, inputs, params, binding, s) for s, binding in shapes.items()}
    first = next(iter(calls.values())).outs
    lines = ["# Written by `coda-agent tasks new` from the reference's outputs on each shape set.",
             "# Every TODO is for you to fill in; `coda-agent tasks check` lists what is left.",
             f"name: {_flow(name)}"]
    doc = inspect.getdoc(fn)
    summary = " ".join(doc.split("\n\n")[0].split()) if doc else f"{TODO} what the task computes, in a sentence"
    lines += [f"summary: {_flow(summary)}", f"families: {_flow(f'{TODO} pick from [{FAMILIES}]')}", "inputs:"]
    fan_in = _fan_in(calls, shapes)
    if fan_in:
        lines.append(f"  # {', '.join(fan_in)}: a matmul's right operand, drawn at 1/sqrt(its K) so that the "
                     "products are of the order of the other inputs (at scale 1 a term such as a residual "
                     "hides under their rounding, and a program that drops it passes)")
    norms = {k: v for k, v in next(iter(calls.values())).norms.items() if k not in fan_in}
    norms.update(_rotary_roles(next(iter(calls.values())).rotary - set(fan_in) - set(norms), inputs,
                               next(iter(shapes.values()))))
    targets = _targets(calls, shapes)
    ranges = {k: v for k, v in _on_every_set(calls, shapes, lambda c: c.ranges).items() if k not in targets}
    specials = next(iter(calls.values())).specials
    if targets:
        lines.append(f"  # {', '.join(targets)}: a cross-entropy's target, drawn among its classes with one in "
                     "eight set to its ignore_index (padding: a program must give those rows no loss and no "
                     "gradient)")
    if norms:
        named = {what: [k for k, v in norms.items() if v == what] for what in NORM_INITS}
        lines.append("  # " + "; ".join(f"{', '.join(ks)}: {NORM_NOTES[what]}" for what, ks in named.items() if ks))
    # the token axis is read off the activations (what no matmul takes as a weight); a norm's weight is
    # drawn as one already
    tokens = token_sizes(inputs, fan_in)
    fixed = [k for k in parameter_inputs(inputs, fan_in, tokens) if k not in norms]
    if fixed:
        lines.append(f"  # {', '.join(fixed)}: {parameter_note(tokens)}")
    for k, (dims, dtype) in inputs.items():
        init: dict[str, Any] = {"dist": "normal", "scale": 1.0}
        entry: dict[str, Any] = {"shape": dims, "dtype": dtype}
        if k in fan_in:
            entry["role"], init["scale"] = "weight", f"1 / sqrt({fan_in[k]})"
        elif k in norms:
            role, init = NORM_INITS[norms[k]]
            entry.update({"role": role} if role else {})
        elif k in fixed:
            entry["role"] = "weight"
        if dtype.startswith("int"):
            role, init = _index_init(k, targets, ranges, specials, norms.get(k) == "positions")
            entry.update({"role": role} if role else {})
        lines.append(f"  {k}: {_flow({**entry, 'init': init})}")
    if params:
        lines.append(f"params: {_flow(params)}")
    known = tuple(d for dims, _ in inputs.values() for d in dims)  # the inputs' own dimensions
    lines.append("outputs:")
    for out, t in first.items():
        dims, notes = [], []
        for d in range(t.dim()):
            expr, others = symbolic({s: calls[s].outs[out].shape[d] for s in calls}, shapes, known)
            dims.append(expr)
            if others:
                notes.append(f"{expr} could also be {', '.join(others[:3])}")
        note = f"  # {'; '.join(notes)}: a further shape set tells them apart" if notes else ""
        lines.append(f"  {out}: {_flow({'shape': dims, 'dtype': DTYPE_NAMES[t.dtype]})}{note}")
    scalars = [out for out, t in first.items() if t.dim() == 0]
    if scalars and gradients:
        lines.append(f"# {', '.join(scalars)}: 0-d (a mean), so the backward receives a 0-d gradient, which no "
                     "epilogue operand takes (a Scalar is a Python number):")
        lines.append("# return the loss per row (reduction=\"none\") and take the mean in the training code, "
                     "as tasks/llama3/lm_head_xent.yaml does")
    lines.append("shapes:")
    lines += [f"  {s}: {_flow(b)}" for s, b in shapes.items()]
    if "small" not in shapes:
        lines.append(f"cpu_shape_set: {_flow(next(iter(shapes)))}")
    lines.append(f"reference: {_flow(reference)}")
    if gradients:
        lines.append(f"gradients: {_flow(gradients)}")
        lines += _kink_tolerances(next(iter(calls.values())), gradients)
    elif not any(f"d{k}" in first for k in inputs):  # a reference that returns gradients is one step, forward only
        floats = [k for k, (_, dtype) in inputs.items() if not dtype.startswith("int")]
        lines.append(f"# gradients: {_flow(floats)}  <- uncomment (or --gradients) for a backward too: the "
                     "inputs whose gradients it returns; as it stands the task is forward only")
    hint = ""
    # A reference that returns gradients (one step: loss and dx, dw) runs their matmuls under
    # torch.autograd.grad, where no call is recorded: they are those its returned d<input>s need.
    returned = [k for k in inputs if f"d{k}" in first]
    backs = gradients or returned
    for says, of in (("; the reference's forward runs", lambda c: c.mnk),
                     (", and its backward of those" if gradients else
                      f", and the gradients it returns ({', '.join('d' + k for k in returned)}) need",
                      lambda c: c.backward_mnk(backs) if backs else [])):
        count = min(len(of(c)) for c in calls.values())
        matmuls = [[symbolic({s: of(calls[s])[i][j] for s in calls}, shapes, known)[0] for j in range(3)]
                   for i in range(count)]
        hint += f"{says} {_flow(matmuls)}" if matmuls else ""
    lines.append(f"gemms: {_flow(f'{TODO} the GEMMs the fused program needs, as [[M, N, K], ...]' + hint)}")
    target = (f"{TODO} {{vs_gemm: 1.05, vs_compile: 1.2}} (fused / plain GEMM time at most, "
              "torch.compile / fused time at least), or remove the field for those defaults")
    lines.append(f"target: {_flow(target)}")
    return "\n".join(lines) + "\n"
