"""Which lowering runs a program, and what it launched.

``gemm`` and the auxiliary kernels consult :func:`current_lowering` inside
their custom ops, when the launch runs (never while torch.compile traces, which
cannot read a ContextVar), so the lowering of a compiled model is the one in
force when it is called:

- ``"reference"``: the PyTorch interpreter (any device);
- ``"cute"``: quack's SM90 GEMM with the epilogue compiled by CuTeDSL (CUDA);
- ``"compile"``: compile every GEMM for sm_90a without launching (no GPU
  needed) and return uninitialised outputs of the right shapes, so a program's
  whole forward/backward can be compiled on a CPU-only machine;
- ``"auto"`` (default): ``cute`` for CUDA tensors, ``reference`` otherwise.

Every catalogue call that launches device work appends a :class:`Launch` to
the active :func:`launch_ledger` and runs inside a ``torch.profiler``
``record_function`` range named ``coda::<kind>::<name>``: the verifier's launch
audit attributes every CUDA kernel to such a range, and a kernel outside all
of them is compute the program smuggled past the catalogue (the range exists
while a profiler records: :func:`profiler_range`).  A catalogue call
made inside another (the tile pass that ``layernorm_fold`` runs) adds no entry
of its own: the program made one call, and the audit counts at least one
kernel per entry.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, TypeVar

import torch

LOWERINGS = ("auto", "reference", "cute", "compile")

T = TypeVar("T")

_lowering: contextvars.ContextVar[str] = contextvars.ContextVar("coda_lowering", default="auto")
_ledger: contextvars.ContextVar[list | None] = contextvars.ContextVar("coda_ledger", default=None)
_compiled: contextvars.ContextVar[list | None] = contextvars.ContextVar("coda_compiled", default=None)
_launching: contextvars.ContextVar[bool] = contextvars.ContextVar("coda_launching", default=False)
_padded: contextvars.ContextVar[bool] = contextvars.ContextVar("coda_padded_lanes", default=False)


@dataclass(frozen=True)
class Launch:
    kind: str  # "gemm" | "pass" (a tile pass: the pass kernel, or an epilogue over a zero mainloop) | "aux"
    name: str
    config: str = ""  # the tile configuration a gemm ran with (reports show it)


@dataclass(frozen=True)
class SassReport:
    sm90a: bool
    hgmma: int  # warpgroup MMA instructions: HGMMA (16-bit operands) and QGMMA (fp8)
    spill_stores: int
    spill_loads: int
    registers: int
    local_bytes: int
    instructions: int = 0
    # CALLs in the SASS: the slow-path subroutines of IEEE division (``a / b``)
    # and friends, each wrapped in a convergence barrier; a fast epilogue has none.
    calls: int = 0


@dataclass
class CompiledKernel:
    epilogue: str
    config: str
    seconds: float
    log: str
    sass: SassReport | None
    shapes: dict = field(default_factory=dict)
    kind: str = "gemm"  # the launch's kind: "pass" for a tile pass (its own kernel has no MMA by design)

    def report(self, log: str | None = None) -> dict:
        """The kernel as the verifier's compile stage reads it (``log``: the log to report, trimmed)."""
        return {"epilogue": self.epilogue, "config": self.config, "seconds": round(self.seconds, 2),
                "log": self.log if log is None else log, "sass": None if self.sass is None else vars(self.sass),
                "kind": self.kind}


