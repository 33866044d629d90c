"""Task specs: what the LLM is asked to solve, as YAML validated by pydantic.

A task names its tensors with *symbolic* shapes (``[T, H]``, ``[H, 2*I]``) and
binds the symbols per named shape set (``small``, ``ragged``, ``llama3-1b``,
...); shape and init expressions are ``expr.py``'s tiny arithmetic, and how an
input is drawn (its ``init``) is ``inits.py``'s.

The PyTorch reference takes the inputs (and params) as keyword arguments and returns
``{output_name: tensor}``.  It is named either by a file relative to the task file, ``reference:
geglu_ref.py:geglu_mlp`` (the usual case for a user's own task: the reference lives beside the
YAML, no PYTHONPATH), or by an importable module, ``coda_agent.tasks.llama3.references:swiglu_fwd``.
Backward is autograd through the reference unless ``backward_reference`` is given.

Which outputs receive an upstream gradient is :attr:`TaskSpec.grad_outputs`,
the one definition everything uses: the float outputs, except those with
``role: saved`` (state the forward keeps for the backward, such as SwiGLU's
pre-activation).  ``backward(saved, d<out>...)`` gets exactly those.

``expert`` (a human-written program) is optional: a task is written before
anyone has a kernel for it.  A field whose value starts with ``TODO`` (what
``coda-agent tasks new`` leaves for a person to decide) is reported by name.

A spec that loads is one the verifier can use: every size, GEMM and init
expression evaluates on every shape set to what it must be (a whole size, a
non-zero scale); tensor and param names are Python names, distinct from each
other and from the gradients ``d<name>``; and the reference is called once
(``dryrun.py``) to see that it takes those arguments and returns the declared
outputs.  Every error names the file, the field and the fix
(:class:`TaskSpecError`, worded by ``messages.py``), because task files are
written by people in a hurry.
"""

from __future__ import annotations

import keyword
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coda_agent.errors import CodaError

from .expr import (Expr, ExprError, eval_expr, evaluate, expr_symbols, parse_expr,  # noqa: F401 - the
                   structural_symbols, value_text)  # verifier imports eval_expr and structural_symbols from here
from . import params as param_rules
from .inits import Init
from .messages import TaskSpecError, read_yaml, task_name_problem, todo_fields, validation_messages
from .params import Scalar
from .sources import import_reference, reference_files, reference_source

FLOAT_DTYPES = ("bf16", "fp16", "fp32")

# --------------------------------------------------------------------------- the model

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PARAMETER_ROLES = ("weight", "norm_weight")  # inputs a model holds as parameters (may be frozen)


class TensorSpec(_Strict):
    shape: list[Expr]
    dtype: Literal["bf16", "fp16", "fp32", "int32", "int64", "fp8_e4m3", "fp8_e5m2"] = "bf16"
    init: Init = Init()
    # Read for outputs: ``saved`` is state for the backward and receives no upstream gradient
    # (TaskSpec.grad_outputs); the other roles document what a tensor is.
    role: Literal["activation", "weight", "residual", "norm_weight", "index", "table", "grad",
                  "output", "saved"] = "activation"

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, v: list[Expr]) -> list[Expr]:
        for e in v:
            parse_expr(e)
        return v


