"""Family 1: the math vocabulary of epilogue fns, one definition per function
for both lowerings.

An epilogue fn is traced twice with different value types: by quack/CuTeDSL
with ``cutlass.Float32`` scalars (one accumulator element at a time) and by the
reference interpreter with fp32 ``torch.Tensor`` tiles.  Each :class:`MathFn`
dispatches on its arguments: tensors go to PyTorch, DSL values to
``cute.math``, Python numbers to :mod:`math`, and a ``Pair`` lane-wise.

Why a class and not plain functions: quack fingerprints every global an
epilogue fn references (fail-closed compile-cache identity), and functions that
close over unsupported objects fail that check on the pinned stack (this is why
``quack.activation`` cannot be used).  A :class:`MathFn` declares its identity
explicitly (``__quack_semantic_key__``: name + catalogue version), so editing
the catalogue's math changes every kernel's cache key.

Precision choices (both lowerings agree to fp32 rounding, not bitwise):
``exp``/``exp2``/``log``/``rsqrt``/``sqrt``/``reciprocal`` (and
``sigmoid``/``silu`` built on them) use the fast hardware approximations on the
GPU (relative error ~1e-7..1e-6, far below bf16; ``exp``'s grows with |x|, since
x * log2(e) rounds to fp32 before the hardware's 2**t: |x| * 2**-24, 3.4e-6 at x = 66),
never the IEEE-exact sequences with a per-element slow-path call;
``tanh`` (and ``tanh_grad``) is libdevice's ``tanhf`` (about 2 ulp: a
polynomial near 0, ``1 - 2 / (exp(2x) + 1)`` on the fast exp and reciprocal
elsewhere, no slow path), because the hardware's ``tanh.approx`` (MUFU.TANH)
errs by up to 2**-11 relative: at a logit soft cap of 30 that is 0.015 in a
logit, and where tanh saturates ``1 - t*t`` comes out near 1e-3 where it is
1e-6 (the soft-capped head's gradient was wrong on the H100 by it);
``tanh_fast`` is MUFU.TANH itself, for an activation whose result is stored in
16 bits (GELU's tanh form: ``gelu_tanh``, ``gelu_tanh_grad`` and a program's
own GELU derivative), where its error is below that rounding and libdevice's
sequence costs: a GPT-2 MLP's dGELU GEMM took 5.9 ms with it against 3.1 ms
(H100, run 31);
``erf`` (and the exact ``gelu`` built on it) is libdevice's ``erff`` (about
2 ulp, branch-free: two polynomials and a select, no slow path), because the
DSL's fast ``erf`` is Abramowitz-Stegun 7.1.26, whose absolute error of ~1e-7
is a large relative error for small arguments;
``round_bf16``/``round_fp16`` round to the 16-bit grid a store rounds to
(round-to-nearest-even) and return fp32, so a statistic can be folded from
exactly the values a 16-bit output keeps;
``sin``/``cos`` reduce the angle by 2*pi first (RoPE angles reach 1e5 rad)
and then use the fast versions, avoiding the precise versions' local-memory
slow path.  The fast functions run on the MUFU unit, which flushes subnormal
inputs and results to zero (``.ftz``), and ``maximum``/``minimum`` return the
number of a NaN and a number (IEEE maxNum, FMNMX): the reference lowering does
both too, so that an epilogue computes on the CPU what it computes on the GPU
at those edges (sin and cos flush only subnormal inputs alike).  The
approximations themselves differ from torch's functions in the last bits, so
no CPU check proves a kernel equal to its reference lowering: the GPU stages
judge the compiled kernel, and ``cpu_passed`` is no acceptance.

The activations' derivatives (``sigmoid_grad``, ``silu_grad``, ``tanh_grad``,
``gelu_tanh_grad``, ``gelu_grad``) and ``expm1`` are composites (:func:`_composite`): one
Python function of the vocabulary above, run by both lowerings as it is, so
each is exactly as precise as its parts and has no lowering of its own.
tests/test_primitives_grads.py holds the derivatives to ``torch.autograd``, and
tests/test_primitives_expm1.py ``expm1`` to ``torch.expm1``.
"""

