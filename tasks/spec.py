"""Task specs: what the LLM is asked to solve, as YAML validated by pydantic.

A task names its tensors with *symbolic* shapes (``[T, H]``, ``[H, 2*I]``) and
binds the symbols per named shape set (``small``, ``ragged``, ``llama3-1b``,
...).  Shape and init expressions are tiny arithmetic over those symbols,
parsed with :mod:`ast` (never ``eval``): ``+ - * / // **``, parentheses,
integers, floats and ``sqrt``/``ceil``.

The PyTorch reference takes the inputs (and params) as keyword arguments and
returns ``{output_name: tensor}``.  It is named either by a file relative to
the task file, ``reference: geglu_ref.py:geglu_mlp`` (the usual case for a
user's own task: the reference lives beside the YAML, no PYTHONPATH), or by
an importable module, ``coda_agent.tasks.llama3.references:swiglu_fwd``.
Backward is autograd through the reference unless ``backward_reference`` is
given.

Which outputs receive an upstream gradient is :attr:`TaskSpec.grad_outputs`,
the one definition everything uses: the float outputs, except those with
``role: saved`` (state the forward keeps for the backward, such as SwiGLU's
pre-activation).  ``backward(saved, d<out>...)`` gets exactly those.

``expert`` (a human-written program) is optional: a task is written before
anyone has a kernel for it.  A field whose value starts with ``TODO`` (what
``coda-agent tasks new`` leaves for a person to decide) is reported by name.

Every validation error names the file, the field and the fix
(:class:`TaskSpecError`), because task files are written by people in a hurry.
"""

from __future__ import annotations

import ast
import math
import operator
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coda_agent.errors import CodaError

from .sources import import_reference, reference_files, reference_source

FLOAT_DTYPES = ("bf16", "fp16", "fp32")
TODO = "TODO"  # a value a person still has to fill in (``coda-agent tasks new`` writes them)

# --------------------------------------------------------------------------- expressions

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}
_FUNCS = {"sqrt": math.sqrt, "ceil": math.ceil}


class ExprError(ValueError):
    pass


def parse_expr(text: str | int | float) -> ast.expr:
    """Parse and check a shape/scale expression; raises ExprError with the fix."""
    if isinstance(text, (int, float)):
        return ast.Constant(text)
    try:
        tree = ast.parse(str(text), mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"cannot parse expression {text!r} ({e.msg})") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Call, ast.Load,
                               ast.USub, ast.UAdd, *_BINOPS))
        if not ok:
            raise ExprError(f"expression {text!r}: {type(node).__name__} is not allowed "
                            "(use + - * / // ** and sqrt/ceil over shape symbols)")
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS and len(node.args) == 1
                    and not node.keywords):
                raise ExprError(f"expression {text!r}: only sqrt(x) and ceil(x) calls are allowed")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise ExprError(f"expression {text!r}: constant {node.value!r} is not a number")
    return tree


def expr_symbols(text: str | int | float) -> set[str]:
    return expr_symbols_of(parse_expr(text))