class Tolerance(_Strict):
    """CODA's rule plus a scale-relative norm check: max|out - ref_hi| <= factor *
    max|ref_lo - ref_hi| + floor, with ref_hi the reference in fp32 (fp64 on CPU) and ref_lo the
    reference run in the input dtype, and ||out - ref_hi|| / ||ref_hi|| <= rel_norm.  ``bias``: the
    mean signed error allowed beyond the reference's own (coda_agent.verifier.compare), as a fraction
    of the reference's RMS: a systematic offset hides under the max rule.  ``norm_factor``: the
    norm and bias rules' factor where it is not ``factor``.  A gradient through a kink (relu,
    clamp, abs) needs a max rule of its own: values within a rounding of the kink fall on either
    side in program and reference, not at the same elements, and each flip is one error of a whole
    term (``dy * w``), which the bf16 reference's largest error holds or not by chance, the fewer
    the elements the likelier not; a bias gradient sums those flips over every row, and the
    gradients they feed carry them.  Such a gradient widens the max rule alone and keeps the dense
    rules, which a flip barely moves where the rows share one scale (``{dx: {factor: 1000,
    norm_factor: 2}}``, ``tasks new`` says so; a weight's gradient may need ``rel_norm: 0.06``).  A max
    rule past 4x keeps the typical element to 4x the reference's (coda_agent.verifier.compare)."""

    rule: Literal["coda"] = "coda"
    # Negative bounds would reject every program, whatever it computes.
    factor: float = Field(2.0, ge=0)
    floor: float = Field(1e-6, ge=0)
    rel_norm: float = Field(2e-2, ge=0)
    bias: float = Field(2.0 ** -12, ge=0)
    norm_factor: float | None = Field(None, ge=0)

    @property
    def dense_factor(self) -> float:
        """The norm and bias rules' factor: ``norm_factor``, else ``factor`` up to 4 (a norm rule
        1000x the reference's noise held nothing: a gradient with a third of its rows at 0 passed)."""
        return min(self.factor, 4.0) if self.norm_factor is None else self.norm_factor

    @property
    def kinked(self) -> bool:
        """Whether the max rule is wider than the dense rules: a result through a kink, where one
        flip is an error of a whole term (the edge draw judges it by its max rule alone:
        coda_agent.verifier.calls.judged_by)."""
        return self.dense_factor < self.factor


class Target(_Strict):
    # Ratios of times: zero or below no program could meet (vs_gemm), or every program would (vs_compile).
    vs_gemm: float = Field(1.05, gt=0)  # fused time / plain GEMM time, at most
    vs_compile: float = Field(1.2, gt=0)  # torch.compile time / fused time, at least


