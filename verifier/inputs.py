"""What the judge feeds a program: fresh inputs, edge inputs, scaled inputs and params.

Seeds are drawn per run by the harness and reach only the judge: the runner
sees tensors, never a seed.  No distribution produces all zeros: a zero input
would let a program that ignores it pass.

**Edge inputs** (:func:`edge_inputs`), derived from the declared
distributions, not per task: every float input whose role is ``activation``,
``residual``, ``saved`` or ``grad`` has about one row in eight scaled by
2**-12 (a row of tiny norm: ``eps`` outside the square root, a missing
``eps``, a division by the row's norm all show) and one in eight by 2**5
(large magnitudes: a softmax or log-sum-exp without its maximum subtracted
overflows), and one in eight by 2**u with u drawn uniformly between those two
exponents (every magnitude in between: a program whose math changes with a
row's statistic, ``where(rstd > 0.05, ...)``, is wrong on some row whatever
band it picks), and in a tensor of rows one in sixteen is exactly zero (a
padding token's embedding: a statistic divided by the row's own maximum is 0/0
there), the same rows in every tensor with the same leading size.  The
two fixed scales are powers of two, exact in every dtype.  (Outlier channels,
a trained model's hidden-state features at 20 to 60 times the rest of a row,
are a fresh draw of their own: :mod:`.outliers`.)  An fp8 input keeps its
declared distribution here (the scaled draw takes it to its format's range).  For a task
with a backward, :func:`aligned_grads` makes one row in eight of each upstream
gradient parallel to the forward output (a normalisation's backward then
nearly cancels to zero on those rows, which is where a gradient computed as a
difference of large terms in low precision goes wrong) and one in sixteen
exactly zero (a masked token's).

**Predicted targets** (:func:`predicted_targets`): in the edge and scaled
draws, about one row in two of a cross-entropy's target is the class the
reference's own scores rank first on those inputs.  Drawn uniformly, a target
is almost never the one a model predicts, so p(target) never nears 1, and a
program that drops the gradient of the tokens a model already predicts well
(half the tokens of a trained LM) passed; with the edge rows' and the scaled
draw's magnitudes, predicted rows span confident and uncertain (at one row in
four, one small-set edge draw in thirty held no p(target) in (1/2, 0.999)).

**Magnitudes** (:func:`scaled_inputs`): two more draws per set scale every
activation, residual, saved input and upstream gradient by 2**u and 2**-u, |u|
drawn between 4 and 12 once per check, so that every set sees both (the whole
tensor, where edge rows scale a few rows: a tensor's tolerance follows its
largest values, so a program that flushes values below 0.01 to zero, or zeroes
those above 1024, hides under the rows of unit scale); it negates about half the
rows (the same rows in every tensor with the same leading size), and moves an
input drawn around a centre (``mean``, or 1 for ``ones_plus_noise``) to a centre
16 to 64 times as far (drawn with a positive mean of about twice its spread, a
LayerNorm input lets through a program that takes the mean's absolute value, and
one whose centring cancels badly at larger means; at 4 to 8 times, such a
program's error hides in the rounding noise of a large LayerNorm bias in about
half the draws, and at 64 an honest fold's fp32 cancellation over 4096 columns
costs a quarter of the bf16 bar, the most the range can ask of the GPU). It
spreads every norm weight, scale, table and bias (``role: norm_weight``,
``table``, a vector ``weight``, or drawn ``ones_plus_noise``) over a trained
model's values: each element times 2**v, v uniform in [-6, 3], one in eight
negated and one in sixteen zero (drawn near 1, they let through a weight floored
at 0.25, an fp8 dequantization scale floored at 0.5, a weight gradient divided
by the weight, and a rotation that drops the pairs whose frequency is 0, as a
LLaMA table's v columns are). A weight matrix is scaled whole by 2**w, w uniform
in [-6, 2] (drawn at 1/sqrt(fan-in), a program that prunes weights below 2**-10
loses next to nothing; a residual projection initialised at 0.02/sqrt(2L), a
LoRA B matrix or an early step's weights lose most). An fp8 input there fills
its format's range (|q| up to 448 for e4m3), as the row-wise recipe quantizes it
(drawn near 1, it never overflows an accumulator stored in fp16).

**Params** (:func:`drawn_params`): the first fresh draw of every set calls
the reference and the program with the task's params as written; the later
draws with every float param the task does not fix (``fixed_params``) scaled
by 2**u, |u| drawn between 1/4 and 4 once per check (halved until the
reference takes the values: a label smoothing of 1.6 is none).  A program
that writes a param's value into its code (an eps baked into a kernel,
Granite's residual multiplier typed in as 0.22) instead of taking it from the
call is right on the written value only, and one that is right on a band
around it (an eps clamped to within 2x of the task's) is right on a band only;
the later draws show both, and the draw is the judge's, so no program can list
it.  Ints, bools and strings are counts, switches and names and stay as
written.

Which shape sets a check runs is :mod:`.shape_sets`'s to say.
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Callable

import torch

from coda_agent.tasks.inits import draw
from coda_agent.tasks.params import PARAM_SPREAD
from coda_agent.tasks.recorder import recorded
from coda_agent.tasks.spec import FLOAT_DTYPES, TaskSpec, TensorSpec, eval_expr
from coda_agent.verifier.wire import TORCH_DTYPES, nbytes

EDGE_ROLES = ("activation", "residual", "saved", "grad")
TINY, LARGE = 2.0 ** -12, 2.0 ** 5
MAGNITUDE = (4.0, 12.0)  # the scaled draw multiplies activations by 2**u, |u| uniform in this range
FARTHER = (4.0, 6.0)  # and moves a drawn centre 2**f times as far (16 to 64), f uniform in this range
WEIGHT_SPREAD = (-6.0, 3.0)  # and norm weights and scales elementwise by 2**v, v uniform in this range
MATRIX_SCALE = (-6.0, 2.0)  # and each weight matrix by 2**w, w uniform in this range


def _draw(spec: TaskSpec, t: TensorSpec, shape_set: str, gen: torch.Generator,
          device: str) -> torch.Tensor:
    env = {k: float(v) for k, v in spec.shapes[shape_set].items()}
    return draw(t.init, spec.shape_of(t, shape_set), TORCH_DTYPES[t.dtype], env, gen, device)


def make_inputs(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One tensor per spec input, drawn with ``seed`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: _draw(spec, t, shape_set, gen, device) for name, t in spec.inputs.items()}


def drawn_params(spec: TaskSpec, rng: random.Random,
                 takes: Callable[[dict[str, float]], bool] = lambda params: True) -> dict[str, float]:
    """The varied params of a check's later draws (module docstring): each of
    ``spec.varied_params`` scaled by 2**u, u drawn with ``rng`` (the judge's) with |u| in
    :data:`PARAM_SPREAD`, every u halved while ``takes`` (whether the reference runs with
    them) says no, down to the smallest spread; then the values as written."""
    exps = {name: rng.uniform(*PARAM_SPREAD) * rng.choice((-1.0, 1.0)) for name in spec.varied_params}
    while exps:
        params = {name: spec.params[name] * 2.0 ** u for name, u in exps.items()}
        if takes(params):
            return params
        if max(abs(u) for u in exps.values()) <= PARAM_SPREAD[0]:
            return {}
        exps = {name: u / 2 for name, u in exps.items()}
    return {}


def reference_takes(task, spec: TaskSpec, params: dict[str, float]) -> bool:
    """Whether the task's reference runs with ``params`` in place of the written ones, on a draw of
    the CPU set (forward and backward)."""
    shape_set = spec.cpu_shape_set
    grads = make_grads(spec, shape_set, 0) if spec.has_backward else None
    try:
        run_reference(task, make_inputs(spec, shape_set, 0), grads, torch.float64,
                      params={**spec.params_at(shape_set), **params})
    except Exception:  # noqa: BLE001 - the reference refusing the values is its domain's edge
        return False
    return True


def make_grads(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random upstream gradients ``d<output>`` of ``spec.grad_outputs`` (normal, std 1, in the
    output's dtype)."""
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x5EED)
    out = {}
    for o in spec.grad_outputs:
        t = spec.outputs[o]
        out[f"d{o}"] = torch.randn(spec.shape_of(t, shape_set), generator=gen, device=device).to(
            TORCH_DTYPES[t.dtype])
    return out


