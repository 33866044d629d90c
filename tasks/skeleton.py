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
program that leaves it out fails.  A reference with a kink (``relu``,
``clamp``, ``abs``, ...) and gradients gets a comment on the tolerance of the
gradients through it.

What a call cannot tell is left as a ``TODO ...`` value for a person:
``families``, ``gemms`` (with the reference's own matmuls as a hint),
``target``, an integer input's range, and a summary if the reference has no
docstring.  ``load_task`` reports every TODO by name, so ``coda-agent tasks
check`` fails until each is filled in.
"""

from __future__ import annotations

import inspect
import itertools
import keyword
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import yaml

from coda_agent.errors import CodaError

from .dryrun import TORCH_DTYPES
from .sources import ReferenceImportError, import_reference
from .messages import DTYPE_ALIASES, TODO
from .spec import Scalar

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
FAMILIES = "elementwise, pairwise, vector, tile, reduction, stateful"
MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "linear", "addmm"}
# Functions whose derivative jumps (ReLU and its kin): a gradient through one depends on which side
# of the kink a rounding puts each value, so it is noisier than the reference's own rounding shows.
# Normalisations -> whether they centre their input (a LayerNorm's centring is tested only by an
# input whose mean is not 0); their weight is args[2], their bias args[3] (F.layer_norm, F.rms_norm,
# F.group_norm).
NORMS = {"layer_norm": True, "group_norm": True, "rms_norm": False}
# Losses whose second argument is a target index into the first's classes (dim 1, or 0 unbatched).
LOSSES = {"cross_entropy", "nll_loss"}
COMPARISONS = {"eq", "__eq__", "ne", "__ne__"}
KINKS = {"relu", "relu_", "relu6", "threshold", "leaky_relu", "hardtanh", "clamp", "clamp_min", "clamp_max",
         "clip", "abs", "maximum", "minimum", "max", "min", "hardshrink", "softshrink"}


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


def symbolic(values: dict[str, int], shapes: dict[str, dict[str, int]]) -> tuple[str | int, list[str]]:
    """The simplest expression equal to ``values[set]`` in every shape set, and the others
    that fit as well (an ambiguity a further shape set would settle).  A constant when
    the dimension is the same everywhere and no expression gives it; ``TODO`` if nothing fits."""
    from .expr import eval_expr

    symbols = sorted(set.intersection(*(set(b) for b in shapes.values())), key=lambda s: (len(s), s))
    # ``S//k`` fits only where k divides S: compared through the true quotient.
    fits = [expr for expr in _candidates(symbols)
            if all(eval_expr(expr.replace("//", "/"), b) == values[name] for name, b in shapes.items())]
    if fits:
        return fits[0], fits[1:]
    if len(set(values.values())) == 1:
        return next(iter(values.values())), []
    return f"{TODO} a shape expression giving {values}", []


# --------------------------------------------------------------------------- calling the reference

class Call(torch.overrides.TorchFunctionMode):
    """What one call of the reference shows, recorded while it runs: its outputs (``outs``), the
    (M, N, K) of every matmul (``mnk``, batch dims folded into M), the inputs that are a matmul's
    right operand (a weight) with that matmul's K (``weights``: its fan-in), the functions called
    whose derivative jumps (``kinks``), the inputs a normalisation reads (``norms``: its weight,
    its bias, the input a LayerNorm centres) and the targets of a cross-entropy (``targets``: the
    number of classes and the ignore_index).

    An input is recognised by its storage, so a view (``w.t()``, ``w[0::2]``) or a detached
    copy of it counts as the input."""

    def __init__(self, storages: dict[int, str]) -> None:
        super().__init__()
        self.mnk: list[tuple[int, int, int]] = []
        self.operands: list[tuple[str | None, str | None, bool]] = []  # per matmul: A's input, B's, B stored (N, K)
        self.storages = storages
        self.weights: dict[str, int] = {}
        self.kinks: list[str] = []
        self.norms: dict[str, str] = {}
        self.targets: dict[str, tuple[int, int]] = {}
        self.specials: dict[str, set[int]] = {}  # integer inputs compared with a constant: value(s)
        self.outs: dict[str, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in KINKS and name not in self.kinks:
            self.kinks.append(name)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in NORMS and args and isinstance(args[0], torch.Tensor):
            kw = kwargs or {}
            parts = {"centred" if NORMS[name] else "": args[0],
                     "norm_weight": kw.get("weight", args[2] if len(args) > 2 else None),
                     "norm_bias": kw.get("bias", args[3] if len(args) > 3 and name != "rms_norm" else None)}
            for what, t in parts.items():
                named = self.storages.get(_storage(t)) if what and isinstance(t, torch.Tensor) else None
                if named is not None:
                    self.norms.setdefault(named, what)
        if name in COMPARISONS and len(args) == 2:  # an index input told apart at one value (an ignore_index)
            named, value = (args[0], args[1]) if isinstance(args[0], torch.Tensor) else (args[1], args[0])
            input_ = self.storages.get(_storage(named)) if isinstance(named, torch.Tensor) else None
            if input_ is not None and not named.is_floating_point() and isinstance(value, int) \
                    and not isinstance(value, bool):
                self.specials.setdefault(input_, set()).add(value)
        if name in LOSSES and len(args) > 1 and isinstance(args[0], torch.Tensor):
            target = self.storages.get(_storage(args[1])) if isinstance(args[1], torch.Tensor) else None
            if target is not None:
                classes = args[0].shape[1] if args[0].dim() > 1 else args[0].shape[0]
                self.targets.setdefault(target, (classes, (kwargs or {}).get("ignore_index", -100)))
        if name in MATMULS and len(tensors) >= 2:
            a, b = tensors[-2:] if name == "addmm" else tensors[:2]
            if name == "__rmatmul__":  # w.__rmatmul__(x) is x @ w
                a, b = b, a
            if name == "linear":  # (.., K) x (N, K)
                self.mnk.append((math.prod(a.shape[:-1]), b.shape[0], b.shape[1]))
                self._weight(b, b.shape[1])
                self.operands.append((self.storages.get(_storage(a)), self.storages.get(_storage(b)), True))
            elif a.dim() >= 2 and b.dim() >= 2:
                self.mnk.append((math.prod(a.shape[:-1]), b.shape[-1], a.shape[-1]))
                self._weight(b, a.shape[-1])
                self.operands.append((self.storages.get(_storage(a)), self.storages.get(_storage(b)),
                                      b.stride(-2) == 1 and b.stride(-1) != 1))  # w.t(): w is (N, K)
        return func(*args, **(kwargs or {}))

    def backward_mnk(self, gradients: list[str]) -> list[tuple[int, int, int]]:
        """The matmuls a backward runs for ``gradients``: per forward matmul (M, N, K), dA = dD B^T
        (M, K, N) unless A is an input that gets no gradient, and dB = A^T dD unless B is: (N, K, M)
        for a weight stored (N, K) as nn.Linear keeps it, else (K, N, M)."""
        out = []
        for (m, n, k), (a, b, b_nk) in zip(self.mnk, self.operands):
            if a is None or a in gradients:
                out.append((m, k, n))
            if b is None or b in gradients:
                out.append((n, k, m) if b_nk else (k, n, m))
        return out

    def _weight(self, b: torch.Tensor, k: int) -> None:
        name = self.storages.get(_storage(b))
        if name is not None:
            self.weights.setdefault(name, k)


def _storage(t: torch.Tensor) -> int:
    """One number per storage (a view shares its base's), meta tensors included."""
    return t.untyped_storage()._cdata


# A set whose inputs pass this many bytes (a GPU-sized set: the one performance is measured on)
# is called on meta tensors, shapes and dtypes only, and on the CPU only if the reference
# cannot run on meta tensors (a data-dependent op, .item()).
META_SET_BYTES = 64 << 20


def _shape(dims: list[str], binding: dict[str, int]) -> tuple[int, ...]:
    from .expr import eval_expr

    return tuple(int(eval_expr(d, binding)) for d in dims)


def _draw(dims: list[str], dtype: str, binding: dict[str, int], gen: torch.Generator | None) -> torch.Tensor:
    """A CPU tensor of random values, or with ``gen`` None an empty meta tensor."""
    shape = _shape(dims, binding)
    if gen is None:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
    if dtype.startswith("int"):  # a valid index into the smallest dimension of the set
        return torch.randint(0, min(binding.values()), shape, generator=gen).to(TORCH_DTYPES[dtype])
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[dtype])


def _call(fn: Callable, inputs: dict[str, tuple[list[str], str]], params: dict[str, Scalar],
          binding: dict[str, int], set_name: str) -> Call:
    size = sum(math.prod(_shape(dims, binding)) * TORCH_DTYPES[dtype].itemsize for dims, dtype in inputs.values())
    if size > META_SET_BYTES:
        try:
            return _run(fn, inputs, params, binding, None)
        except Exception:  # noqa: BLE001 - not every reference runs on meta tensors: call it for real
            pass
    try:
        return _run(fn, inputs, params, binding, torch.Generator().manual_seed(0))
    except CodaError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's reference failing is theirs to see
        raise CodaError(f"calling the reference on shape set {set_name} {binding} failed: {type(e).__name__}: "
                        f"{e}; check the --input shapes and --param values") from None


def _run(fn: Callable, inputs: dict[str, tuple[list[str], str]], params: dict[str, Scalar],
         binding: dict[str, int], gen: torch.Generator | None) -> Call:
    args = {k: _draw(dims, dtype, binding, gen) for k, (dims, dtype) in inputs.items()}
    recorder = Call({_storage(t): k for k, t in args.items()})
    with torch.no_grad(), recorder:
        outs = fn(**args, **params)
    if not isinstance(outs, dict) or not outs:
        got = "an empty dict" if isinstance(outs, dict) else f"a {type(outs).__name__}"
        raise CodaError(f"the reference returned {got}; a task reference returns a dict of its outputs, "
                        "{'name': tensor, ...}")
    for name, t in outs.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise CodaError(f"the reference's output {name!r} is not a Python name (a program returns and a "
                            "backward takes d<output> by name); rename the key in the reference")
        if name in inputs or name in params:
            raise CodaError(f"the reference's output {name!r} is also an {'input' if name in inputs else 'param'}; "
                            "rename the key in the reference (outputs, inputs and params are named apart)")
        if not isinstance(t, torch.Tensor):
            raise CodaError(f"the reference's output {name!r} is a {type(t).__name__}; return a tensor")
        if t.dtype not in DTYPE_NAMES:
            raise CodaError(f"the reference's output {name!r} is {t.dtype}; outputs are "
                            f"{', '.join(TORCH_DTYPES)} (cast it in the reference)")
    recorder.outs = outs
    return recorder


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
              "norm_bias": ("norm_weight", {"dist": "normal", "scale": 0.5}),
              "centred": ("", {"dist": "normal", "mean": 1.0, "scale": 1.0})}