@contextlib.contextmanager
def set_within(var: contextvars.ContextVar, value: T) -> Iterator[T]:
    """``var`` holds ``value`` inside (and yields it), and what it held before after: the one
    way every catalogue setting is scoped."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


@contextlib.contextmanager
def lowering(name: str) -> Iterator[None]:
    """Run the enclosed catalogue calls with one lowering."""
    if name not in LOWERINGS:
        raise ValueError(f"unknown lowering {name!r}; choose one of {LOWERINGS}")
    with set_within(_lowering, name):
        yield


def current_lowering(*tensors: object) -> str:
    name = _lowering.get()
    if name != "auto":
        return name
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
    return "cute" if on_gpu else "reference"


@contextlib.contextmanager
def padded_lanes() -> Iterator[None]:
    """Inside, the reference lowering runs each epilogue over whole tiles of its
    tile configuration, as the kernel does: past a ragged edge the accumulator
    and Tile operands are 0, vector operands hold stale values (quack's
    predicated vector loads leave shared memory as it was), and sums fold every
    lane, padded ones included (max, LSE and select mask them).  A program
    whose results change inside is right on the CPU and wrong on the GPU at
    ragged shapes: e.g. a col_sum of ``acc + bias`` adds the stale bias of each
    padded column."""
    with set_within(_padded, True):
        yield


def padding_lanes() -> bool:
    """Whether :func:`padded_lanes` is in force."""
    return _padded.get()


PLAIN_GEMM_LIBRARIES = ("quack", "cublas")
_plain_library = "quack"


@contextlib.contextmanager
def plain_gemms(library: str) -> Iterator[None]:
    """Which library runs the cute lowering's plain GEMMs inside the block: quack's SM90 kernel
    (the default, and what every program is verified with) or cuBLAS (``torch.mm``, and
    ``addmm_`` for ``accumulate_into``).  Only a GEMM without an epilogue, of 16-bit operands into
    a D of their dtype, with no explicit config, changes hands; everything else runs quack's.

    It is a switch for a measurement: a training step runs at the power cap, where a GEMM costs
    its energy, and H200 run 18 saw CODA's step run at a 4-12% lower clock than compile's
    cuBLAS GEMMs did, with a third to a half of its GEMM time in plain GEMMs (BENCHMARKS.md).
    Process-wide while the block runs, not a context variable: autograd runs a CUDA backward on
    device threads of its own."""
    global _plain_library
    if library not in PLAIN_GEMM_LIBRARIES:
        raise ValueError(f"unknown plain-GEMM library {library!r}; choose one of {PLAIN_GEMM_LIBRARIES}")
    before, _plain_library = _plain_library, library
    try:
        yield
    finally:
        _plain_library = before


def plain_gemm_library() -> str:
    """The library :func:`plain_gemms` chose (``quack`` outside any block)."""
    return _plain_library


@contextlib.contextmanager
def launch_ledger() -> Iterator[list[Launch]]:
    """Collect a :class:`Launch` per device-work call made inside.  A context variable:
    autograd runs a CUDA backward on its own device threads, which do not see it, so a
    backward through autograd is collected under ``torch.autograd.set_multithreading_enabled(False)``."""
    with set_within(_ledger, []) as launches:
        yield launches


@contextlib.contextmanager
def compile_only() -> Iterator[list[CompiledKernel]]:
    """Compile every GEMM for sm_90a instead of running it (CPU is enough)."""
    with set_within(_compiled, []) as kernels, lowering("compile"):
        yield kernels


def record_compiled(kernel: CompiledKernel) -> None:
    sink = _compiled.get()
    if sink is not None:
        sink.append(kernel)


def inside_launch() -> bool:
    """Whether this thread is inside a catalogue launch (the verifier's audit tells the
    epilogue the catalogue evaluates from the program's own host code by it)."""
    return _launching.get()


@contextlib.contextmanager
def launching(kind: str, name: str, config: str = "") -> Iterator[None]:
    """Ledger entry plus a profiler range around one catalogue launch (none
    inside another launch, see the module doc, and none while compiling: a
    compile-only run launches nothing, though its aux kernels still compute,
    cheaply at the compile shapes, to keep every later shape right)."""
    if _launching.get() or _lowering.get() == "compile":
        yield
        return
    with set_within(_launching, True), profiler_range(f"coda::{kind}::{name}"):
        yield
    # Recorded once the launch is made: one that raised (a config refused while compiling,
    # then run again on another) launched nothing.
    sink = _ledger.get()
    if sink is not None:
        sink.append(Launch(kind, name, config))


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function`` range while a profiler records (entering one costs a dispatcher
    call, about 10 us, even with none; emit_nvtx counts as one), else nothing."""
    if not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
