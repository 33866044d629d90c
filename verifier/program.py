"""Calling a candidate program by the task's contract, inside the runner.

Everything here runs in the untrusted runner process (:mod:`.runner`): it is
the verifier's code, but once the program has run, the process may be the
program's.  So these checks explain honest mistakes to the LLM (a result of
the wrong dtype, an input written in place, PyTorch compute outside the
catalogue) and guarantee nothing: the judge re-checks what matters from its
side of the channel.

A :class:`Contract` is what the runner knows of the task: the names of the
inputs and params (with the params' values), the results a call returns and
their dtypes, and which inputs get gradients.  No reference, no seeds.
"""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from types import FunctionType, MappingProxyType, ModuleType
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from coda_agent.kernels.contract import ContractError, backward_reads, call_backward, call_forward, saved_state
from coda_agent.verifier.wire import DTYPE_NAMES

MAX_LOG = 4000


class CandidateError(Exception):
    """The program failed in a way the stage reports as its verdict."""

    def __init__(self, message: str, line: int | None = None, log: str = ""):
        super().__init__(message)
        self.message, self.line, self.log = message, line, log

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "line": self.line, "log": self.log}


@dataclass
class Contract:
    inputs: list[str]
    params: dict[str, Any]
    outputs: dict[str, str]  # name -> declared dtype
    gradients: list[str]  # inputs that get a gradient d<input>
    grad_outputs: list[str]  # outputs whose upstream gradient d<output> backward receives
    result_dtypes: dict[str, list[str]] = field(default_factory=dict)  # what each result may be

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Contract":
        return cls(**obj)