def _row_scales(rows: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Each row's scale: about one in eight :data:`TINY`, one in eight :data:`LARGE`, one in eight
    2**u with u uniform in [log2 TINY, log2 LARGE], one in sixteen 0, the rest 1."""
    pick = torch.randint(0, 16, (rows,), generator=gen, device=device) // 2  # 0..7, and 8 for none
    zero = torch.randint(0, 16, (rows,), generator=gen, device=device) == 0
    lo, hi = math.log2(TINY), math.log2(LARGE)
    spread = torch.exp2(lo + (hi - lo) * torch.rand(rows, generator=gen, device=device))
    scale = torch.where(pick == 0, TINY, torch.where(pick == 1, LARGE, torch.where(pick == 2, spread, 1.0)))
    return torch.where(zero, 0.0, scale)


def edge_inputs(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """:func:`make_inputs` with rows of tiny and large norm (module docstring)."""
    inputs = make_inputs(spec, shape_set, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed ^ 0xED6E)
    scales: dict[int, torch.Tensor] = {}
    for name, t in spec.inputs.items():
        x = inputs[name]
        if t.role not in EDGE_ROLES or t.dtype not in FLOAT_DTYPES or x.ndim == 0 or x.shape[0] == 0:
            continue
        scale = scales.setdefault(x.shape[0], _row_scales(x.shape[0], gen, device))
        if x.ndim == 1:  # a per-row statistic or scale (an fp8 row's dequantization scale) is never 0
            scale = torch.where(scale == 0, 1.0, scale)
        inputs[name] = (x.float() * scale.reshape(-1, *([1] * (x.ndim - 1)))).to(x.dtype)
    return inputs


def drawn_magnitude(rng: random.Random) -> float:
    """The exponent u of a check's scaled draw (module docstring), drawn with ``rng`` (the judge's)."""
    return rng.uniform(*MAGNITUDE) * rng.choice((-1.0, 1.0))


def scaled_inputs(spec: TaskSpec, shape_set: str, seed: int, device: str, u: float) -> dict[str, torch.Tensor]:
    """:func:`make_inputs` at other magnitudes (module docstring): activations, residuals and saved
    inputs farther from their centre, times 2**u, half their rows negated; norm weights, scales,
    tables and biases spread elementwise; weight matrices at another scale; fp8 inputs over their
    format's range."""
    inputs = make_inputs(spec, shape_set, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x5CA1)
    signs: dict[int, torch.Tensor] = {}  # per leading size: the rows negated
    farther = float(torch.exp2(FARTHER[0] + (FARTHER[1] - FARTHER[0]) * torch.rand(1, generator=gen, device=device)))
    env = {k: float(v) for k, v in spec.shapes[shape_set].items()}
    for name, t in spec.inputs.items():
        x = inputs[name]
        if x.numel() == 0:
            continue
        if t.dtype.startswith("fp8") and t.init.dist == "normal":  # the format's range, as quantized
            top = torch.finfo(x.dtype).max
            full = torch.randn(x.shape, generator=gen, device=device) * (top / 4)
            inputs[name] = full.clamp(-top, top).to(x.dtype)
        elif t.dtype not in FLOAT_DTYPES:
            continue
        elif t.role in EDGE_ROLES:
            centre = 1.0 if t.init.dist == "ones_plus_noise" else float(eval_expr(t.init.mean, env))
            xf = x.float() + centre * (farther - 1.0)  # the centre moved, the spread kept
            sign = signs.setdefault(x.shape[0], torch.where(
                torch.rand(x.shape[0], generator=gen, device=device) < 0.5, -1.0, 1.0))
            inputs[name] = (xf * 2.0 ** u * sign.reshape(-1, *([1] * (x.ndim - 1)))).to(x.dtype)
        elif t.role in ("norm_weight", "table") or t.init.dist == "ones_plus_noise" or (
                t.role == "weight" and x.ndim == 1):
            v = torch.rand(x.shape, generator=gen, device=device) * (WEIGHT_SPREAD[1] - WEIGHT_SPREAD[0])
            r = torch.rand(x.shape, generator=gen, device=device)  # one in eight negated, one in sixteen 0
            sign = torch.where(r < 0.125, -1.0, torch.where(r < 0.1875, 0.0, 1.0))
            inputs[name] = (x.float() * torch.exp2(v + WEIGHT_SPREAD[0]) * sign).to(x.dtype)
        elif t.role == "weight":  # a matrix: the whole of it at another scale
            inputs[name] = (x.float() * float(torch.exp2(MATRIX_SCALE[0] + (MATRIX_SCALE[1] - MATRIX_SCALE[0])
                                                         * torch.rand(1, generator=gen, device=device)))).to(x.dtype)
    return inputs