from __future__ import annotations

import math as _m
from typing import Any, Callable

import torch

from .errors import CatalogueError
from .pair import Pair
from .version import CATALOGUE_VERSION

_GELU_C = _m.sqrt(2.0 / _m.pi)
_GELU_CUBIC = 0.044715  # the tanh approximation's cubic coefficient
_SQRT_HALF = _m.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / _m.sqrt(2.0 * _m.pi)  # the standard normal density at 0


def _is_tensor(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) for a in args)


def _is_number(args: tuple) -> bool:
    return all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)


class MathFn:
    """A catalogue math function usable inside epilogue fns (both lowerings)."""

    def __init__(self, name: str, arity: int, torch_impl: Callable, cute_impl: Callable,
                 doc: str, example: str):
        self.name = name
        self.arity = arity
        self._torch = torch_impl
        self._cute = cute_impl
        self.__doc__ = doc
        self.example = example

    def __call__(self, *args: Any) -> Any:
        if len(args) != self.arity:
            raise CatalogueError(f"{self.name}() takes {self.arity} argument(s), got {len(args)}")
        pairs = [a for a in args if isinstance(a, Pair)]
        if pairs:
            lanes = [(a.a, a.b) if isinstance(a, Pair) else (a, a) for a in args]
            return Pair(self(*(lane[0] for lane in lanes)), self(*(lane[1] for lane in lanes)))
        if _is_tensor(args):
            return self._torch(*args)
        if _is_number(args):
            # The call's own scalars (a param on the host, or in the reference lowering): the
            # catalogue's arithmetic on numbers, out of sight of the verifier's audit of the
            # program's tensor compute, which would see a Python number read from a tensor.
            with torch._C.DisableTorchFunction():
                return float(self._torch(*(torch.tensor(float(a), dtype=torch.float64) for a in args)))
        return self._cute(*args)

    def __quack_semantic_key__(self) -> tuple:
        return ("coda_agent.primitives.math", self.name, CATALOGUE_VERSION)

    def __repr__(self) -> str:
        return f"<catalogue math {self.name}>"


# cutlass is imported when a cute trace first calls in: importing the catalogue
# must not load it (the DSL takes seconds to import).
def _cm():
    import cutlass.cute as cute

    return cute


def _f32(x: Any) -> Any:
    from cutlass import Float32

    return Float32(x)


def _rcp_cute(x: Any) -> Any:
    # MUFU.RCP (rcp.approx.ftz, ~1 ulp).  A plain `1.0 / x` lowers to the IEEE
    # division: a Newton step plus a slow-path CALL wrapped in BSSY/BSYNC per
    # element, which serialises the epilogue's instruction stream.
    return _cm().arch.rcp_approx(_f32(x))


def _sigmoid_cute(x: Any) -> Any:
    return _rcp_cute(1.0 + _cm().math.exp(-x, fastmath=True))


def _where_cute(c: Any, a: Any, b: Any) -> Any:
    import cutlass

    return _f32(cutlass.select_(c, _f32(a), _f32(b)))


def _where_torch(c: Any, a: Any, b: Any) -> torch.Tensor:
    if not isinstance(c, torch.Tensor):
        c = torch.tensor(bool(c))
    return torch.where(c, torch.as_tensor(a, dtype=torch.float32) if not isinstance(a, torch.Tensor) else a,
                       torch.as_tensor(b, dtype=torch.float32) if not isinstance(b, torch.Tensor) else b)


def _as_t(x: Any, like: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.full((), float(x), dtype=like.dtype)


def _binary_torch(fn: Callable) -> Callable:
    def impl(a: Any, b: Any) -> torch.Tensor:
        ref = a if isinstance(a, torch.Tensor) else b
        return fn(_as_t(a, ref), _as_t(b, ref))
    return impl


def _gelu_torch(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + _GELU_CUBIC * x * x * x)))


def _gelu_cute(x: Any) -> Any:
    return 0.5 * x * (1.0 + _cm().math.tanh(_GELU_C * (x + _GELU_CUBIC * x * x * x), fastmath=True))


