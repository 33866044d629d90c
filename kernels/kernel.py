"""An accepted program as a PyTorch op: :class:`Kernel`, its ``autograd.Function``
and :class:`KernelModule`.

A program (one module of catalogue calls, see ``primitives``) plus the task it
solves (``tasks/spec.py``) is everything needed to run it inside a model:

- ``forward(**inputs, **params)`` returns the task's outputs and, beside them,
  whatever the program keeps for its backward;
- ``backward(saved, d<output>...)`` gets ``saved`` = inputs + params +
  everything forward returned (cut to what its source reads, :meth:`Kernel.keeps`:
  an output the backward never reads is not kept alive), and returns
  ``d<input>`` for the task's ``gradients`` (a backward that declares ``needs``
  is told which of them its caller reads, ``contract.py``).

:class:`Kernel` is the one place that turns that contract into autograd.  Its
``function`` (a ``torch.autograd.Function``) runs ``forward`` and, on
``backward``, hands the program the gradients of the task's ``grad_outputs``
(the float outputs that are not ``role: saved``: what the verifier draws
gradients for) and returns the program's ``d<input>``, ``None`` for inputs
outside ``gradients`` and for params.  The other outputs are marked
non-differentiable (but a forward-only kernel's float outputs, see below).
Where autograd needs only some gradients (a frozen weight: LoRA, a frozen
base) and the program's backward takes ``needs``, it is asked for the
smallest set the verifier checked that holds them (:meth:`Kernel.needs_for`),
so a frozen weight's gradient GEMM does not run.
A forward-only task saves nothing and raises if a gradient ever reaches it: a
silent zero gradient would train a model wrong.  A backward may reuse what it
was saved (``gemm(..., out=...)`` over a saved activation), so a kernel is
backpropagated once per forward: a second backward (``retain_graph=True``)
gets autograd's error about a saved tensor modified in place, not wrong numbers.

Calls are checked against the task before the program runs: every input a
tensor of the declared rank and dtype, and every dimension consistent with the
task's symbolic shapes (symbols bound by the first bare use, e.g. ``H`` in
``[T, H]``, then every expression over bound symbols evaluated), so a model
that hands a kernel shapes it was never verified for gets an error naming the
input and the dimension, not a wrong answer.  (While torch.compile traces a
call these checks are skipped: they parse shape expressions, which Dynamo
cannot trace; ``gemm``'s own checks of every launch still run then.)

The catalogue guard: a kernel records the catalogue version it was verified
against (a run's report says it), and refuses to load under another one, since
the same program may mean something else there.  An in-tree program (an expert)
is loaded against the current catalogue.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from pathlib import Path
from typing import Any, Iterable

import torch
import yaml
from pydantic import ValidationError

from coda_agent.errors import CodaError
from coda_agent.primitives import CATALOGUE_VERSION, CatalogueError, load_program
from coda_agent.primitives.operands import OUTPUT_DTYPES
from coda_agent.tasks import params as param_rules
from coda_agent.tasks.spec import ExprError, TaskSpec, eval_expr, expr_symbols

from .contract import ContractError, backward_reads, call_backward, call_forward, takes_needs

TORCH_DTYPES = {**OUTPUT_DTYPES, "int32": torch.int32, "int64": torch.int64}


class KernelError(CodaError):
    """A kernel that cannot be loaded or called as asked; the message names the fix."""


def spec_from_yaml(text: str, origin: str) -> TaskSpec:
    """A task spec from its YAML text (the reference it names is not imported)."""
    try:
        return TaskSpec.model_validate(yaml.safe_load(text))
    except (ValidationError, ExprError, yaml.YAMLError) as e:
        raise KernelError(f"{origin}: the task spec does not load: {e}") from None


class Kernel:
    """A program bound to its task: call it like the task's reference, with autograd."""

    def __init__(self, spec: TaskSpec, source: str, *, catalogue: str | None = None,
                 origin: str = "<source>"):
        if catalogue is not None and catalogue != CATALOGUE_VERSION:
            raise KernelError(
                f"{origin}: {spec.name} was verified against catalogue {catalogue}; this coda-agent has "
                f"catalogue {CATALOGUE_VERSION}, where the program may mean something else. Verify it "
                f"again here (coda-agent verify TASK PROGRAM) or use the coda-agent that verified it.")
        self.spec, self.source, self.origin = spec, source, origin
        self.catalogue = catalogue or CATALOGUE_VERSION
        try:
            self.program = load_program(source, name=spec.name)
        except CatalogueError as e:
            raise KernelError(f"{origin}: the program does not load: {e}") from None
        needed = ("forward", "backward") if spec.gradients else ("forward",)
        for fn in needed:
            if not callable(getattr(self.program, fn, None)):
                raise KernelError(f"{origin}: the program defines no {fn}(); {spec.name} needs "
                                  f"{' and '.join(needed)}")
        self.inputs = tuple(spec.inputs)
        self.params = dict(spec.params)
        # Params written as shape expressions (head_dim: D): worked out from the inputs' shapes.
        self.shape_params = param_rules.shape_expressions(spec.params, {s for b in spec.shapes.values() for s in b})
        self.outputs = tuple(spec.outputs)
        self.gradients = tuple(spec.gradients)
        self.grad_outputs = tuple(spec.grad_outputs)
        # A forward-only kernel's float outputs stay differentiable, so that a gradient
        # reaching one raises instead of silently stopping there.
        self.differentiable = self.grad_outputs if self.gradients else tuple(
            o for o, t in spec.outputs.items() if TORCH_DTYPES[t.dtype].is_floating_point)
        self.subsets = spec.gradient_subsets if takes_needs(source) else spec.gradient_subsets[:1]
        self.reads = backward_reads(source)  # what its Function saves (None: inputs, params, outputs)
        # smallest first, as tuples: needs_for runs inside backward, which torch.compile traces
        self._by_size = sorted(((tuple(sorted(s)), s) for s in self.subsets), key=lambda p: len(p[0]))
        self.function = _function(self)

    @classmethod
    def from_source(cls, source: str, task_yaml: str, *, catalogue: str | None = None,
                    origin: str = "<source>") -> "Kernel":
        return cls(spec_from_yaml(task_yaml, origin), source, catalogue=catalogue, origin=origin)

    @classmethod
    def from_files(cls, program: str | Path, task: str | Path, *, catalogue: str | None = None) -> "Kernel":
        """A program file and the task YAML it solves; ``catalogue`` is the version it was
        verified against (None: the current one, as for the suite's expert programs)."""
        program, task = Path(program), Path(task)
        for what, p in (("program", program), ("task", task)):
            if not p.is_file():
                raise KernelError(f"{p}: no such {what} file")
        return cls.from_source(program.read_text(), task.read_text(), catalogue=catalogue,
                               origin=str(program))

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, from {self.origin}, catalogue {self.catalogue})"

    # A Kernel never changes after it is built: a deepcopy of a model that holds one (an
    # EMA or reference copy) shares it, and pickling rebuilds it from the source.
    def __deepcopy__(self, memo: dict) -> "Kernel":
        return self

    def __reduce__(self) -> tuple:
        return (_rebuild, (self.spec, self.source, self.catalogue, self.origin))

    # ------------------------------------------------------------------ the program's contract

    def forward(self, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The program's forward, no autograd: the outputs and the state kept for backward."""
        if not torch.compiler.is_compiling():  # traced, the catalogue's own call checks still run
            check_inputs(self.spec, inputs, self.origin)
        try:
            return call_forward(self.program, inputs, params, self.outputs)
        except ContractError as e:
            raise KernelError(f"{self.origin}: {e}") from None

    def backward(self, saved: dict[str, Any], grads: dict[str, torch.Tensor],
                 needs: frozenset[str] | None = None) -> dict[str, torch.Tensor]:
        """The program's backward: ``d<input>`` for every name in ``needs`` (None: in
        ``gradients``), which must be one of :meth:`needs_for`'s answers."""
        if needs is not None and needs not in self.subsets:
            raise KernelError(f"{self.name}: the verifier checked its backward for the gradient sets "
                              f"{[sorted(s) for s in self.subsets]}, not {sorted(needs)}: ask for the smallest "
                              "of them that holds what you need (Kernel.needs_for)")
        try:
            return call_backward(self.program, saved, grads, self.gradients, needs)
        except ContractError as e:
            raise KernelError(f"{self.origin}: {e}") from None

    def keeps(self, name: str) -> bool:
        """Whether the autograd Function keeps ``name`` (an input, param or forward result) for the
        backward: all of them, unless the program's source shows which its backward reads
        (``contract.backward_reads``), as the verifier handed them when it checked it."""
        return self.reads is None or name in self.reads

    def needs_for(self, wanted: Iterable[str]) -> frozenset[str]:
        """The smallest verified gradient set (``TaskSpec.gradient_subsets``; only the whole set
        for a program whose backward does not declare ``needs``) holding ``wanted`` (``d<input>``
        names of the task's gradients)."""
        wanted = tuple(wanted)
        for names, subset in self._by_size:
            if all(w in names for w in wanted):
                return subset
        raise KernelError(f"{self.name}: {sorted(wanted)} are not all gradients of the task ({self.subsets[0]})")

    # ------------------------------------------------------------------ calling it

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(inputs, params) from a call like the reference's: inputs, then params, positionally in
        the task's order or by name (a param not given: the task's value)."""
        params = dict(self.params)
        if len(args) > len(self.inputs) + len(params):
            raise KernelError(f"{self.name} takes {len(self.inputs)} inputs {list(self.inputs)} and "
                              f"{len(params)} params {list(params)}; got {len(args)} positional arguments")
        given = dict(zip([*self.inputs, *params], args))
        inputs = {k: v for k, v in given.items() if k in self.spec.inputs}
        params.update((k, v) for k, v in given.items() if k not in inputs)
        for k, v in kwargs.items():
            if k in given:
                raise KernelError(f"{self.name}: {'input' if k in inputs else 'param'} {k!r} given twice")
            if k in self.spec.inputs:
                inputs[k] = v
            elif k in params:
                params[k] = v
            else:
                near = difflib.get_close_matches(k, [*self.inputs, *params], n=1)
                raise KernelError(f"{self.name} has no input or param {k!r}"
                                  + (f"; did you mean {near[0]!r}?" if near else ""))
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise KernelError(f"{self.name}: missing inputs {missing}")
        unset = {k: e for k, e in self.shape_params.items() if params[k] == e}
        if unset:
            shapes = {n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)}
            try:
                params.update(param_rules.from_shapes(unset, {n: t.shape for n, t in self.spec.inputs.items()},
                                                      shapes))
            except KeyError as e:
                raise KernelError(f"{self.name}: {e.args[0]}") from None
        return {n: inputs[n] for n in self.inputs}, params

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Run the kernel (with autograd): outputs by name, as the task's reference returns them.
        Under ``torch.autocast`` it is an op autocast lowers (see :func:`autocast_inputs`)."""
        inputs, params = self.bind(args, kwargs)
        inputs = autocast_inputs(self.spec, inputs)
        with autocast_off(*inputs.values()):  # the program's own torch math stays at its declared dtypes
            outs = self.function.apply(*inputs.values(), *params.values())
        return dict(zip(self.outputs, outs))

    def module(self, **params: Any) -> "KernelModule":
        """The kernel as an ``nn.Module`` with ``params`` fixed (default: the task's values)."""
        return KernelModule(self, **params)