def predicted_targets(task, inputs: dict[str, torch.Tensor], params: dict[str, Any], seed: int
                      ) -> dict[str, torch.Tensor]:
    """``inputs`` with about one row in two of each target (a 1-D ``role: index`` input the
    reference picks a column of each row's scores with: a cross-entropy's target) set to the class
    the reference's own scores rank first on these inputs (module docstring); an ignored row stays
    ignored."""
    spec = task.spec
    names = [k for k, t in spec.inputs.items() if t.role == "index" and inputs[k].dim() == 1
             and not inputs[k].is_floating_point()]
    if not names:
        return inputs
    try:
        scores = recorded(task.reference_fn, inputs, params).scores
    except Exception:  # noqa: BLE001 - the reference refusing these inputs is the stage's to report
        return inputs
    out = dict(inputs)
    gen = torch.Generator(device=next(iter(inputs.values())).device.type).manual_seed(seed ^ 0x7A46)
    for name in names:
        s, t = scores.get(name), inputs[name]
        if s is None or s.shape[0] != t.shape[0]:
            continue
        pick = (torch.randint(0, 2, t.shape, generator=gen, device=t.device) == 0) & (t >= 0) & (t < s.shape[1])
        out[name] = torch.where(pick, s.argmax(1).to(t.device, t.dtype), t)
    return out


