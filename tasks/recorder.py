"""Calling a task's reference the way ``tasks new`` and ``tasks check`` do: on drawn CPU tensors,
or on meta tensors for a set sized for the GPU, recording what the call shows (:class:`Call`:
its outputs, its matmuls, the inputs that are weights, normalisation weights or a loss's
targets, its kinks, and the values it compares integer inputs with)."""

from __future__ import annotations

import keyword
import math
import sys
from typing import Any, Callable

import torch

from coda_agent.errors import CodaError

from . import params as param_rules
from .dryrun import TORCH_DTYPES
from .spec import Scalar

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "linear", "addmm"}
# Normalisations -> whether they centre their input (a LayerNorm's centring is tested only by an
# input whose mean is not 0); their weight is args[2], their bias args[3] (F.layer_norm, F.rms_norm,
# F.group_norm).
NORMS = {"layer_norm": True, "group_norm": True, "rms_norm": False}
# Losses whose second argument is a target index into the first's classes (dim 1, or 0 unbatched).
LOSSES = {"cross_entropy", "nll_loss"}
GATHERS = {"gather"}  # gather(scores, 1, index): an index input picking one column of each row's scores
# Calls that index a dimension with an integer tensor, the bound of whose values they show.
INDEXERS = {"gather", "index_select", "take_along_dim", "embedding", "one_hot", "__getitem__"}
# An angle's functions (RoPE's): the inputs an angle is computed from are positions and frequencies.
ROTATIONS = {"sin", "cos"}
ADDS = {"add", "__add__", "__radd__"}
# Comparisons that tell an integer input apart at one value (``target == -100``).
COMPARISONS = {"eq", "__eq__", "ne", "__ne__"}
# Functions whose derivative jumps (ReLU and its kin): a gradient through one depends on which side
# of the kink a rounding puts each value, so it is noisier than the reference's own rounding shows.
KINKS = {"relu", "relu_", "relu6", "threshold", "leaky_relu", "hardtanh", "clamp", "clamp_min", "clamp_max",
         "clip", "abs", "maximum", "minimum", "max", "min", "hardshrink", "softshrink",
         # a slope of their own below 0 (PReLU's trained one, SELU's and ELU's alpha unless it is 1) and
         # the hard activations' corners at -3 and 3
         "prelu", "_prelu_kernel", "rrelu", "elu", "elu_", "selu", "selu_", "hardswish", "hardswish_",
         "hardsigmoid", "hardsigmoid_"}
# What squares a value (relu(x) ** 2, Primer's squared ReLU): a kink whose every use is one of these
# is smoothed, its derivative 2 * relu(x) continuous.
SQUARES = {"pow", "pow_", "__pow__", "square", "square_"}
MULS = {"mul", "mul_", "__mul__", "__rmul__"}
# A norm written by hand (HF's RMSNorm and its kin, LayerNorm without F.layer_norm): a tensor
# multiplied or divided by a statistic (rsqrt(mean(x^2) + eps), sqrt(var + eps)) is normalised, a
# 1-D input that then scales or shifts it is the norm's weight or bias, and an input less its own
# mean (or whose variance is taken) is centred.  Casts and views carry what a tensor is.
STATS = {"rsqrt", "sqrt", "var", "std", "norm", "vector_norm", "reciprocal"}
CASTS = {"float", "to", "type_as", "double", "bfloat16", "half", "contiguous", "clone", "view", "reshape",
         "unsqueeze", "squeeze", "expand", "expand_as", "__getitem__", "detach"}
SUBS = {"sub", "__sub__", "__rsub__"}
DIVS = {"div", "__truediv__", "true_divide"}


