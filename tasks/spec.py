"""Task specs: what the LLM is asked to solve, as YAML validated by pydantic.

A task names its tensors with *symbolic* shapes (``[T, H]``, ``[H, 2*I]``) and
binds the symbols per named shape set (``small``, ``ragged``, ``llama3-1b``,
...).  Shape and scale expressions are tiny arithmetic over those symbols,
parsed with :mod:`ast` (never ``eval``): ``+ - * / // **``, parentheses,
integers, floats and ``sqrt``/``ceil``.

The PyTorch reference is ``module:function`` taking the inputs (and params) as
keyword arguments and returning ``{output_name: tensor}``.  Backward is
autograd through the reference unless ``backward_reference`` is given.

Every validation error names the file, the field and the fix
(:class:`TaskSpecError`), because task files are written by people in a hurry.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DTYPES = ("bf16", "fp16", "fp32", "int32", "int64")

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
    tree = parse_expr(text)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS}


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Init(_Strict):
    """How the verifier draws a fresh input (never zeros)."""

    dist: Literal["normal", "uniform", "randint", "arange_rows", "ones_plus_noise"] = "normal"
    scale: Expr = 1.0  # std for normal, half-width for uniform, noise std for ones_plus_noise
    high: Expr | None = None  # exclusive upper bound for randint

    @field_validator("scale", "high")
    @classmethod
    def _check_expr(cls, v: Expr | None) -> Expr | None:
        if v is not None:
            parse_expr(v)
        return v


class TensorSpec(_Strict):
    shape: list[Expr]
    dtype: Literal["bf16", "fp16", "fp32", "int32", "int64"] = "bf16"
    init: Init = Init()
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
    dtype; and ||out - ref_hi|| / ||ref_hi|| <= rel_norm.
    """

    rule: Literal["coda"] = "coda"
    factor: float = 2.0
    floor: float = 1e-6
    rel_norm: float = 2e-2


class Target(_Strict):
    vs_gemm: float = 1.05  # fused time / plain GEMM time, at most
    vs_compile: float = 1.2  # torch.compile time / fused time, at least


class TaskSpec(_Strict):
    name: str
    summary: str
    families: list[Literal["elementwise", "pairwise", "vector", "tile", "reduction", "stateful"]]
    inputs: dict[str, TensorSpec]
    params: dict[str, float | int] = Field(default_factory=dict)
    outputs: dict[str, TensorSpec]
    shapes: dict[str, dict[str, int]]
    reference: str
    backward_reference: str | None = None
    gradients: list[str] = Field(default_factory=list)
    tolerance: Tolerance = Tolerance()
    baselines: list[Literal["gemm", "eager", "compile", "liger"]] = Field(
        default_factory=lambda: ["gemm", "eager", "compile"])
    target: Target = Target()
    expert: str
    # The GEMMs the math needs, as [M, N, K] expressions: the speed of light.
    gemms: list[list[Expr]]
    cpu_shape_set: str = "small"

    @field_validator("reference", "backward_reference")
    @classmethod
    def _check_ref(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"{v!r} must be 'module:function', e.g. "
                             "'coda_agent.tasks.llama3.references:swiglu_fwd'")
        return v

    @model_validator(mode="after")
    def _check_symbols(self) -> "TaskSpec":
        used: set[str] = set()
        for t in [*self.inputs.values(), *self.outputs.values()]:
            for e in t.shape:
                used |= expr_symbols(e)
        for g in self.gemms:
            if len(g) != 3:
                raise ValueError(f"gemms entry {g} must be [M, N, K]")
            for e in g:
                used |= expr_symbols(e)
        if not self.shapes:
            raise ValueError("shapes: give at least the 'small' shape set")
        for set_name, binding in self.shapes.items():
            missing = used - set(binding)
            if missing:
                raise ValueError(f"shapes.{set_name} does not bind {sorted(missing)}; add them")
        if self.cpu_shape_set not in self.shapes:
            raise ValueError(f"cpu_shape_set {self.cpu_shape_set!r} is not one of the shape sets "
                             f"{sorted(self.shapes)}")
        for g in self.gradients:
            if g not in self.inputs:
                raise ValueError(f"gradients: {g!r} is not an input (inputs: {sorted(self.inputs)})")
        overlap = set(self.inputs) & set(self.params)
        if overlap:
            raise ValueError(f"{sorted(overlap)} are both inputs and params; rename one")
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


class TaskSpecError(ValueError):
    """A task file that cannot be used; the message names file, field and fix."""


class Task:
    """A loaded spec plus where it came from (to resolve the expert program)."""

    def __init__(self, spec: TaskSpec, path: Path):
        self.spec = spec
        self.path = path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expert_path(self) -> Path:
        return (self.path.parent / self.spec.expert).resolve()

    @cached_property
    def reference_fn(self) -> Callable[..., dict]:
        return _import_ref(self.spec.reference, self.path, "reference")

    @cached_property
    def backward_reference_fn(self) -> Callable[..., dict] | None:
        if self.spec.backward_reference is None:
            return None
        return _import_ref(self.spec.backward_reference, self.path, "backward_reference")

    def reference_source(self) -> str:
        import inspect

        src = inspect.getsource(self.reference_fn)
        if self.backward_reference_fn is not None:
            src += "\n\n" + inspect.getsource(self.backward_reference_fn)
        return src

    def __repr__(self) -> str:
        return f"Task({self.name!r}, {str(self.path)!r})"


def _import_ref(target: str, path: Path, field: str) -> Callable[..., dict]:
    mod_name, fn_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the spec's problem
        raise TaskSpecError(f"{path}: {field}: cannot import module {mod_name!r} "
                            f"({type(e).__name__}: {e}); fix the module path") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise TaskSpecError(f"{path}: {field}: {mod_name!r} has no function {fn_name!r}; "
                            "fix the function name")
    return fn


def load_task(path: str | Path) -> Task:
    """Load and validate one task YAML; errors name the file, field and fix."""
    path = Path(path)
    if not path.is_file():
        raise TaskSpecError(f"{path}: no such task file (give a .yaml under tasks/, "
                            "e.g. tasks/llama3/swiglu_fwd.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskSpecError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise TaskSpecError(f"{path}: a task file is a YAML mapping with name, summary, inputs, ...")
    try:
        spec = TaskSpec.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"]
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
    if not task.expert_path.is_file():
        raise TaskSpecError(f"{path}: expert: {task.expert_path} does not exist; "
                            "point it at the task's human-written program")
    return task


def load_suite(directory: str | Path) -> list[Task]:
    directory = Path(directory)
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise TaskSpecError(f"{directory}: no task files (*.yaml) here")
    return [load_task(f) for f in files]
