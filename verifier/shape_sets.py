"""Which shape sets a check runs: the task's named sets that fit the machine, a set beyond them
drawn per check, and two sets of small sizes.

**Shape sets** (:func:`checked_sets`): every named set of the task that fits
(on the GPU, by the device's *total* memory, so a program cannot starve the
checks by holding memory; on the CPU, by :data:`CPU_SET_BYTES`, plus any the
task names in ``cpu_shape_sets``), and one set beyond them
(:func:`beyond_set`): the ragged set with every size of at least 128 grown by
256, so that some dimension has columns past the last multiple of 256 and
past the largest tile (a program wrong only there passed every named set),
and then by a secret amount (:func:`drawn_growth`): less than 256 more, in steps
of the size's own alignment (its largest power-of-two factor, at most 16, so
a ragged set valid for TMA and fp8 stays valid), never a multiple of 128.
The named sets are in the task file, so a fixed beyond set is one more size a
program can list (``if M in (64, 200, 456)``) to be right exactly where it is
checked; drawn by the judge per check, the beyond set is a size the program
cannot know, and its messages give its sizes.  What this does not guarantee:
a program right on a whole range of sizes (every named size and every size
the draw can reach) and wrong outside it passes; no finite set of checks
rules that out, and only the GPU's named sets reach the sizes models train at.
Sizes a shape multiplies by another symbol (the head width ``D`` of
``NQ*D``) keep their value: they are the layout of a dimension, not its
extent, and a head 384 wide is a model nobody trains (the head statistics
need whole heads in one tile, which quack's tiles cap at 256 columns).

Two more sets are drawn: the CPU set with every size that no
tensor needs aligned (:func:`free_symbols`: a token count, which is only ever
a tensor's leading dimension) an odd number below its own (:func:`odd_set`),
and those sizes short and aligned (:func:`short_set`: a multiple of 8 below the
CPU set's, a few decode steps' or a short prompt's).  Every other set's
sizes keep their alignment and start at the CPU set's, so without them every
checked token count is a multiple of 8 and at least 256, and a program wrong
at the others (``M % 8`` or ``M < 256`` in its host code: a decode step, a
short prompt) passes.  The GPU's correctness stage checks them too (they
are small: a second or two of its time), so that a program which tells the
device it runs on (``x.is_cuda``, which the static rules refuse by name, or
anything else that differs between the two) is held at those sizes on the GPU
as on the CPU; the performance stage times the sizes a task names.  An fp8
task has no such sizes: its backward
GEMMs take the token count as K in both operands' contiguous dimension (fp8
WGMMA reads K-major only), where TMA needs 16-byte rows.
"""

from __future__ import annotations

import math
import random

from coda_agent.tasks.spec import TaskSpec, expr_symbols, structural_symbols
from coda_agent.verifier.wire import TORCH_DTYPES

CPU_SET_BYTES = 64 << 20  # inputs + outputs a CPU check draws per shape set, at most
# A set fits when 13x its tensors in fp32 fit in the device's total memory: the judge's draws,
# references and cache hold up to 10x (an H100's judge asked for 7 GiB more with 63.1 GiB in use, 51.1
# allocated, for a llama3-70b set of 7.25), the runner's buffers and poisoned block (which holds its
# results) 2 to 3x.
GPU_MEMORY_FACTOR = 13
# The judge's fp32 reference holds its largest GEMM output about this many times over (the logits,
# their softmax and its gradient, autograd's saved copies): run 31's H100 judge held 75.0 GiB for
# lm_head_xent_softcap's gemma2-2b set, 4.8 times its (16384, 256000) logits in fp32, where the
# set's own tensors are 5 GiB.  Where a GEMM's output is wider than the inputs, it sets the need.
REFERENCE_GEMM_OUTPUTS = 5
BEYOND = 256  # the beyond set adds one 256-wide chunk to every size of at least 128
DRAWN = 256  # and then a secret growth below this (drawn_growth)
ALIGN = 16  # the largest alignment step a drawn growth keeps (bytes of TMA rows of fp8 / 2-byte types)