def structural_symbols(text: str | int | float) -> set[str]:
    """The symbols ``text`` multiplies by another symbol: in ``NQ*D`` or ``(NQ + 2*NKV)*D``
    a head count and a head width, which together describe the layout of one tensor
    dimension (``2*I`` scales a size by a constant and is not structural)."""
    found: set[str] = set()
    for node in ast.walk(parse_expr(text)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = expr_symbols_of(node.left), expr_symbols_of(node.right)
            if left and right:
                found |= left | right
    return found


def expr_symbols_of(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def eval_expr(text: str | int | float, env: dict[str, float]) -> Any:
    def ev(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ExprError(f"expression {text!r}: unknown symbol {node.id!r} "
                                f"(this shape set binds {sorted(env)})")
            return env[node.id]
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Call):
            return _FUNCS[node.func.id](ev(node.args[0]))  # type: ignore[union-attr]
        raise ExprError(f"expression {text!r}: unsupported node")

    return ev(parse_expr(text))


# --------------------------------------------------------------------------- the model

Expr = str | int | float
Scalar = bool | int | float | str  # a param: any scalar a reference takes (eps, causal, activation name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Init(_Strict):
    """How the verifier draws a fresh input (never zeros).

    ``normal``: ``mean + scale * N(0, 1)``; ``uniform``: ``mean + U(-scale, scale)``;
    ``ones_plus_noise``: ``1 + scale * N(0, 1)`` (a norm weight); ``randint``:
    integers in ``[0, high)`` (``high`` defaults to the last dimension);
    ``arange_rows``: the row index.  ``mean`` offsets the two that take it: a
    LayerNorm's centring is only tested by inputs whose mean is not zero."""

    dist: Literal["normal", "uniform", "randint", "arange_rows", "ones_plus_noise"] = "normal"
    scale: Expr = 1.0  # std for normal, half-width for uniform, noise std for ones_plus_noise
    mean: Expr = 0.0  # offset of normal and uniform
    high: Expr | None = None  # exclusive upper bound for randint

    @field_validator("scale", "mean", "high")
    @classmethod
    def _check_expr(cls, v: Expr | None) -> Expr | None:
        if v is not None:
            parse_expr(v)
        return v

    @model_validator(mode="after")
    def _check_mean(self) -> "Init":
        if self.mean not in (0, 0.0, "0") and self.dist not in ("normal", "uniform"):
            raise ValueError(f"init.mean offsets only dist normal or uniform, not {self.dist}; remove it "
                             "(ones_plus_noise is already centred on 1)")
        return self


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
    """CODA's rule plus a scale-relative norm check.

    max|out - ref_hi| <= factor * max|ref_lo - ref_hi| + floor, where ref_hi is
    the reference in fp32 (fp64 on CPU) and ref_lo the reference run in the input
    dtype; and ||out - ref_hi|| / ||ref_hi|| <= rel_norm.  ``bias``: the mean signed
    error allowed beyond the reference's own (see coda_agent.verifier.compare), as a
    fraction of the reference's RMS: a systematic offset hides under the max rule.
    """

    rule: Literal["coda"] = "coda"
    factor: float = 2.0
    floor: float = 1e-6
    rel_norm: float = 2e-2
    bias: float = 2.0 ** -12


class Target(_Strict):
    vs_gemm: float = 1.05  # fused time / plain GEMM time, at most
    vs_compile: float = 1.2  # torch.compile time / fused time, at least


class TaskSpec(_Strict):
    name: str
    summary: str
    families: list[Literal["elementwise", "pairwise", "vector", "tile", "reduction", "stateful"]]
    inputs: dict[str, TensorSpec]
    params: dict[str, Scalar] = Field(default_factory=dict)
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
    cpu_shape_set: str = "small"
    # Shape sets the CPU checks run although they exceed the verifier's CPU size budget
    # (e.g. one that exercises a program's multi-chunk path); the small ones always run.
    cpu_shape_sets: list[str] = Field(default_factory=list)

    @field_validator("reference", "backward_reference")
    @classmethod
    def _check_ref(cls, v: str | None) -> str | None:
        if v is None:
            return v
        where, sep, fn = v.rpartition(":")
        module_like = bool(where) and all(p.isidentifier() for p in where.split("."))
        if not (sep and fn.isidentifier() and (where.endswith(".py") or module_like)):
            raise ValueError(f"{v!r} must be 'path/to/file.py:function' (relative to the task file, e.g. "
                             "'ref.py:my_op') or 'package.module:function' (importable, e.g. "
                             "'coda_agent.tasks.llama3.references:swiglu_fwd')")
        return v

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
                raise ValueError(f"gemms entry {g} must be [M, N, K]")
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
        overlap = set(self.inputs) & set(self.params)
        if overlap:
            raise ValueError(f"{sorted(overlap)} are both inputs and params; rename one")
        compared = [*self.outputs, *(f"d{g}" for g in self.gradients)]
        for name in self.tolerances:
            if name not in compared:
                raise ValueError(f"tolerances: {name!r} is neither an output nor a gradient of this task "
                                 f"(compared tensors: {', '.join(compared)})")
        return self

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

    def tolerance_for(self, tensor: str) -> Tolerance:
        """The rule an output (or a gradient ``d<input>``) is compared with."""
        return self.tolerances.get(tensor, self.tolerance)


class TaskSpecError(CodaError, ValueError):
    """A task file that cannot be used; the message names file, field and fix."""


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


def todo_fields(raw: Any, where: str = "") -> list[tuple[str, str]]:
    """(field, text) of every value still marked ``TODO ...``, in file order."""
    if isinstance(raw, str):
        return [(where or "(top level)", raw)] if raw.strip().startswith(TODO) else []
    if isinstance(raw, dict):
        return [f for k, v in raw.items() for f in todo_fields(v, f"{where}.{k}" if where else str(k))]
    if isinstance(raw, list):
        return [f for i, v in enumerate(raw) for f in todo_fields(v, f"{where}[{i}]")]
    return []


def load_task(path: str | Path) -> Task:
    """Load and validate one task YAML; errors name the file, field and fix."""
    path = Path(path)
    if not path.is_file():
        raise TaskSpecError(f"{path}: no such task file (give a task YAML, e.g. "
                            "tasks/llama3/swiglu_fwd.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskSpecError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise TaskSpecError(f"{path}: a task file is a YAML mapping with name, summary, inputs, ...")
    todos = todo_fields(raw)
    if todos:
        raise TaskSpecError("\n".join(f"{path}: {field}: still {text.strip()}; fill it in"
                                      for field, text in todos))
    try:
        spec = TaskSpec.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field; remove it or fix its spelling"
            elif err["type"] == "missing":
                msg = "required field is missing; add it"
            lines.append(f"{path}: {loc}: {msg}")
        raise TaskSpecError("\n".join(lines)) from None
    except ExprError as e:
        raise TaskSpecError(f"{path}: {e}") from None
    task = Task(spec, path)
    task.reference_fn  # import now: a broken reference is a broken spec
    task.backward_reference_fn
    expert = task.expert_path
    if expert is not None and not expert.is_file():
        raise TaskSpecError(f"{path}: expert: {expert} does not exist; point it at the task's "
                            "human-written program, or remove the field (a task needs no expert)")
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