class Call(torch.overrides.TorchFunctionMode):
    """What one call of the reference shows, recorded while it runs: its outputs (``outs``), the
    (M, N, K) of every matmul (``mnk``, batch dims folded into M), the inputs that are a matmul's
    right operand (a weight) with that matmul's K (``weights``: its fan-in), the functions called
    whose derivative jumps where their result is used unsquared (``kinks``), the inputs a
    normalisation reads (``norms``: its weight, its bias, the input a LayerNorm centres, or a 1-D
    weight applied as ``1 + w``), the inputs an angle of ``sin``/``cos`` is computed from
    (``rotary``: RoPE's positions and frequencies,
    followed through the tensors computed from them), the targets of a cross-entropy
    (``targets``: the number of classes and the ignore_index), and the (rows, classes) scores an
    integer input of one dimension picks a column of, by a loss or a ``gather`` (``scores``: the
    logits a target indexes, as computed in this call).

    An input is recognised by its storage, so a view (``w.t()``, ``w[0::2]``) or a detached
    copy of it counts as the input."""

    def __init__(self, storages: dict[int, str], dims: dict[str, int] | None = None,
                 floats: set[str] | None = None) -> None:
        super().__init__()
        self.floats = set(storages.values()) if floats is None else floats  # the float inputs
        self._casts: dict[int, str] = {}  # a cast's or view's storage -> the input it is
        self._stats: set[int] = set()  # statistics a hand-written norm divides by
        self._normed: set[int] = set()  # tensors a statistic normalised
        self._means: dict[int, frozenset[str]] = {}  # a mean's storage -> the inputs it is the mean of
        self.mnk: list[tuple[int, int, int]] = []
        self.operands: list[tuple[str | None, str | None, bool]] = []  # per matmul: A's input, B's, B stored (N, K)
        self.storages = storages
        self.weights: dict[str, int] = {}
        # a kink's result's storage -> [name, squared uses, other uses, the inputs its argument is made of]
        self._kinks: dict[int, list] = {}
        self.norms: dict[str, str] = {}
        self.targets: dict[str, tuple[int, int]] = {}
        self.specials: dict[str, set[int]] = {}  # integer inputs compared with a constant: value(s)
        self.scores: dict[str, torch.Tensor] = {}  # a 1-D integer input -> the (rows, classes) it indexes
        self.ranges: dict[str, int] = {}  # an input an index is made of -> the size of the dimension indexed
        self.rotary: set[str] = set()  # inputs an angle of sin/cos is computed from
        self.dims: dict[str, int] = dims or {}  # each input's number of dimensions
        self.outs: dict[str, torch.Tensor] = {}
        self._derived: dict[int, frozenset[str]] = {}  # a computed tensor's storage -> the inputs it is made of
        self._keep: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        # A sequence argument's tensors count as the call's own: torch.cat((freqs, freqs), -1)
        # makes HF's RoPE angles from the frequencies.
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor)]
        self._kink_uses(name, args, tensors)
        if name in NORMS and args and isinstance(args[0], torch.Tensor):
            kw = kwargs or {}
            parts = {"centred" if NORMS[name] else "": args[0],
                     "norm_weight": kw.get("weight", args[2] if len(args) > 2 else None),
                     "norm_bias": kw.get("bias", args[3] if len(args) > 3 and name != "rms_norm" else None)}
            for what, t in parts.items():
                if what == "centred":  # whatever the input is made of: x.float(), an embedding's rows
                    self._centre(t)
                    continue
                named = self._input_of(t) if what and isinstance(t, torch.Tensor) else None
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
                self._scores(args[0], self._sources_of(args[1]))
        if name in GATHERS and args and isinstance(args[0], torch.Tensor):
            kw = kwargs or {}
            dim, index = (args[1] if len(args) > 1 else kw.get("dim")), (args[2] if len(args) > 2 else kw.get("index"))
            if isinstance(index, torch.Tensor) and dim in (1, -1):
                self._scores(args[0], self._sources_of(index))
        if name in INDEXERS:
            for index, size in _indexed(name, args, kwargs or {}):
                for input_ in self._sources_of(index):
                    self.ranges.setdefault(input_, size)
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
        sources = frozenset().union(*(self._sources_of(t) for t in tensors))
        if name in ROTATIONS and tensors:  # an angle: the inputs it is made of are positions and frequencies
            self.rotary |= self._sources_of(tensors[0])
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if name in ADDS and len(tensors) == 1 and numbers == [1] and len(sources) == 1:
            (input_,) = sources  # 1 + w: a norm weight stored as its offset from 1 (Gemma's, LayerNorm1P)
            if self.dims.get(input_) == 1:
                self.norms.setdefault(input_, "offset_weight")
        out = func(*args, **(kwargs or {}))
        self._hand_norm(name, tensors, out)
        if name in KINKS and not _in_custom_forward():  # a result that is no tensor counts as used unsquared
            self._kinks[_storage(out) if isinstance(out, torch.Tensor) else -len(self._kinks) - 1] = [
                name, 0, 0 if isinstance(out, torch.Tensor) else 1, sources]
            self._keep.append(out)
        if isinstance(out, torch.Tensor) and sources:
            self._derived[_storage(out)] = sources
            self._keep.append(out)  # alive until the call ends: no later tensor takes its storage's id
        return out

    def _input_of(self, t: torch.Tensor) -> str | None:
        """The input ``t`` is, itself, a view or a cast of it (``x.float()``)."""
        return self.storages.get(_storage(t)) or self._casts.get(_storage(t))

    def _hand_norm(self, name: str, tensors: list[torch.Tensor], out: object) -> None:
        """A norm written by hand, seen one call at a time (STATS's comment)."""
        if not tensors or not isinstance(out, torch.Tensor):
            return
        st, ins = _storage(out), [_storage(t) for t in tensors]
        if name in CASTS:
            if (src := self._input_of(tensors[0])) is not None:
                self._casts[st] = src
            for marked in (self._stats, self._normed):
                if ins[0] in marked:
                    marked.add(st)
            if ins[0] in self._means:
                self._means[st] = self._means[ins[0]]
        elif name in STATS:
            self._stats.add(st)
            if name in ("var", "std"):
                self._centre(tensors[0])
        elif name == "mean":
            self._means[st] = self._sources_of(tensors[0])
        elif len(tensors) == 2:
            stat, normed = [i in self._stats for i in ins], [i in self._normed for i in ins]
            if name in SUBS and ins[1] in self._means and self._sources_of(tensors[0]) & self._means[ins[1]]:
                self._centre(tensors[0])  # x - x.mean(-1)
            if name in MULS | DIVS and stat[0] != stat[1]:  # x * rstd, (x - mean) / std
                self._normed.add(st)
            elif any(normed) and name in MULS | ADDS | SUBS:
                other = tensors[normed.index(False)] if not all(normed) else None
                named = self._input_of(other) if other is not None and other.dim() == 1 else None
                if named in self.floats:
                    self.norms.setdefault(named, "norm_weight" if name in MULS else "norm_bias")
                self._normed.add(st)

    def _centre(self, t: torch.Tensor) -> None:
        for named in self._sources_of(t) & self.floats:
            self.norms.setdefault(named, "centred")

    def _scores(self, scores: torch.Tensor, sources: frozenset[str]) -> None:
        """``scores`` (rows, classes) as what each 1-D integer input of ``sources`` indexes."""
        if scores.dim() != 2 or not scores.is_floating_point() or scores.is_meta:
            return
        for name in sources:
            if self.dims.get(name) == 1:
                self.scores.setdefault(name, scores.detach())

    def _kink_uses(self, name: str, args: tuple, tensors: list[torch.Tensor]) -> None:
        """Count each use of a kink's result as squaring it (``x ** 2``, ``x * x``) or not."""
        used = [_storage(t) for t in tensors if _storage(t) in self._kinks]
        if not used:
            return
        exponent = args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else None
        squared = (name in SQUARES and (exponent is None and name.startswith("square") or (exponent or 0) >= 2)) or (
            name in MULS and len(tensors) == 2 and len(set(map(_storage, tensors))) == 1)
        for st in set(used):
            self._kinks[st][1 if squared else 2] += 1

    def _jumps(self) -> list[tuple[str, frozenset[str]]]:
        """(name, the inputs its argument is made of) of each call whose derivative jumps, but those
        whose result is only ever squared; a result the reference returns as it is counts as used
        unsquared."""
        returned = {_storage(t) for t in self.outs.values() if isinstance(t, torch.Tensor)}
        return [(name, sources) for st, (name, squared, other, sources) in self._kinks.items()
                if other or not squared or st in returned]

    @property
    def kinks(self) -> list[str]:
        """The functions called whose derivative jumps (:meth:`_jumps`)."""
        return list(dict.fromkeys(name for name, _ in self._jumps()))

    @property
    def kinked_inputs(self) -> set[str]:
        """The inputs upstream of a kink (:meth:`_jumps`): those whose gradient passes through its
        derivative, and so flips wherever a rounding moves a value across the kink."""
        return set().union(*(sources for _, sources in self._jumps()))

    def _sources_of(self, t: torch.Tensor) -> frozenset[str]:
        """The inputs ``t`` is, or is computed from."""
        named = self.storages.get(_storage(t))
        return frozenset({named}) if named is not None else self._derived.get(_storage(t), frozenset())

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