def aligned_grads(grads: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], seed: int
                  ) -> dict[str, torch.Tensor]:
    """``grads`` with about one row in eight of each ``d<o>`` parallel to the forward output ``o``
    (rescaled to the gradient row's own norm) and one in sixteen exactly zero."""
    out = {}
    for name, g in grads.items():
        y = outputs[name[1:]].to(g.device, torch.float32)
        if g.ndim < 2 or g.shape != y.shape:
            out[name] = g
            continue
        gen = torch.Generator(device=g.device.type).manual_seed(seed ^ 0xA11E)
        rows = torch.randint(0, 8, (g.shape[0],), generator=gen, device=g.device) == 0
        gf = g.float().reshape(g.shape[0], -1)
        yf = y.reshape(g.shape[0], -1)
        scale = gf.norm(dim=1, keepdim=True) / yf.norm(dim=1, keepdim=True).clamp_min(1e-30)
        masked = torch.randint(0, 16, (g.shape[0],), generator=gen, device=g.device) == 0
        gf = torch.where(masked[:, None], 0.0, gf)
        out[name] = torch.where(rows[:, None], yf * scale, gf).reshape(g.shape).to(g.dtype)
    return out


def upcast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, device: str | None = None
           ) -> dict[str, torch.Tensor]:
    """Float tensors to ``dtype`` (None keeps it), everything to ``device``."""
    out = {}
    for k, v in tensors.items():
        v = v.to(device) if device else v
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        out[k] = out[k].detach().clone()
    return out