def _rebuild(spec: TaskSpec, source: str, catalogue: str, origin: str) -> Kernel:
    return Kernel(spec, source, catalogue=catalogue, origin=origin)


class KernelModule(torch.nn.Module):
    """An ``nn.Module`` whose forward is the kernel: ``module(*inputs) -> {output: tensor}``."""

    def __init__(self, kernel: Kernel, **params: Any):
        super().__init__()
        self.kernel = kernel
        self.kernel_params = _params(kernel, params)

    def forward(self, *inputs: Any, **named: Any) -> dict[str, torch.Tensor]:
        return self.kernel(*inputs, **named, **self.kernel_params)

    def extra_repr(self) -> str:
        return f"{self.kernel.name}, from {self.kernel.origin}, params={self.kernel_params}"


def _params(kernel: Kernel, given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(kernel.params))
    if unknown:
        raise KernelError(f"{kernel.name} has params {sorted(kernel.params)}; not {unknown}")
    return {**kernel.params, **given}


def _function(kernel: Kernel) -> type[torch.autograd.Function]:
    """The autograd Function of one kernel; ``apply(*inputs, *params)``, outputs in task order."""
    n_in = len(kernel.inputs)

    def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(kernel.inputs, args[:n_in]))
        params = dict(zip(kernel.params, args[n_in:]))
        outs = kernel.forward(inputs, params)
        if kernel.gradients:  # a forward-only kernel keeps nothing alive
            saved = {k: v for k, v in {**inputs, **params, **outs}.items() if kernel.keeps(k)}
            ctx.tensor_names = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
            ctx.save_for_backward(*(saved[k] for k in ctx.tensor_names))
            ctx.others = {k: v for k, v in saved.items() if k not in ctx.tensor_names}
        ctx.mark_non_differentiable(*(outs[o] for o in kernel.outputs if o not in kernel.differentiable))
        return tuple(outs[o] for o in kernel.outputs)

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not kernel.gradients:
            raise KernelError(f"{kernel.name} is a forward-only kernel (its task declares no gradients); "
                              "it cannot be trained through. Use a task with a backward, or detach its inputs.")
        saved = {**ctx.others, **dict(zip(ctx.tensor_names, ctx.saved_tensors))}
        given = {f"d{o}": g for o, g in zip(kernel.outputs, grads) if o in kernel.grad_outputs}
        wanted = [f"d{n}" for n, needed in zip(kernel.inputs, ctx.needs_input_grad) if needed and n in kernel.gradients]
        back = kernel.backward(saved, given, kernel.needs_for(wanted))
        return (*(back.get(f"d{n}") for n in kernel.inputs), *(None for _ in kernel.params))

    cls_name = "".join(w.title() for w in re.split(r"\W|_", kernel.name) if w) + "Function"
    return type(cls_name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__doc__": f"{kernel.name} ({kernel.origin}) as an autograd Function: "
                   f"apply({', '.join([*kernel.inputs, *kernel.params])})"})