def _indexed(name: str, args: tuple, kw: dict) -> list[tuple[torch.Tensor, int]]:
    """(integer index tensor, size of the dimension it indexes) of one call of an INDEXERS function:
    ``gather(x, d, i)``, ``index_select(x, d, i)``, ``take_along_dim(x, i, d)``, ``embedding(i, w)``,
    ``one_hot(i, n)``, and ``x[..., i]`` (a tensor subscript at its dimension)."""
    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kw.get(key)

    found: list[tuple[Any, int | None]] = []
    src = arg(0, "input")
    if name in ("gather", "index_select") and isinstance(src, torch.Tensor) and isinstance(arg(1, "dim"), int):
        found.append((arg(2, "index"), src.shape[arg(1, "dim")]))
    elif name == "take_along_dim" and isinstance(src, torch.Tensor):
        dim = arg(2, "dim")
        found.append((arg(1, "indices"), src.numel() if dim is None else src.shape[dim]))
    elif name == "embedding" and isinstance(arg(1, "weight"), torch.Tensor):
        found.append((src, arg(1, "weight").shape[0]))
    elif name == "one_hot" and isinstance(arg(1, "num_classes"), int) and arg(1, "num_classes") > 0:
        found.append((arg(0, "tensor"), arg(1, "num_classes")))
    elif name == "__getitem__" and isinstance(src, torch.Tensor):
        dim = 0
        for item in args[1] if isinstance(args[1], tuple) else (args[1],):
            if item is Ellipsis:  # the dimensions after it count from the end: left alone
                break
            if item is not None:  # None adds a dimension of the result, none of src's
                found.append((item, src.shape[dim] if dim < src.dim() else None))
                dim += 1
    return [(i, n) for i, n in found if isinstance(i, torch.Tensor) and n and not i.is_floating_point()
            and i.dtype != torch.bool]


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