def _tanh_cute(x: Any) -> Any:
    # Not fastmath: tanh.approx errs by 2**-11 relative (see the module doc).
    return _cm().math.tanh(_f32(x))


def _erf_cute(x: Any) -> Any:
    # Not fastmath: the fast erf is Abramowitz-Stegun 7.1.26 (see the module doc).
    return _cm().math.erf(_f32(x))


def _round_torch(dtype: torch.dtype) -> Callable:
    return lambda x: x.to(dtype).to(x.dtype)


def _round_cute(dtype_name: str) -> Callable:
    def impl(x: Any) -> Any:
        import cutlass

        return _f32(getattr(cutlass, dtype_name)(_f32(x)))
    return impl


_FLT_MIN = 2.0 ** -126  # the least normal fp32


def _ftz(t: Any) -> Any:
    """A subnormal fp32 value as the GPU's MUFU unit takes and gives it: a zero of its sign."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
        return torch.where(t.abs() < _FLT_MIN, t * 0.0, t)
    return t


def _mufu(fn: Callable) -> Callable:
    """``fn`` as it runs on the MUFU unit (``ex2``, ``lg2``, ``rsqrt``, ``sqrt``, ``rcp``, ``sin``,
    ``cos`` .approx.ftz): subnormal inputs and results flushed.  The reference lowering flushes
    too, so that the two lowerings agree where a program could tell them apart
    (``reciprocal(1e38) > 0`` holds in IEEE arithmetic and not on the GPU)."""
    return lambda x: _ftz(fn(_ftz(x)))


def _fast(name: str, doc: str, example: str) -> MathFn:
    """A one-argument function that torch and ``cutlass.cute.math`` both name ``name``, in
    the hardware's fast form on the GPU (its MUFU instruction)."""
    return MathFn(name, 1, _mufu(getattr(torch, name)), lambda x: getattr(_cm().math, name)(x, fastmath=True),
                  doc, example)


exp = _fast("exp", "e**x.", "exp(acc - m)")
exp2 = _fast("exp2", "2**x.", "exp2(acc * 1.4426950408889634)")
log = _fast("log", "Natural logarithm.", "log(acc * acc + 1.0)")
rsqrt = _fast("rsqrt", "1 / sqrt(x).", "acc * rsqrt(var + eps)")
sqrt = _fast("sqrt", "Square root.", "sqrt(acc * acc + 1.0)")
tanh = MathFn("tanh", 1, torch.tanh, _tanh_cute, "Hyperbolic tangent (about 2 ulp on the GPU): soft caps, "
              "and wherever 1 - tanh**2 of a saturating value matters.", "cap * tanh(acc / cap)")
tanh_fast = MathFn("tanh_fast", 1, torch.tanh, lambda x: _cm().math.tanh(x, fastmath=True),
                   "Hyperbolic tangent, the hardware's approximation (2**-11 relative on the GPU, one "
                   "instruction): for an activation stored in 16 bits, as GELU's tanh form.",
                   "tanh_fast(0.7978845608 * (x + 0.044715 * x * x * x))")


def _reduce_angle(x: Any) -> Any:
    # RoPE angles reach ~1e5 rad. The precise sin/cos carry a slow-path
    # (Payne-Hanek) reduction with a local-memory table (hundreds of STL/LDL in
    # SASS); the fast MUFU sin/cos are accurate (~1e-6 abs) only near [-pi, pi].
    # So: Cody-Waite reduction by 2*pi in two fp32 terms, then MUFU.
    k = _cm().math.roundeven(x * _INV_2PI)
    return (x - k * _TWO_PI_HI) - k * _TWO_PI_LO


_INV_2PI = 1.0 / (2.0 * _m.pi)
_TWO_PI_HI = 6.28125  # exactly representable with few bits, so k * HI is exact
_TWO_PI_LO = 2.0 * _m.pi - 6.28125

sin = MathFn("sin", 1, _mufu(torch.sin), lambda x: _cm().math.sin(_reduce_angle(x), fastmath=True),
             "Sine; accurate for large angles (reduced by 2*pi first).", "sin(pos * freq)")