def set_bytes(spec: TaskSpec, shape_set: str, itemsize: int | None = None) -> int:
    """Bytes of one call's tensors (inputs, upstream gradients, results) at their dtypes, or at
    ``itemsize`` bytes per element."""
    tensors = [*spec.inputs.values(), *spec.outputs.values(), *(spec.inputs[g] for g in spec.gradients)]
    tensors += [spec.outputs[o] for o in spec.grad_outputs] if spec.has_backward else []
    return sum(math.prod(spec.shape_of(t, shape_set)) * (itemsize or TORCH_DTYPES[t.dtype].itemsize) for t in tensors)


def judge_bytes(spec: TaskSpec, shape_set: str) -> int:
    """What checking ``shape_set`` on a GPU holds at most (judge and runner): its tensors in fp32
    :data:`GPU_MEMORY_FACTOR` times, or beside them the reference's largest GEMM output
    :data:`REFERENCE_GEMM_OUTPUTS` times, whichever is more."""
    tensors = set_bytes(spec, shape_set, itemsize=4)
    widest = max((m * n for m, n, _ in spec.gemm_shapes(shape_set)), default=0) * 4
    return max(tensors * GPU_MEMORY_FACTOR, tensors + widest * REFERENCE_GEMM_OUTPUTS)


def drawn_growth(size: int, rng: random.Random) -> int:
    """A secret growth of ``size`` (already past :data:`BEYOND`): a positive multiple of the
    size's own alignment step below :data:`DRAWN` (never 0: the fixed beyond set's sizes, which
    a program can compute from the task file, are never the ones checked), such that the grown
    size is no multiple of 128 (a ragged edge in every tile)."""
    step = min(size & -size, ALIGN)
    while True:
        extra = step * rng.randrange(1, DRAWN // step)
        if (size + extra) % 128:
            return extra


def _structural(spec: TaskSpec) -> set[str]:
    """The sizes that are a dimension's layout, not its extent (module docstring)."""
    exprs = [e for t in (*spec.inputs.values(), *spec.outputs.values()) for e in t.shape]
    exprs += [e for g in spec.gemms for e in g]
    return set().union(*(structural_symbols(e) for e in exprs))


def beyond_set(spec: TaskSpec, rng: random.Random | None = None) -> tuple[str, dict[str, int]]:
    """The set past the named ones: the ragged set (else the CPU set) with each size >= 128
    grown by 256, but the structural ones (module docstring), and with ``rng`` (the judge's)
    each grown further by :func:`drawn_growth`."""
    base = "ragged" if "ragged" in spec.shapes else spec.cpu_shape_set
    kept = _structural(spec)
    binding = {k: v + BEYOND if v >= 128 and k not in kept else v for k, v in spec.shapes[base].items()}
    if rng is not None:  # one growth per distinct size: sizes a task binds equal stay equal
        growth = {v: drawn_growth(v, rng) for k, v in sorted(binding.items()) if v != spec.shapes[base][k]}
        binding = {k: v + growth.get(v, 0) if v != spec.shapes[base][k] else v for k, v in binding.items()}
    return f"{base}+{BEYOND}", binding


def free_symbols(spec: TaskSpec) -> set[str]:
    """The sizes no tensor needs aligned: in no tensor's last dimension but a vector's and in no
    GEMM's N, the row length of its output (TMA moves rows whose length is a multiple of 16
    bytes), and only ever a whole dimension (a size in ``R // 2`` is even, one in ``NQ*D`` a
    layout: :func:`_structural`)."""
    if spec.gemm_dtype is not None or any(t.dtype.startswith("fp8") for t in spec.inputs.values()):
        return set()  # an fp8 GEMM's K is contiguous in both operands (module docstring)
    tensors = [t.shape for t in (*spec.inputs.values(), *spec.outputs.values())]
    dims = [e for shape in tensors for e in shape] + [e for g in spec.gemms for e in g]
    used = {e for e in dims if isinstance(e, str) and e.isidentifier()}
    parts = set().union(*(expr_symbols(e) for e in dims if not (isinstance(e, str) and e.isidentifier())))
    rows = [shape[-1] for shape in tensors if len(shape) > 1] + [n for _, n, _ in spec.gemms]
    return used - parts - set().union(*(expr_symbols(e) for e in rows))


def odd_set(spec: TaskSpec, rng: random.Random | None = None) -> tuple[str, dict[str, int]] | None:
    """The set of odd sizes (module docstring): the CPU set with each of
    :func:`free_symbols` an odd number below its own there (drawn with ``rng``, the judge's;
    without it the largest; sizes bound equal stay equal); None for a task without such sizes."""
    free = free_symbols(spec)
    base = spec.shapes[spec.cpu_shape_set]
    if not free or any(base[k] < 2 for k in free):
        return None
    odd = {v: 2 * (rng.randrange(v // 2) if rng else (v - 1) // 2) + 1 for k, v in sorted(base.items()) if k in free}
    return f"{spec.cpu_shape_set}+odd", {k: odd[v] if k in free else v for k, v in base.items()}


def short_set(spec: TaskSpec, rng: random.Random | None = None) -> tuple[str, dict[str, int]] | None:
    """The set of short aligned sizes (module docstring): the CPU set with each of
    :func:`free_symbols` a multiple of 8 below its own there (drawn with ``rng``, the judge's;
    without it 8); None for a task without such sizes."""
    free = free_symbols(spec)
    base = spec.shapes[spec.cpu_shape_set]
    if not free or any(base[k] < 16 for k in free):
        return None
    sizes = {v: 8 * (rng.randrange(1, (v - 1) // 8 + 1) if rng else 1) for k, v in sorted(base.items()) if k in free}
    return f"{spec.cpu_shape_set}+short", {k: sizes[v] if k in free else v for k, v in base.items()}


def small_sets(spec: TaskSpec, rng: random.Random | None = None) -> list[tuple[str, dict[str, int]]]:
    """The drawn sets below the CPU set's sizes: :func:`odd_set` and :func:`short_set`."""
    return [s for s in (odd_set(spec, rng), short_set(spec, rng)) if s is not None]


def with_drawn_sets(spec: TaskSpec, rng: random.Random | None = None) -> TaskSpec:
    """``spec`` with :func:`beyond_set` among its shape sets, and :func:`small_sets` where the task
    has free sizes (drawn with ``rng``: the judge's)."""
    sets = dict([beyond_set(spec, rng), *small_sets(spec, rng)])
    return spec.model_copy(update={"shapes": {**spec.shapes, **sets}})


def _drawn(spec: TaskSpec) -> tuple[str, list[str]]:
    """The names of the sets the judge draws (in ``spec`` or not): the beyond set, the small sets."""
    return beyond_set(spec)[0], [name for name, _ in small_sets(spec)]


def set_label(spec: TaskSpec, shape_set: str) -> str:
    """How a message names a set: a drawn set with its sizes (drawn per check, no file has them)."""
    beyond, small = _drawn(spec)
    if shape_set != beyond and shape_set not in small:
        return shape_set
    return f"{shape_set} ({', '.join(f'{k}={v}' for k, v in spec.shapes[shape_set].items())})"


def checked_sets(spec: TaskSpec, named: list[str] | None, device_bytes: int | None) -> tuple[list[str], list[str]]:
    """(sets to check, smallest first but the small sets last; named sets skipped as too
    large).  ``spec`` must hold the drawn sets (:func:`with_drawn_sets`); ``named`` restricts
    the named sets (None: all); ``device_bytes`` is the GPU's total memory, None for the CPU
    checks."""
    beyond, small = _drawn(spec)
    names = [s for s in spec.shapes if s != beyond and s not in small and (named is None or s in named)]
    if device_bytes is None:
        fits = [s for s in names if set_bytes(spec, s) <= CPU_SET_BYTES or s in spec.cpu_shape_sets]
    else:
        fits = [s for s in names if judge_bytes(spec, s) <= device_bytes]
    skipped = [s for s in names if s not in fits]
    # The small sets last: a failure on the task's own sets says more to whoever wrote the program.
    last = [s for s in small if s in spec.shapes]
    return sorted(fits + [beyond], key=spec.flops) + last, skipped