NORM_NOTES = {"norm_weight": "a norm's weight, drawn near 1 as a trained one is",
              "norm_bias": "a norm's bias, drawn at 0.5 (a bias the program drops then shows)",
              "centred": "a LayerNorm's input, drawn with mean 1 (at mean 0 its centring is barely tested)"}


def _targets(calls: dict[str, Call], shapes: dict[str, dict[str, int]]) -> dict[str, tuple[str, int]]:
    """The inputs a cross-entropy takes as its target on every shape set, with its number of classes
    as an expression of the symbols and its ignore_index."""
    classes = _on_every_set(calls, shapes, lambda c: {k: v[0] for k, v in c.targets.items()})
    return {k: (expr, next(iter(calls.values())).targets[k][1]) for k, expr in classes.items()}


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
    calls = {s: _call(fn, inputs, params, binding, s) for s, binding in shapes.items()}
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
    targets = _targets(calls, shapes)
    if targets:
        lines.append(f"  # {', '.join(targets)}: a cross-entropy's target, drawn among its classes with one in "
                     "eight set to its ignore_index (padding: a program must give those rows no loss and no "
                     "gradient)")
    if norms:
        named = {what: [k for k, v in norms.items() if v == what] for what in NORM_INITS}
        lines.append("  # " + "; ".join(f"{', '.join(ks)}: {NORM_NOTES[what]}" for what, ks in named.items() if ks))
    for k, (dims, dtype) in inputs.items():
        init: dict[str, Any] = {"dist": "normal", "scale": 1.0}
        entry: dict[str, Any] = {"shape": dims, "dtype": dtype}
        if k in fan_in:
            entry["role"], init["scale"] = "weight", f"1 / sqrt({fan_in[k]})"
        elif k in norms:
            role, init = NORM_INITS[norms[k]]
            entry.update({"role": role} if role else {})
        if dtype.startswith("int") and k in targets:  # a cross-entropy's target: its classes and padding
            entry["role"], init = "index", {"dist": "randint", "high": targets[k][0],
                                            "ignore": {"value": targets[k][1], "fraction": 0.125}}
        elif dtype.startswith("int"):
            # a loss's targets usually hold padding: ignore: {value: -100, fraction: 0.125} draws it
            init = {"dist": "randint", "high": f"{TODO} the exclusive upper bound of {k}'s values (an expression; "
                                               "targets with padding add ignore: {value: -100})"}
        lines.append(f"  {k}: {_flow({**entry, 'init': init})}")
    if params:
        lines.append(f"params: {_flow(params)}")
    lines.append("outputs:")
    for out, t in first.items():
        dims, notes = [], []
        for d in range(t.dim()):
            expr, others = symbolic({s: calls[s].outs[out].shape[d] for s in calls}, shapes)
            dims.append(expr)
            if others:
                notes.append(f"{expr} could also be {', '.join(others[:3])}")
        note = f"  # {'; '.join(notes)}: a further shape set tells them apart" if notes else ""
        lines.append(f"  {out}: {_flow({'shape': dims, 'dtype': DTYPE_NAMES[t.dtype]})}{note}")
    lines.append("shapes:")
    lines += [f"  {s}: {_flow(b)}" for s, b in shapes.items()]
    if "small" not in shapes:
        lines.append(f"cpu_shape_set: {_flow(next(iter(shapes)))}")
    lines.append(f"reference: {_flow(reference)}")
    if gradients:
        lines.append(f"gradients: {_flow(gradients)}")
        kinks = next(iter(calls.values())).kinks
        if kinks:
            lines += [f"# The reference calls {', '.join(kinks)}, whose derivative jumps: a gradient through it "
                      "differs from the fp64 reference",
                      "# wherever a rounding moves a value across the kink, more than the bf16 reference's own "
                      "error shows. If a correct",
                      "# program fails on such a gradient now and then (a weight's or a bias's, summed over many "
                      "rows, and what they feed),",
                      "# widen those gradients' rules alone, tolerances: {d<input>: {factor: 3, rel_norm: 0.06}}, "
                      "and keep the others tight."]
    else:
        floats = [k for k, (_, dtype) in inputs.items() if not dtype.startswith("int")]
        lines.append(f"# gradients: {_flow(floats)}  <- uncomment (or --gradients) for a backward too: the "
                     "inputs whose gradients it returns; as it stands the task is forward only")
    hint = ""
    for says, of in (("; the reference's forward runs", lambda c: c.mnk),
                     (", and its backward of those", lambda c: c.backward_mnk(gradients) if gradients else [])):
        count = min(len(of(c)) for c in calls.values())
        matmuls = [[symbolic({s: of(calls[s])[i][j] for s in calls}, shapes)[0] for j in range(3)]
                   for i in range(count)]
        hint += f"{says} {_flow(matmuls)}" if matmuls else ""
    lines.append(f"gemms: {_flow(f'{TODO} the GEMMs the fused program needs, as [[M, N, K], ...]' + hint)}")
    target = (f"{TODO} {{vs_gemm: 1.05, vs_compile: 1.2}} (fused / plain GEMM time at most, "
              "torch.compile / fused time at least), or remove the field for those defaults")
    lines.append(f"target: {_flow(target)}")
    return "\n".join(lines) + "\n"