def autocast_inputs(spec: TaskSpec, inputs: dict[str, Any]) -> dict[str, Any]:
    """Mixed precision, as training scripts run it (fp32 master weights, the step inside
    ``torch.autocast(dtype=torch.bfloat16)``; FSDP2's MixedPrecisionPolicy hands bf16 weights
    already): an fp32 input the task declares in autocast's dtype is cast to it, as autocast casts
    a matmul's operands, and its gradient flows back to the fp32 tensor through the cast."""
    cast = dict(inputs)
    for name, v in inputs.items():
        t = spec.inputs[name]
        if (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and torch.is_autocast_enabled(v.device.type)
                and TORCH_DTYPES[t.dtype] == torch.get_autocast_dtype(v.device.type)):
            cast[name] = v.to(TORCH_DTYPES[t.dtype])
    return cast


def autocast_off(*values: Any) -> contextlib.AbstractContextManager:
    """Autocast off on the device of ``values``' first tensor where it is on: a kernel computes at
    its verified dtypes, and autocast would lower its programs' own PyTorch math (the reference
    lowering's, the aux kernels').  One plain ``torch.autocast`` context, which torch.compile
    traces (an ExitStack of them breaks its graph)."""
    device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), None)
    if device is None or not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)


def check_inputs(spec: TaskSpec, inputs: dict[str, Any], origin: str) -> None:
    """Inputs against the task: tensors of the declared rank and dtype, dimensions
    consistent with the symbolic shapes (see the module docstring)."""
    env: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, t in spec.inputs.items():
        v = inputs[name]
        if not isinstance(v, torch.Tensor):
            raise KernelError(f"{spec.name}: input {name!r} must be a tensor; got {type(v).__name__}")
        if v.dim() != len(t.shape):
            raise KernelError(f"{spec.name}: input {name!r} must be {len(t.shape)}-D {t.shape}; got shape "
                              f"{tuple(v.shape)}")
        if v.dtype != TORCH_DTYPES[t.dtype]:
            mixed = (f", or run it under torch.autocast({v.device.type!r}, dtype={TORCH_DTYPES[t.dtype]})"
                     if v.dtype == torch.float32 and TORCH_DTYPES[t.dtype] in (torch.bfloat16, torch.float16) else "")
            raise KernelError(f"{spec.name}: input {name!r} is {v.dtype}; the kernel was verified for "
                              f"{t.dtype} (cast it once where it is made, e.g. the model's dtype{mixed})")
        for expr, size in zip(t.shape, v.shape):
            if isinstance(expr, str) and expr.isidentifier() and expr not in env:
                env[expr], where[expr] = size, name
    for name, t in spec.inputs.items():
        for i, (expr, size) in enumerate(zip(t.shape, inputs[name].shape)):
            if not expr_symbols(expr) <= env.keys():
                continue  # a symbol no input shows bare (e.g. the head count): nothing to compare
            want = eval_expr(expr, {k: float(v) for k, v in env.items()})
            if want != size:
                bound = ", ".join(f"{s} = {env[s]} (from {where[s]!r})" for s in sorted(expr_symbols(expr)))
                raise KernelError(f"{spec.name}: input {name!r} dimension {i} is {size}; the task declares "
                                  f"{expr} = {want:g} with {bound or 'no symbols'} ({origin})")