cos = MathFn("cos", 1, _mufu(torch.cos), lambda x: _cm().math.cos(_reduce_angle(x), fastmath=True),
             "Cosine; accurate for large angles (reduced by 2*pi first).", "cos(pos * freq)")
reciprocal = MathFn("reciprocal", 1, _mufu(torch.reciprocal), _rcp_cute,
                    "1 / x with the hardware reciprocal (~1 ulp); write it instead of `1.0 / x`, "
                    "whose IEEE division calls a slow path per element.", "acc * reciprocal(norm)")
sigmoid = MathFn("sigmoid", 1, lambda x: _ftz(torch.sigmoid(x)), _sigmoid_cute,
                 "1 / (1 + exp(-x)).", "sigmoid(acc)")
silu = MathFn("silu", 1, lambda x: x * _ftz(torch.sigmoid(x)), lambda x: x * _sigmoid_cute(x),
              "x * sigmoid(x) (SwiGLU's gate).", "silu(g) * u")
gelu_tanh = MathFn("gelu_tanh", 1, _gelu_torch, _gelu_cute,
                   "GELU, tanh approximation.", "gelu_tanh(acc + bias)")
erf = MathFn("erf", 1, torch.erf, _erf_cute,
             "The error function, 2/sqrt(pi) * integral of exp(-t**2) from 0 to x (about 2 ulp).",
             "0.5 * (1.0 + erf(x * 0.7071067811865476))")
gelu = MathFn("gelu", 1, lambda x: 0.5 * x * (1.0 + torch.erf(x * _SQRT_HALF)),
              lambda x: 0.5 * x * (1.0 + _erf_cute(x * _SQRT_HALF)),
              "Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))) (nn.GELU()'s default; BERT, GPT-2 variants).",
              "gelu(acc + bias)")
round_bf16 = MathFn("round_bf16", 1, _round_torch(torch.bfloat16), _round_cute("BFloat16"),
                    "x rounded to the nearest bf16 value, kept in fp32: what a bf16 store keeps.",
                    "round_bf16(acc * gamma)")
round_fp16 = MathFn("round_fp16", 1, _round_torch(torch.float16), _round_cute("Float16"),
                    "x rounded to the nearest fp16 value, kept in fp32: what an fp16 store keeps.",
                    "round_fp16(acc * gamma)")
maximum = MathFn("maximum", 2, _binary_torch(torch.fmax),
                 lambda a, b: _cm().arch.fmax(_f32(a), _f32(b)),
                 "Elementwise max of two values (of a NaN and a number, the number, as the GPU's FMNMX).",
                 "maximum(acc, 0.0)")
minimum = MathFn("minimum", 2, _binary_torch(torch.fmin),
                 lambda a, b: _cm().arch.fmin(_f32(a), _f32(b)),
                 "Elementwise min of two values (of a NaN and a number, the number).", "minimum(acc, 6.0)")
where = MathFn("where", 3, _where_torch, _where_cute,
               "cond ? a : b, elementwise; the only branch an epilogue may take.",
               "where(acc > 0.0, acc, 0.01 * acc)")
fma = MathFn("fma", 3, lambda a, b, c: a * b + c, lambda a, b, c: _f32(a) * b + c,
             "a * b + c.", "fma(acc, scale, bias)")


def _composite(name: str, fn: Callable, doc: str, example: str) -> MathFn:
    """A function written once in the vocabulary above: both lowerings run ``fn`` itself, and
    each call in it dispatches on its arguments as usual, so it lowers to what its parts lower
    to (on the GPU, the parts the GPU tier already holds to the reference) and needs no lowering
    of its own."""
    return MathFn(name, 1, fn, fn, doc, example)


# The activations' derivatives, for backward epilogues (dx = dy * f_grad(x)).  Each is written
# here once because a derivative derived by hand in every program is where wrong backward
# passes come from.  Each form stays finite at large |x|: a factor that vanishes there (1 - s,
# 1 - t, exp(-x*x/2)) multiplies only finite terms (up to |x| ~ 1e19, where gelu_tanh_grad's
# x*x overflows fp32, as in PyTorch's own backward).  1 - t*t is written (1 - t) * (1 + t):
# 1 - t is exact for t near 1, so the product carries only t's own rounding, not t*t's too.