def recorded(fn: Callable, args: dict[str, torch.Tensor], params: dict[str, Scalar]) -> Call:
    """What calling ``fn`` on ``args`` (tensors the caller drew) and ``params`` shows."""
    recorder = _recorder(args)
    with torch.no_grad(), recorder:
        recorder.outs = fn(**args, **params)
    return recorder


def _recorder(args: dict[str, torch.Tensor]) -> Call:
    """A Call that knows ``args`` (the tensors a reference is called on) by storage."""
    return Call({_storage(t): k for k, t in args.items()}, {k: t.dim() for k, t in args.items()},
                {k for k, t in args.items() if t.is_floating_point()})


def _in_custom_forward() -> bool:
    """Whether the running op is inside the forward of a custom ``torch.autograd.Function`` (an fp8
    recipe's quantizer, say): its backward is the author's, so a kink there is none autograd
    differentiates."""
    frame = sys._getframe(2)
    while frame is not None:
        ctx = frame.f_locals.get("ctx") if frame.f_code.co_name == "forward" else None
        if isinstance(ctx, torch.autograd.function.FunctionCtx):
            return True
        frame = frame.f_back
    return False


def call_reference(fn: Callable, inputs: dict[str, tuple[list[str], str]], params: dict[str, Scalar],
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
    recorder = _recorder(args)
    with torch.no_grad(), recorder:
        outs = fn(**args, **param_rules.at(params, binding))  # `head_dim: D` is an int on each set
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