def undrawn_values(task: Any) -> list[str]:
    """What the reference treats apart in an integer input but the task's draw never holds: a
    cross-entropy's ignore_index, or a value it compares the input with (``target == -100``) that
    is outside the input's ``randint`` range with no ``ignore`` drawing it.  A program that counts
    those rows, or sends them a gradient, would pass every check."""
    from .expr import eval_expr

    spec = task.spec
    binding = spec.shapes[spec.cpu_shape_set]
    inputs = {k: (list(t.shape), t.dtype) for k, t in spec.inputs.items()}
    try:
        call = _run(task.reference_fn, inputs, dict(spec.params), binding, None)
    except Exception:  # noqa: BLE001 - a reference that needs values: called on small CPU tensors
        try:
            call = _run(task.reference_fn, inputs, dict(spec.params), binding, torch.Generator().manual_seed(0))
        except Exception:  # noqa: BLE001 - the verifier's reference stage reports a failing reference
            return []
    special = {k: set(v) for k, v in call.specials.items()}
    for k, (_, ignore_index) in call.targets.items():
        special.setdefault(k, set()).add(ignore_index)
    problems = []
    for k, values in sorted(special.items()):
        init = spec.inputs[k].init
        drawn = {init.ignore.value} if init.ignore is not None else set()
        shape = spec.shape_of(spec.inputs[k], spec.cpu_shape_set)
        high = (None if init.dist != "randint" else int(eval_expr(init.high, {n: float(v) for n, v in binding.items()}))
                if init.high is not None else (shape[-1] if shape else 1))
        missing = sorted(v for v in values if v not in drawn and not (high is not None and 0 <= v < high))
        if missing:
            problems.append(f"inputs.{k}.init: the reference treats {k} == {', '.join(map(str, missing))} apart "
                            "(an ignore_index), "
                            f"but no draw holds it; add ignore: {{value: {missing[0]}, fraction: 0.125}} so that "
                            "a program counting those rows fails")
    return problems