def _sigmoid_grad(x: Any) -> Any:
    s = sigmoid(x)
    return s * (1.0 - s)


def _silu_grad(x: Any) -> Any:
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _tanh_grad(x: Any) -> Any:
    t = tanh(x)
    return (1.0 - t) * (1.0 + t)


def _gelu_tanh_grad(x: Any) -> Any:
    t = tanh_fast(_GELU_C * (x + _GELU_CUBIC * x * x * x))
    du = _GELU_C * (1.0 + 3.0 * _GELU_CUBIC * x * x)  # d/dx of tanh's argument
    return 0.5 * (1.0 + t) + 0.5 * x * ((1.0 - t) * (1.0 + t)) * du


def _gelu_grad(x: Any) -> Any:
    return 0.5 * (1.0 + erf(x * _SQRT_HALF)) + x * exp(-0.5 * x * x) * _INV_SQRT_2PI


# 1/k! for k = 2..9: the Taylor series of e**x - 1 to x**9, whose next term is under 1e-9 of the
# sum for |x| < 1/2
_EXPM1_TERMS = tuple(1.0 / _m.factorial(k) for k in range(2, 10))


def _expm1(x: Any) -> Any:
    # exp(x) - 1 near 0 keeps exp's error (about 1e-7 of e**x) as an absolute error of a small
    # result: 1e-3 of it at x = 1e-4, and at a subnormal-flushed tiny x all of it.  Below |x| = 1/2
    # the series in Horner's form (each step one fma), past it the subtraction loses under 2 bits.
    p = _EXPM1_TERMS[-1]
    for c in reversed(_EXPM1_TERMS[:-1]):
        p = p * x + c
    series = x + x * x * p
    return where(maximum(x, -x) < 0.5, series, exp(x) - 1.0)


sigmoid_grad = _composite("sigmoid_grad", _sigmoid_grad,
                          "d/dx sigmoid(x) = s * (1 - s), s = sigmoid(x).", "dy * sigmoid_grad(pre)")
silu_grad = _composite("silu_grad", _silu_grad,
                       "d/dx silu(x) = s * (1 + x * (1 - s)), s = sigmoid(x) (dSwiGLU's gate: "
                       "dg = dy * u * silu_grad(g)).", "dy * u * silu_grad(g)")
tanh_grad = _composite("tanh_grad", _tanh_grad,
                       "d/dx tanh(x) = 1 - tanh(x)**2.", "dy * tanh_grad(pre)")
gelu_tanh_grad = _composite("gelu_tanh_grad", _gelu_tanh_grad,
                            "d/dx gelu_tanh(x) = 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 "
                            "* x**2), t = tanh(c * (x + 0.044715 * x**3)), c = sqrt(2 / pi) "
                            "(the backward of F.gelu(approximate='tanh')).", "dy * gelu_tanh_grad(pre)")
expm1 = _composite("expm1", _expm1,
                   "e**x - 1, precise near 0 where exp(x) - 1.0 is not (ELU, SELU and CELU's negative side, "
                   "xIELU's): a Taylor series below |x| = 0.5, exp(x) - 1 past it.", "where(acc > 0.0, acc, "
                   "alpha * expm1(acc))")
gelu_grad = _composite("gelu_grad", _gelu_grad,
                       "d/dx gelu(x) = Phi(x) + x * phi(x): 0.5 * (1 + erf(x / sqrt(2))) + x * exp(-x**2 / 2) "
                       "/ sqrt(2 * pi) (the backward of exact F.gelu; GeGLU's gate).", "dy * gelu_grad(pre)")

VOCABULARY: tuple[MathFn, ...] = (exp, exp2, log, rsqrt, sqrt, reciprocal, tanh, sin, cos, sigmoid, silu,
                                  gelu_tanh, erf, gelu, expm1, sigmoid_grad, silu_grad, tanh_grad, gelu_tanh_grad,
                                  gelu_grad, round_bf16, round_fp16, maximum, minimum, where, fma)