class Widened(torch.overrides.TorchFunctionMode):
    """The judge's high-precision reference keeps its precision through the reference's own
    casts to fp32: ``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)`` and a
    ``dtype=torch.float32`` argument (a factory's, a sum's, a softmax's) give ``dtype``
    instead, and a tensor made without a dtype is made in it.  References ported from
    Hugging Face upcast so (``h = x.float()``), and without this the fp64 reference would
    round there exactly as the bf16 one does: a result computed wholly after the cast (an fp32
    row statistic, a loss) would show no rounding noise of its own, its tolerance would
    collapse to the floor, and an honest program summing in another order would fail by an
    ulp.  A cast to 16 or 8 bits is the reference's own rounding and stays."""

    NAMED = {"float", "to", "type"}  # Tensor methods whose positional dtype is a cast

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = self.dtype
        if name == "float" and args and isinstance(args[0], torch.Tensor):
            return args[0].to(self.dtype)
        if name in self.NAMED or name in ("softmax", "log_softmax"):
            args = tuple(self.dtype if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)

    def __enter__(self) -> "Widened":
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        return super().__enter__()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        torch.set_default_dtype(self._default)
        super().__exit__(*exc)


def run_reference(task, inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None,
                  dtype: torch.dtype | None, device: str | None = None,
                  params: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The task's PyTorch reference, forward (+ backward when ``grads``), with the
    float inputs cast to ``dtype`` (None: the inputs' own dtype) and ``params`` (None: the
    task's as written, for a task without shape expressions among them).  Returns outputs and
    ``d<input>`` gradients in one dict."""
    spec = task.spec
    params = spec.params if params is None else params
    x = upcast(inputs, dtype, device)
    g = upcast(grads, dtype, device) if grads else {}
    if grads and task.backward_reference_fn is None:
        for name in spec.gradients:
            x[name].requires_grad_(True)
    # fp32 is as wide as the GPU's reference goes: widening there would double a large set's memory
    widened = Widened(dtype) if dtype is not None and dtype.itemsize > 4 else contextlib.nullcontext()
    with torch.enable_grad() if grads else torch.no_grad(), widened:
        outs = dict(task.reference_fn(**x, **params))
        missing = set(spec.outputs) - set(outs)
        if missing:
            raise RuntimeError(f"the task reference returned no {sorted(missing)}")
        result = {k: outs[k].detach() for k in spec.outputs}
        if grads:
            if task.backward_reference_fn is not None:
                back = task.backward_reference_fn(**x, **params, **g)
                result.update({f"d{n}": back[f"d{n}"].detach() for n in spec.gradients})
            else:
                names = spec.grad_outputs
                got = torch.autograd.grad([outs[o] for o in names], [x[n] for n in spec.gradients],
                                          [g[f"d{o}"].to(outs[o].dtype) for o in names],
                                          allow_unused=True)
                for n, d in zip(spec.gradients, got):
                    result[f"d{n}"] = d.detach() if d is not None else torch.zeros_like(x[n])
    return result


# --------------------------------------------------------------------------- shape sets

def result_dtypes(spec: TaskSpec) -> dict[str, list[str]]:
    """The dtypes each result may have: an output its declared one; a gradient ``d<input>`` the
    input's own or fp32 (the dtype gradients accumulate in, as a row reduction's does)."""
    return {**{o: [t.dtype] for o, t in spec.outputs.items()},
            **{f"d{g}": sorted({spec.inputs[g].dtype, "fp32"}) for g in spec.gradients}}


def result_shapes(spec: TaskSpec, shape_set: str) -> dict[str, list[int]]:
    return {**{o: list(spec.shape_of(t, shape_set)) for o, t in spec.outputs.items()},
            **{f"d{g}": list(spec.shape_of(spec.inputs[g], shape_set)) for g in spec.gradients}}


def result_bytes(spec: TaskSpec, shape_set: str) -> int:
    """Bytes of one call's results, each at the widest dtype it may have."""
    shapes = result_shapes(spec, shape_set)
    return sum(max(nbytes(d, shapes[k]) for d in dtypes) for k, dtypes in result_dtypes(spec).items())