def trim(text: str, limit: int = MAX_LOG) -> str:
    return text if len(text) <= limit else text[:limit // 4] + "\n...\n" + text[-3 * limit // 4:]


def candidate_error(e: BaseException, name: str, doing: str) -> CandidateError:
    """``e`` as the program's failure, with the program's own line when the traceback has one."""
    line = getattr(e, "line", None)
    if line is None and isinstance(e, SyntaxError):
        line = e.lineno
    frames = [(f, n) for f, n in traceback.walk_tb(e.__traceback__) if name in f.f_code.co_filename]
    if line is None and frames:
        line = frames[-1][1]
    where = f" (line {line})" if line else ""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return CandidateError(f"{doing} raised {type(e).__name__}: {e}{where}", line, trim(tb))


# What each loaded program's backward reads from ``saved``, from its source: the runner cuts the
# dict it hands backward to it, as a Kernel in a model does (``contract.backward_reads``).
_READS: "weakref.WeakKeyDictionary[ModuleType, frozenset[str] | None]" = weakref.WeakKeyDictionary()


def load(source: str, tag: str, python_rules: bool = True) -> ModuleType:
    from coda_agent.primitives import load_program

    name = f"candidate_{tag}"
    try:
        mod = load_program(source, name, python_rules=python_rules)
    except Exception as e:  # noqa: BLE001 - the candidate's failure, reported with its line
        raise candidate_error(e, name, "loading the program") from None
    _READS[mod] = backward_reads(source)
    return mod


def call(contract: Contract, mod: ModuleType, inputs: dict[str, torch.Tensor],
         grads: dict[str, torch.Tensor] | None, audit: "TorchAudit | None" = None,
         needs: list[str] | None = None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """forward (+ backward) by the contract (``kernels/contract.py``) with ``params`` (the
    judge's for this call; None: the contract's): the outputs and ``d<input>`` gradients
    (those in ``needs``, when given) in one dict.  Each leaves the module's values as it
    found them (:func:`module_state`)."""
    params = contract.params if params is None else {k: params[k] for k in contract.params}
    before = module_state(mod)
    with _as_candidate(mod.__file__, "forward"), audit or contextlib.nullcontext():
        outs = call_forward(mod, inputs, params, contract.outputs)
    _same_state(mod, before, "forward")
    result = {o: outs[o] for o in contract.outputs}
    if grads is not None:
        saved = saved_state(inputs, params, outs, _READS.get(mod))
        with _as_candidate(mod.__file__, "backward"), audit or contextlib.nullcontext():
            result.update(call_backward(mod, saved, grads, contract.gradients, needs))
        _same_state(mod, before, "backward")
    return result


def module_state(mod: ModuleType) -> dict[str, Any]:
    """What the program's module holds, as values: each module-level name's binding, and for what
    the program made (its functions' defaults, closures and attributes, its epilogues' fns, the
    containers and tensors it binds) their contents, recursively; the catalogue's own objects
    and modules by identity.  A call that changes it keeps state between calls: a counter that
    turns a correct program wrong after the verifier's last call, outputs cached by their
    inputs, one output buffer handed out to every call."""
    from coda_agent.primitives.epilogue import Epilogue

    seen: set[int] = set()

    def value(v: Any, depth: int = 0) -> Any:
        if isinstance(v, (int, float, complex, str, bytes, bool, type(None))):
            return (type(v).__name__, v)
        if depth > 8 or id(v) in seen:  # a cycle, or deeper than a program's constants go
            return ("ref", type(v).__name__)
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            data = v.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
            return ("tensor", tuple(v.shape), str(v.dtype), str(v.device), hash(data.numpy().tobytes()))
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(value(x, depth + 1) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted(repr(value(x, depth + 1)) for x in v)))
        if isinstance(v, (dict, MappingProxyType)):  # a class's __dict__ is a new proxy at every read
            return ("dict", tuple((repr(k), value(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, Epilogue):
            return ("epilogue", id(v), value(v.fn, depth + 1))
        if isinstance(v, FunctionType) and v.__module__ == mod.__name__:
            cells = tuple(value(c.cell_contents, depth + 1) for c in v.__closure__ or () if _filled(c))
            return ("function", id(v), value(v.__defaults__, depth + 1), value(v.__kwdefaults__, depth + 1),
                    value(vars(v), depth + 1), cells)
        if isinstance(v, ModuleType) or getattr(type(v), "__module__", "").startswith(("coda_agent.", "builtins")):
            return ("object", id(v))
        return ("object", id(v), type(v).__qualname__, value(getattr(v, "__dict__", None), depth + 1))

    return {k: value(v) for k, v in vars(mod).items() if not (k.startswith("__") and k.endswith("__"))}


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _same_state(mod: ModuleType, before: dict[str, Any], doing: str) -> None:
    after = module_state(mod)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise CandidateError(f"{doing} changed the module-level {', '.join(f'`{k}`' for k in changed[:4])}: a "
                             "program keeps no state between calls (no counters, caches or buffers that outlive "
                             "a call); build what a call needs inside forward/backward")


@contextlib.contextmanager
def _as_candidate(name: str, doing: str) -> Iterator[None]:
    """The program's failures as its verdict: a broken contract as it is, anything it raised with
    its own line."""
    try:
        yield
    except ContractError as e:
        raise CandidateError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the candidate's failure, reported with its line
        raise candidate_error(e, name, doing) from None


def check_results(contract: Contract, results: dict[str, Any], shapes: dict[str, list[int]],
                  inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None,
                  device: str) -> dict[str, torch.Tensor]:
    """Every result a dense, contiguous tensor of the declared dtype and shape on ``device``,
    sharing memory with no input and no other result; an upstream gradient may be returned
    as it is (a residual connection's gradient, as autograd passes it)."""
    for name, t in results.items():
        allowed = contract.result_dtypes[name]
        if type(t) is not torch.Tensor:
            raise CandidateError(f"`{name}` is a {type(t).__module__}.{type(t).__name__}, not a torch.Tensor: "
                                 "return the tensor a catalogue call produced")
        if t.device.type != device or t.is_meta:
            raise CandidateError(f"`{name}` is on {t.device}; results live on {device}")
        if t.layout != torch.strided or t.is_sparse:
            raise CandidateError(f"`{name}` has layout {t.layout}; results are dense tensors")
        if DTYPE_NAMES.get(t.dtype) not in allowed:
            raise CandidateError(f"`{name}` is {DTYPE_NAMES.get(t.dtype, t.dtype)}; the task declares "
                                 f"{' or '.join(allowed)}: produce it in that dtype (an epilogue output's dtype, "
                                 "gemm's out_dtype)")
        if list(t.shape) != shapes[name]:
            raise CandidateError(f"`{name}` has shape {list(t.shape)}; the task declares {shapes[name]}")
        if not t.is_contiguous():
            raise CandidateError(f"`{name}` is a non-contiguous view (strides {list(t.stride())}): results "
                                 "must be dense row-major tensors; a transposed or sliced view is not one")
    passthrough = {id(g) for g in (grads or {}).values()}
    owners = [(f"the input `{k}`", v) for k, v in {**inputs, **(grads or {})}.items()]
    seen: list[tuple[str, torch.Tensor]] = []
    for name, t in results.items():
        for who, other in owners + seen:
            if id(t) in passthrough and other is t:
                continue
            if _overlap(t, other):
                raise CandidateError(shares_memory(name, who))
        seen.append((f"the result `{name}`", t))
    return results


def shares_memory(name: str, who: str) -> str:
    """The refusal of a result ``name`` whose memory is ``who``'s (an input or another result)."""
    fix = "every result must be a tensor of its own (only an upstream gradient may be returned as it is)"
    if who.startswith("the result"):  # two results of the same values: each needs its own tensor
        fix += ("; where two results hold the same values (two biases' gradients), compute the second "
                "one too, e.g. a second reduction of the same value in the epilogue")
    return f"`{name}` shares memory with {who}: {fix}"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# --------------------------------------------------------------------------- PyTorch calls

# Metadata and free views a program may touch on a tensor directly.
_TORCH_OK = {"shape", "dtype", "device", "ndim", "T", "mT", "t", "size", "dim", "view", "is_cuda",
             "__get__", "__len__", "__iter__"}
# What no epilogue's math does, even inside a launch, where the reference lowering evaluates the
# epilogue fn on whole tensors: products over a dimension (an epilogue is elementwise on its tile
# plus declared reductions) and reading values into Python (text, numbers, truth values), with
# which a fn (or a helper it calls) could tell the lowering or the data apart.
_NEVER_IN_EPILOGUE = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "einsum", "linear", "tensordot",
                      "inner", "outer", "kron", "conv1d", "conv2d", "__repr__", "__format__", "__str__", "tolist",
                      "item", "__float__", "__int__", "__bool__", "__index__", "numpy", "__array__", "sort", "topk",
                      "cumsum", "gather", "scatter", "index_select", "take"}


# What an epilogue fn's own code may do to the tensors the reference lowering hands it: the
# operators of its arithmetic and comparisons, elementwise (broadcasting a row vector against a
# column vector is the tile's own shape).  The vocabulary (``exp``, ``where``, ``unpack``...) runs
# as the catalogue's math.  No indexing, no metadata, no text: the cute lowering's values have
# none of it, so an fn that reads it computes something else in each lowering.
_EPILOGUE_MATH = frozenset(
    f"{pre}{op}{post}" for op in ("add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "neg", "pos",
                                  "abs", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor", "invert")
    for pre, post in (("", ""), ("__", "__"), ("__r", "__"), ("r", ""))) | {"true_divide", "remainder",
                                                                               "floor_divide", "positive",
                                                                               "bitwise_and", "bitwise_or",
                                                                               "bitwise_not", "logical_not"}


def _basic_index(index: Any) -> bool:
    """Ints, slices, None and ... only: a free view (``x[r0:r1]``), not a gather."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _holds_tensor(value: Any) -> bool:
    """A tensor among a free op's arguments (``w[:t]``, ``x.view(t, -1)`` with a 0-d ``t``): the
    op reads its value into a size, and the result's shape hands it to Python, which is reading
    the data past the audit."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, slice):
        return _holds_tensor((value.start, value.stop, value.step))
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def _vocabulary_files() -> frozenset[str]:
    """The catalogue's epilogue vocabulary (``exp``, ``silu``, ``fma``..., and ``Pair``'s lanes):
    inside an epilogue fn it is the epilogue's math; handed whole tensors on the host it runs
    PyTorch on them for whoever called it, so the audit looks through it to that caller."""
    from coda_agent.primitives import math as vocabulary
    from coda_agent.primitives import pair

    return frozenset(m.__file__ for m in (vocabulary, pair))


def epilogue_codes(mod: ModuleType) -> frozenset[Any]:
    """The code objects of the @epilogue fns ``mod`` declares at module level: the only program
    code the catalogue may run inside its own launches (the reference lowering's epilogue)."""
    from coda_agent.primitives.epilogue import Epilogue

    return frozenset(v.fn.__code__ for v in vars(mod).values() if isinstance(v, Epilogue))


class TorchAudit(TorchFunctionMode):
    """Records PyTorch calls the program's own code makes: tensor arithmetic an AST cannot tell
    from int math.  Which code made a call is decided by code identity and by the catalogue's
    launch state, never by a function's name (a helper named like an epilogue fn is a helper):

    - the nearest Python frame outside PyTorch and outside the epilogue vocabulary
      (:func:`_vocabulary_files`: ``silu(t)`` on the host is the caller's PyTorch) is the
      program's, or the call is the catalogue's own (its checks and allocations);
    - a program frame is exempt only inside a catalogue launch, and only when the program code
      the catalogue entered there is a module-level @epilogue fn (:func:`epilogue_codes`, plus
      whatever helpers it calls): the reference lowering evaluating the epilogue.  The same fn
      run outside a launch (the dry run of an epilogue declared inside forward, whose body can
      reach that call's tensors) and an epilogue declared inside forward and launched are the
      program's compute;
    - even inside a launch, the fn's own code may only apply operators (:data:`_EPILOGUE_MATH`:
      arithmetic and comparisons) and the vocabulary, and the vocabulary nothing an epilogue's
      math never does (:data:`_NEVER_IN_EPILOGUE`: a matmul, a tensor's text or Python
      number).  The lowering evaluates ``tile_pass`` and ``vector_pass`` fns on whole host
      tensors: a fn that slices them, masks them, reads their length or their dtype's text
      computes on the host, or tells the lowering (and the draw) apart."""

    def __init__(self, program_file: str, epilogues: frozenset[Any]):
        super().__init__()
        self.program_file = program_file
        self.epilogues = epilogues
        self.calls: list[tuple[int, str]] = []
        self.in_epilogue: set[int] = set()  # lines of those calls that an epilogue fn's evaluation made
        self._in_epilogue = False
        self._skip = _vocabulary_files()
        from coda_agent.primitives.lowering import inside_launch

        self._inside_launch = inside_launch
        self._torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", str(func))
        free = (name in _TORCH_OK or (name == "__getitem__" and _basic_index(args[1] if len(args) > 1 else None))) \
            and not _holds_tensor((args[1:], kwargs))
        line = self._program_line(sys._getframe(1), name, free)
        if line is not None:
            self.calls.append((line, name))
            if self._in_epilogue:
                self.in_epilogue.add(line)
        return func(*args, **(kwargs or {}))

    def _program_line(self, f: Any, name: str, free: bool) -> int | None:
        """The program's line that made the PyTorch call ``name`` (None: not the program's
        compute); ``free``: metadata or a free view, which host code may touch."""
        vocabulary = False
        while f is not None and (f.f_code.co_filename.startswith(self._torch_dir)
                                 or f.f_code.co_filename in self._skip):
            vocabulary = vocabulary or f.f_code.co_filename in self._skip
            f = f.f_back
        # Code compiled from a string (``<string>``: eval, exec) runs for whoever called it.
        while f is not None and f.f_code.co_filename.startswith("<") and f.f_code.co_filename != self.program_file:
            f = f.f_back
        if f is None or f.f_code.co_filename != self.program_file:
            return None
        entered = f  # the outermost of the program's frames the catalogue (or the contract) entered
        while entered.f_back is not None and entered.f_back.f_code.co_filename == self.program_file:
            entered = entered.f_back
        if self._inside_launch() and entered.f_code in self.epilogues:
            # The reference lowering evaluating an epilogue fn: the vocabulary's math, and the
            # fn's own arithmetic; nothing the cute lowering's values lack (a view, a length,
            # a dtype's text), with which the fn could tell the lowerings or the data apart.
            allowed = name not in _NEVER_IN_EPILOGUE if vocabulary else name in _EPILOGUE_MATH
            self._in_epilogue = not allowed
            return None if allowed else f.f_lineno
        self._in_epilogue = False
        return None if free else f.f_lineno

    def verdict(self) -> CandidateError | None:
        if not self.calls:
            return None
        line, name = self.calls[0]
        ops = sorted({n for _, n in self.calls})
        if line in self.in_epilogue:
            return CandidateError(f"line {line}: an epilogue fn (or a helper it calls) applies `{name}` to its "
                                  f"values (in all: {', '.join(ops[:8])}); inside an epilogue only operators "
                                  "(+ - * / **, comparisons) and the catalogue's math functions apply: the "
                                  "compiled kernel's values have no attributes, views, lengths or text, so an "
                                  "fn that reads them computes something else on the GPU", line)
        return CandidateError(f"PyTorch compute in the program at line {line} (`{name}`; in all: "
                              f"{', '.join(ops[:8])}): forward/backward may only call catalogue "
                              "functions; move the math into an @epilogue or use an auxiliary "
                              "catalogue kernel", line)


POISON_PER_CALL = 2  # the poisoned block holds twice a call's tensors (its inputs and its results in fp32)
POISON_MIN = 256 << 20


def call_bytes(tensors: list[torch.Tensor], result_shapes: dict[str, list[int]]) -> int:
    """A call's memory: its input and gradient tensors, and its results as if all were fp32."""
    return sum(t.nbytes for t in tensors) + 4 * sum(math.prod(shape) for shape in result_shapes.values())


def poison_bytes(need: int, free: int) -> int:
    """How much memory :func:`poison_allocator` fills for a call whose inputs and results take
    ``need`` bytes (:func:`call_bytes`): room for the results and the intermediates before them.
    The block stays in this process's cache, so it counts against the device the judge shares
    (``shape_sets.GPU_MEMORY_FACTOR`` sizes the checks for both); a block sized to the free memory
    instead takes about half of what the judge's own draws leave (28 GiB beside its 50 on an
    80 GiB H100), and a llama3-70b set no longer fits."""
    return int(min(free * 0.6, 32 << 30, max(POISON_MIN, POISON_PER_CALL * need)))


def poison_allocator(need: int) -> None:
    """Fill a block of :func:`poison_bytes` with NaN bytes (0xFF), then free it into the cache:
    outputs the catalogue allocates next start as NaN, so unwritten tiles show.  The cache is
    emptied first, so the poisoned block takes the place of blocks freed by earlier calls (their
    results would otherwise be the first candidates for this call's outputs)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(poison_bytes(need, free), dtype=torch.uint8, device="cuda").fill_(0xFF)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device="cuda").fill_(0xFF) for _ in range(64)]
    torch.cuda.synchronize()
    del big, small


# --------------------------------------------------------------------------- the launch audit

_LAUNCH_API = ("LaunchKernel", "cuLaunch", "cudaLaunch", "Memcpy", "Memset", "memcpy", "memset")


def busy_ms(spans: list[tuple[str, float, float]], kernels: list[tuple[float, float]]) -> dict[str, float]:
    """Device time per catalogue range, in ms: a record_function range also appears on the device
    timeline, from its first kernel's start to its last one's end, and what counts is the kernels'
    time inside that span, not the span (a range of a few small launches spans the host's gaps
    between them).  Times in microseconds, as the profiler gives them."""
    out: dict[str, float] = {}
    for name, start, end in spans:
        inside = sum(min(end, k_end) - max(start, k_start) for k_start, k_end in kernels
                     if k_start < end and k_end > start)
        out[name] = out.get(name, 0.0) + inside / 1e3
    return out


def profile(contract: Contract, mod: ModuleType, inputs: dict[str, torch.Tensor],
            grads: dict[str, torch.Tensor] | None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One call (with ``params``, as :func:`call`) under torch.profiler and the launch ledger:
    what ran, where, and for how long."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from coda_agent.primitives import launch_ledger

    call(contract, mod, inputs, grads, params=params)  # warm-up: compile and autotune outside the profile
    torch.cuda.synchronize()
    audit = TorchAudit(mod.__file__, epilogue_codes(mod))
    with launch_ledger() as ledger, torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(contract, mod, inputs, grads, audit, params=params)
        torch.cuda.synchronize()
    events = list(prof.events())
    cuda = torch.autograd.DeviceType.CUDA
    ranges = [e for e in events if e.name.startswith("coda::") and e.device_type != cuda]
    kernels = [e for e in events if e.device_type == cuda and not e.name.startswith("coda::")]
    launches = [e for e in events if e.device_type != cuda and any(a in e.name for a in _LAUNCH_API)]
    outside = []
    for e in launches:
        t = e.time_range.start
        if not any(r.time_range.start <= t <= r.time_range.end for r in ranges):
            parent = e.cpu_parent
            while parent is not None and parent.cpu_parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            outside.append(parent.name if parent is not None else e.name)
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in events
             if e.device_type == cuda and e.name.startswith("coda::")]
    per_range = busy_ms(spans, [(k.time_range.start, k.time_range.end) for k in kernels])
    err = audit.verdict()
    return {"ledger": [f"{entry.kind}:{entry.name}" for entry in ledger],
            "configs": [f"{entry.name}: {entry.config}" for entry in ledger if entry.kind == "gemm"],
            "kernels": [k.name for k in kernels][:50], "n_kernels": len(kernels),
            "kernel_ms": {k: round(v, 4) for k, v in per_range.items()},
            "outside": sorted(set(outside)), "torch_compute": err.to_json() if err else None}