class TaskSpec(_Strict):
    name: str
    summary: str
    families: list[Literal["elementwise", "pairwise", "vector", "tile", "reduction", "stateful"]]
    inputs: dict[str, TensorSpec]
    params: dict[str, Scalar] = Field(default_factory=dict)
    # Float params the judge keeps as written (a rate bounded to [0, 1], a value the reference
    # takes only as written); it varies every other float param per check
    # (verifier/inputs.py, drawn_params), so a program takes them from its call.
    fixed_params: list[str] = Field(default_factory=list)
    outputs: dict[str, TensorSpec]
    shapes: dict[str, dict[str, int]]
    reference: str
    backward_reference: str | None = None
    gradients: list[str] = Field(default_factory=list)
    # The task-wide rule, and overrides per output or gradient (``d<input>``), field by field:
    # ``tolerances: {loss: {factor: 4}}``.  Stored merged: each entry is a whole Tolerance.
    tolerance: Tolerance = Tolerance()
    tolerances: dict[str, Tolerance] = Field(default_factory=dict)
    baselines: list[Literal["gemm", "eager", "compile", "liger"]] = Field(
        default_factory=lambda: ["gemm", "eager", "compile"])
    target: Target = Target()
    expert: str | None = None
    # The GEMMs the math needs, as [M, N, K] expressions: the speed of light.
    gemms: list[list[Expr]]
    # Their operands' type where it is not the inputs' 16-bit one: a task whose GEMMs run in fp8
    # (quantized inside the program or given so) is timed against fp8 GEMMs of those shapes.
    gemm_dtype: Literal["fp8_e4m3"] | None = None
    cpu_shape_set: str = "small"
    # Shape sets the CPU checks run although they exceed the verifier's CPU size budget
    # (e.g. one that exercises a program's multi-chunk path); the small ones always run.
    cpu_shape_sets: list[str] = Field(default_factory=list)

    @field_validator("reference", "backward_reference")
    @classmethod
    def _check_ref(cls, v: str | None) -> str | None:
        if v is None:
            return v
        problem = reference_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        problem = task_name_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("gemms", mode="before")
    @classmethod
    def _check_gemms_form(cls, v: Any) -> Any:
        # A flat [M, N, K] (one GEMM written without the outer list) would otherwise be three
        # errors, one per symbol, none of which says what the field is.
        if not isinstance(v, list) or any(not isinstance(g, list) for g in v):
            raise ValueError(f"{v!r} is not a list of [M, N, K] entries; write e.g. [[T, 2*I, H]] (one GEMM) or "
                             "[[T, N, K], [T, K, N]] (two)")
        if not v:
            raise ValueError("no GEMM given; list the GEMMs the program runs as [[M, N, K], ...]: a program's "
                             "time is measured against them, so a task without one can never be accepted")
        return v

    @field_validator("params", mode="before")
    @classmethod
    def _check_params(cls, v: Any) -> Any:
        return param_rules.coerce(v)

    @model_validator(mode="before")
    @classmethod
    def _merge_tolerances(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or not isinstance(raw.get("tolerances"), dict):
            return raw
        base = raw.get("tolerance") or {}
        if not isinstance(base, dict):
            return raw
        merged = {k: {**base, **v} if isinstance(v, dict) else v for k, v in raw["tolerances"].items()}
        return {**raw, "tolerances": merged}

    @model_validator(mode="after")
    def _check_symbols(self) -> "TaskSpec":
        users: dict[str, list[str]] = {}  # symbol -> where it is used, for the error message
        for kind, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            for tname, t in tensors.items():
                for e in t.shape:
                    for s in expr_symbols(e):
                        users.setdefault(s, []).append(f"{kind}.{tname}")
        for i, g in enumerate(self.gemms):
            if len(g) != 3:
                raise ValueError(f"gemms[{i}]: {g} has {len(g)} entries; a GEMM is [M, N, K] (C[M, N] = A[M, K] @ "
                                 "B[K, N])")
            for e in g:
                for s in expr_symbols(e):
                    users.setdefault(s, []).append(f"gemms[{i}]")
        if not self.shapes:
            raise ValueError("shapes: give at least the 'small' shape set")
        for set_name, binding in self.shapes.items():
            missing = sorted(set(users) - set(binding))
            if missing:
                where = "; ".join(f"{s} (used by {', '.join(dict.fromkeys(users[s]))})" for s in missing)
                raise ValueError(f"shapes.{set_name} does not bind {where}; add "
                                 f"{', '.join(f'{s}: <int>' for s in missing)} to shapes.{set_name}")
        for name in self.cpu_shape_sets:
            if name not in self.shapes:
                raise ValueError(f"cpu_shape_sets: {name!r} is not one of the shape sets {sorted(self.shapes)}")
        if self.cpu_shape_set not in self.shapes:
            raise ValueError(f"cpu_shape_set {self.cpu_shape_set!r} is not one of the shape sets "
                             f"{sorted(self.shapes)}")
        for g in self.gradients:
            if g not in self.inputs:
                raise ValueError(f"gradients: {g!r} is not an input (inputs: {sorted(self.inputs)})")
            if self.inputs[g].dtype not in FLOAT_DTYPES:
                raise ValueError(f"gradients: {g!r} is {self.inputs[g].dtype}; only {', '.join(FLOAT_DTYPES)} "
                                 "inputs have gradients: remove it")
        if len(set(self.gradients)) != len(self.gradients):
            raise ValueError(f"gradients: {self.gradients} names an input twice; list each once")
        overlap = set(self.inputs) & set(self.params)
        if overlap:
            raise ValueError(f"{sorted(overlap)} are both inputs and params; rename one")
        param_rules.check(self.params, self.fixed_params, self.shapes)
        self._check_names()
        self._check_sizes()
        compared = [*self.outputs, *(f"d{g}" for g in self.gradients)]
        for name in self.tolerances:
            if name not in compared:
                raise ValueError(f"tolerances: {name!r} is neither an output nor a gradient of this task "
                                 f"(compared tensors: {', '.join(compared)})")
        return self

    @property
    def varied_params(self) -> list[str]:
        """The params the judge varies per check: the floats outside ``fixed_params``."""
        return [n for n, v in self.params.items() if param_rules.varies(v) and n not in self.fixed_params]

    def params_at(self, shape_set: str) -> dict[str, Scalar]:
        """The params as a call on ``shape_set`` takes them (shape expressions evaluated)."""
        return param_rules.at(self.params, self.shapes[shape_set])

    def _check_names(self) -> None:
        """Names the reference, the program and the backward take as keyword arguments."""
        for kind, names in (("inputs", self.inputs), ("outputs", self.outputs), ("params", self.params)):
            if kind != "params" and not names:
                raise ValueError(f"{kind}: none given; a task has at least one tensor {kind[:-1]}")
            for n in names:
                if not n.isidentifier() or keyword.iskeyword(n):
                    better = re.sub(r"\W", "_", n)
                    better = better if better.isidentifier() and not keyword.iskeyword(better) else f"{better}_"
                    raise ValueError(f"{kind}: {n!r} is not a Python name (the reference and the program take "
                                     f"and return it by name); rename it, e.g. {better!r}")
        for out in self.outputs:
            for kind, names in (("an input", self.inputs), ("a param", self.params)):
                if out in names:
                    raise ValueError(f"outputs: {out!r} is also {kind}; rename one (the reference takes inputs "
                                     "and params by name and returns outputs by name)")
        for g in self.gradients:
            if f"d{g}" in self.outputs:
                raise ValueError(f"outputs: {'d' + g!r} is also the name of input {g}'s gradient (gradients are "
                                 "d<input>); rename the output")
        for o in self.grad_outputs:
            if f"d{o}" in self.inputs or f"d{o}" in self.params:
                raise ValueError(f"{'d' + o!r} names an input or param and the upstream gradient of output {o} "
                                 "(backward takes d<output>); rename one")

    def _check_sizes(self) -> None:
        """Every size, GEMM and init expression evaluated on every shape set: a size that is not a
        whole number (``H/3``), negative or undefined (``H//(I-I)``), and an init the verifier
        cannot draw, fail here, not in the middle of a verification."""
        for set_name, binding in self.shapes.items():
            for sym, v in binding.items():
                if v < 0:
                    raise ValueError(f"shapes.{set_name}.{sym} is {v}; sizes are integers >= 0")
            env = {k: float(v) for k, v in binding.items()}
            sizes = [(f"{kind}.{n}.shape[{i}]", e) for kind in ("inputs", "outputs")
                     for n, t in getattr(self, kind).items() for i, e in enumerate(t.shape)]
            sizes += [(f"gemms[{i}][{j}]", e) for i, g in enumerate(self.gemms) for j, e in enumerate(g)]
            for where, e in sizes:
                v = evaluate(where, e, env, set_name)
                if v != int(v) or v < 0:
                    fix = ("use // (floor division) or sizes it divides" if v >= 0 else "a size cannot be negative")
                    raise ValueError(f"{where}: {value_text(e, v, set_name)}, not a size; {fix}")
            for n, t in self.inputs.items():
                t.init.check(f"inputs.{n}.init", n, t.dtype, self.shape_of(t, set_name), env, set_name)

    # ------------------------------------------------------------------ derived

    def shape_of(self, tensor: TensorSpec, shape_set: str) -> tuple[int, ...]:
        env = self.shapes[shape_set]
        return tuple(int(eval_expr(e, env)) for e in tensor.shape)

    def gemm_shapes(self, shape_set: str) -> list[tuple[int, int, int]]:
        env = self.shapes[shape_set]
        return [tuple(int(eval_expr(e, env)) for e in g) for g in self.gemms]  # type: ignore[misc]

    def flops(self, shape_set: str) -> float:
        return float(sum(2 * m * n * k for m, n, k in self.gemm_shapes(shape_set)))

    @property
    def has_backward(self) -> bool:
        return bool(self.gradients)

    @property
    def grad_outputs(self) -> list[str]:
        """The outputs whose upstream gradient ``d<output>`` backward receives: the float
        ones that are not ``role: saved`` (empty for a forward-only task)."""
        if not self.gradients:
            return []
        return [o for o, t in self.outputs.items() if t.dtype in FLOAT_DTYPES and t.role != "saved"]

    @property
    def gradient_subsets(self) -> list[frozenset[str]]:
        """The sets of gradients (``d<input>`` names) a backward that takes ``needs`` is verified
        for and is asked for (``kernels/contract.py``), the whole set first: the activations' alone
        (frozen parameters: LoRA, a frozen base), the parameters' alone (a frozen input, e.g. the
        first layer under frozen embeddings), and every set less one.  A caller that needs other
        gradients asks for the smallest of these that holds them."""
        full = [f"d{g}" for g in self.gradients]
        params = {f"d{g}" for g in self.gradients if self.inputs[g].role in PARAMETER_ROLES}
        family = [frozenset(full), frozenset(set(full) - params), frozenset(params),
                  *(frozenset(set(full) - {g}) for g in full)]
        return [s for i, s in enumerate(family) if s and s not in family[:i]]

    def tolerance_for(self, tensor: str) -> Tolerance:
        """The rule an output (or a gradient ``d<input>``) is compared with."""
        return self.tolerances.get(tensor, self.tolerance)


def reference_problem(v: str) -> str | None:
    """Why ``v`` does not name a reference function (None when it does)."""
    where, sep, fn = v.rpartition(":")
    module_like = bool(where) and all(p.isidentifier() for p in where.split("."))
    if not (sep and fn.isidentifier() and (where.endswith(".py") or module_like)):
        return (f"{v!r} must be 'path/to/file.py:function' (relative to the task file, e.g. 'ref.py:my_op') or "
                "'package.module:function' (importable, e.g. 'coda_agent.tasks.llama3.references:swiglu_fwd')")
    return None


class Task:
    """A loaded spec plus where it came from (to resolve the reference and expert files)."""

    def __init__(self, spec: TaskSpec, path: Path):
        self.spec = spec
        self.path = path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expert_path(self) -> Path | None:
        """The human-written program, None when the task has none (yet)."""
        return None if self.spec.expert is None else (self.path.parent / self.spec.expert).resolve()

    @cached_property
    def reference_fn(self) -> Callable[..., dict]:
        return self._import("reference", self.spec.reference)

    @cached_property
    def backward_reference_fn(self) -> Callable[..., dict] | None:
        if self.spec.backward_reference is None:
            return None
        return self._import("backward_reference", self.spec.backward_reference)

    def _import(self, field: str, target: str) -> Callable[..., dict]:
        try:
            return import_reference(target, self.path.parent)
        except LookupError as e:
            raise TaskSpecError(f"{self.path}: {field}: {e}") from None

    def _references(self) -> list[Callable]:
        return [f for f in (self.reference_fn, self.backward_reference_fn) if f is not None]

    def reference_source(self) -> str:
        """What the reference needs to be read: its function and, from its own file and
        the modules beside it, everything that function uses (see ``sources.py``)."""
        return reference_source(self._references())

    def reference_files(self) -> list[Path]:
        """The files :meth:`reference_source` reads (a run directory keeps copies)."""
        return reference_files(self._references())

    def __repr__(self) -> str:
        return f"Task({self.name!r}, {str(self.path)!r})"


def load_task(path: str | Path) -> Task:
    """Load and validate one task YAML; errors name the file, field and fix.

    The reference is imported and called (:mod:`.dryrun`: on meta tensors, which cost no
    time), so a reference that fails, returns something else than the declared outputs, or
    takes other arguments than the spec gives it is a broken spec here, not an error of the
    verifier's halfway through judging a program."""
    path = Path(path)
    if not path.is_file():
        what = "a folder, not a task file" if path.is_dir() else "no such task file"
        raise TaskSpecError(f"{path}: {what} (give a task YAML, e.g. tasks/llama3/swiglu_fwd.yaml)")
    raw = read_yaml(path)
    if raw is None:
        raise TaskSpecError(f"{path}: the file is empty; a task file is a YAML mapping with name, summary, "
                            "inputs, ... (coda-agent tasks new writes one from its reference)")
    if not isinstance(raw, dict):
        raise TaskSpecError(f"{path}: the file holds a YAML {type(raw).__name__}; a task file is a YAML mapping "
                            "with name, summary, inputs, ... (each key at the start of its line, no '- ')")
    todos = todo_fields(raw)
    if todos:
        raise TaskSpecError("\n".join(f"{path}: {field}: still {text.strip()}; fill it in"
                                      for field, text in todos))
    try:
        spec = TaskSpec.model_validate(raw)
    except ValidationError as e:
        raise TaskSpecError("\n".join(f"{path}: {line}" for line in validation_messages(e, TaskSpec))) from None
    except ExprError as e:
        raise TaskSpecError(f"{path}: {e}") from None
    task = Task(spec, path)
    task.reference_fn  # import now: a broken reference is a broken spec
    task.backward_reference_fn
    expert = task.expert_path
    if expert is not None and not expert.is_file():
        what = "is a folder" if expert.is_dir() else "does not exist"
        raise TaskSpecError(f"{path}: expert: {expert} {what}; point it at the task's human-written program "
                            "(a .py file), or remove the field (a task needs no expert)")
    from .dryrun import check_reference

    check_reference(task)
    return task


def scan_suite(directory: str | Path) -> tuple[list[Task], list[TaskSpecError]]:
    """Every task in a folder, and the error of each file that is not one (so one bad
    file does not hide the others).  Two files may not share a task name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TaskSpecError(f"{directory}: no such folder (give a folder of task YAMLs, e.g. tasks/llama3)")
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise TaskSpecError(f"{directory}: no task files (*.yaml) here")
    tasks: list[Task] = []
    errors: list[TaskSpecError] = []
    names: dict[str, Path] = {}
    for f in files:
        try:
            task = load_task(f)
        except TaskSpecError as e:
            errors.append(e)
            continue
        if task.name in names:
            errors.append(TaskSpecError(f"{f}: name: {task.name!r} is also the name of {names[task.name]}; "
                                        "task names must be unique in a folder"))
            continue
        names[task.name] = f
        tasks.append(task)
    return tasks, errors


def load_suite(directory: str | Path) -> list[Task]:
    """Every task in a folder; any bad file is an error (see :func:`scan_suite` to skip them)."""
    tasks, errors = scan_suite(directory)
    if errors:
        raise TaskSpecError("\n".join(str(e) for e in errors))
    return tasks


def shape_set_names(sets: str | None, tasks: list[Task]) -> list[str] | None:
    """``--sets small,ragged``: the names, each a shape set of every task; None when not
    given, which means each task's own sets."""
    if sets is None:
        return None
    names = [s.strip() for s in sets.split(",") if s.strip()]
    if not names:
        raise CodaError("--sets: give comma-separated shape set names, e.g. --sets small,ragged")
    for task in tasks:
        missing = [n for n in names if n not in task.spec.shapes]
        if missing:
            raise CodaError(f"--sets: task {task.name} has no shape set {', '.join(map(repr, missing))} "
                            f"(its sets: {', '.join(task.spec.shapes)})")
    return names
