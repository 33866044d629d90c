"""The ``@epilogue`` decorator: one Python fn over the accumulator, validated
once, lowered twice.

Contract, as one signature::

    @epilogue(outputs={"h": "bf16"}, reductions={"sqsum": col_sum()}, pairs=None)
    def fn(acc, residual: Tile, gamma: RowVec) -> {"D": ..., "h": ..., "sqsum": ...}

- ``acc`` is the fp32 accumulator element of C = A @ B; every other parameter
  is an operand whose kind (``Tile``, ``RowVec``, ``ColVec``, ``Scalar``,
  ``PairedTile``) is *declared* by its annotation.  Operands, outputs and
  reductions have distinct names, none of them ``acc``, ``D`` or ``c`` (``c``
  is quack's name for its C operand, which a PairedTile is passed as), and no
  operand is named as a parameter of ``gemm`` or ``tile_pass`` (``out``,
  ``config``, ...), since operands are passed by name beside those.
- A fn without ``acc`` (every parameter an operand) is a *pass*: it runs over
  tiles without a GEMM (``tile_pass``: the dGELU of an incoming gradient, the
  row statistics of an input) or over per-row / per-column vectors
  (``vector_pass``: coefficients computed once per row instead of once per
  element); ``gemm`` refuses it, and the passes refuse a fn that reads
  ``acc``, so a zero accumulator is never mistaken for data.
- The fn returns a dict: ``"D"`` (the GEMM's main output, in ``gemm``'s
  ``out_dtype``; leave it out and no D is written at all), one entry per
  declared extra output (stored at its own dtype) and one per declared
  reduction (the per-element value the reduction folds).
- Pairs: ``pairs="acc"`` makes adjacent accumulator columns (2j, 2j+1) one
  Pair: ``g, u = unpack(acc)``; D must then be ``pack(a, b)`` (full width) and
  extra outputs are half width (SwiGLU forward, RoPE).  A ``PairedTile``
  operand (the saved 16-bit pre-activation at twice the GEMM width) arrives as a
  Pair and D is ``pack(dg, du)`` at that tensor's width (SwiGLU backward).
  Reductions in a paired epilogue: ``col_sum()``/``col_max()``/``col_amax()``
  (the lanes of a returned Pair fold into one value per row), ``row_amax()``
  (one value per pair column, the extra outputs' width), and beside a
  PairedTile also ``row_sum()``, one value per pair (per accumulator column): a
  gated backward's bias gradients, one ``row_sum`` for each lane's value.
- The body is straight-line math: no ``if``/``for``/``while``, conditional
  expressions, ``and``/``or``, ``try``, comprehensions or nested functions.  The
  GPU lowering traces it once per element; a Python branch on a traced value
  cannot be traced.  Use ``where(cond, a, b)``.

Validation happens here, at decoration time, so a broken program fails when it
is loaded, with the line: the annotations, the body's AST, and a dry run of the
fn on tiny fp32 tensors through the reference semantics that checks the
returned keys against the declaration.

Every epilogue is registered under a :attr:`Epilogue.key` (its name and a
digest of its source, declaration and the values its body reads from outside),
because ``gemm`` runs as the ``coda::gemm`` custom op and an op's arguments are
tensors, numbers and strings: the op carries the key, and the launch looks the
epilogue up (:func:`registered`).  Equal keys mean the same kernel, so a
program loaded twice registers once.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from coda_agent.syntax import parse
from .errors import CatalogueError
from .operands import KINDS, OUTPUT_DTYPES, HeadStat, Kind, PairedTile
from .pair import Pair
from .reductions import HeadRms, Reduction, positive_eps

RESERVED = {"acc", "D", "c"}
# Why: what the error says and the @epilogue contract documents.
RESERVED_WHY = ("acc is the accumulator, D the main output, c quack's name for its C operand, which a "
                "PairedTile is passed as")
# gemm's, tile_pass's and vector_pass's own parameters: an operand of one of these names could never be
# passed (``out=`` would be taken as the destination), so it is refused where it is declared.
CALL_KEYWORDS = {"A", "B", "epilogue", "out_dtype", "config", "accumulate_into", "out", "fast_accum"}

_BANNED_NODES: dict[type, str] = {
    ast.If: "an `if` statement",
    ast.IfExp: "a conditional expression (`a if c else b`)",
    ast.BoolOp: "`and`/`or`",
    ast.For: "a `for` loop",
    ast.While: "a `while` loop",
    ast.Try: "`try`",
    ast.ListComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.GeneratorExp: "a comprehension",
    ast.FunctionDef: "a nested function",
    ast.Lambda: "a lambda",
    ast.Global: "`global`",
    ast.Nonlocal: "`nonlocal`",
    ast.With: "`with`",
    ast.Import: "an import",
    ast.ImportFrom: "an import",
}


@dataclass
class Epilogue:
    """A validated epilogue program: the fn plus its declarations."""

    fn: Callable
    operands: dict[str, type[Kind]]
    outputs: dict[str, torch.dtype]
    reductions: dict[str, Reduction]
    pairs: str | None  # None | "acc" | name of the PairedTile operand
    head_stats: dict[str, HeadRms] = field(default_factory=dict)
    stores_d: bool = True
    reads_acc: bool = True  # False: a pass over tiles or vectors, not a GEMM epilogue
    line: int | None = None
    key: str = ""  # the name the coda::gemm op knows it by (see the module docstring)
    _lowered: dict = field(default_factory=dict, repr=False)  # per-lowering cache (cute EpiMods)

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def pairs_acc(self) -> bool:
        """Adjacent accumulator columns form one Pair (``pairs="acc"``)."""
        return self.pairs == "acc"

    @property
    def paired_operand(self) -> str | None:
        """The PairedTile operand the epilogue reads its Pairs from, if any."""
        return None if self.pairs in (None, "acc") else self.pairs

    @property
    def mode(self) -> str:
        """quack's name for the pairing mode."""
        if self.pairs is None:
            return "element"
        return "acc_pair" if self.pairs_acc else "packed_cd_b16x2"

    def d_shape(self, m: int, n: int) -> tuple[int, int]:
        """D's shape for an (M, N) GEMM: a PairedTile epilogue writes D at that tile's width."""
        return (m, 2 * n) if self.paired_operand else (m, n)

    def output_width(self, n: int) -> int:
        """Columns of each extra output: one per Pair when the accumulator is paired."""
        return n // 2 if self.pairs_acc else n

    @property
    def index_operands(self) -> tuple[str, ...]:
        """Int operands consumed by select_col reductions (the fn never sees them)."""
        return tuple(r.index for r in self.reductions.values() if r.index is not None)

    def call_eps(self, operands: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
        """(``operands`` with a head statistic's head width alone, the eps the call gives it).
        A head statistic declared without eps (``head_rstd()``) takes it at the call,
        ``rstd=(head_dim, eps)``; the launch runs :meth:`with_head_eps` of it.  None: no
        head statistic, or one whose declaration fixes eps."""
        if not self.head_stats:
            return operands, None
        (name, stat), = self.head_stats.items()  # the decorator allows one
        value = operands.get(name)
        if stat.eps is not None:
            if isinstance(value, tuple):
                raise CatalogueError(f"gemm: head statistic {name!r} fixes eps={stat.eps:g} in its declaration; "
                                     f"pass the head width alone ({name}=head_dim), or declare head_rstd() "
                                     f"without eps and pass {name}=(head_dim, eps) to take eps from the call")
            return operands, None
        if not (isinstance(value, tuple) and len(value) == 2):
            raise CatalogueError(f"gemm: head statistic {name!r} is declared head_rstd() without eps, so the call "
                                 f"gives it with the head width: gemm(..., {name}=(head_dim, eps)); got {value!r}")
        return {**operands, name: value[0]}, positive_eps(value[1], f"gemm: head statistic {name!r}")

    def with_head_eps(self, eps: float | None) -> "Epilogue":
        """This epilogue with a call's eps declared (:meth:`call_eps`): one kernel per distinct
        eps, made once, under a key of its own.  It is made inside the launch op, which
        torch.compile does not trace, so a new eps under compile is no graph break."""
        if eps is None:
            return self
        derived = self._lowered.get(("eps", eps))
        if derived is None:
            (name, stat), = self.head_stats.items()
            derived = dataclasses.replace(self, head_stats={name: HeadRms(eps, stat.save)}, _lowered={})
            derived.key = f"{self.key}@eps={eps!r}"
            self._lowered[("eps", eps)] = derived
        return derived

    def tile_arguments(self, acc: torch.Tensor, operands: dict[str, Any]) -> dict[str, Any]:
        """The fn's keyword arguments for one call on the whole fp32 (M, N)
        accumulator ``acc`` (the reference lowering and the dry run)."""
        args: dict[str, Any] = {}
        if self.reads_acc:
            args["acc"] = Pair.of_columns(acc) if self.pairs_acc else acc
        for name, kind in self.operands.items():
            args[name] = kind.reference_argument(operands[name], acc, self.pairs_acc,
                                                 self.head_stats.get(name))
        return args

    def result_buffers(self, m: int, n: int, operands: dict[str, Any], out_dtype: torch.dtype, tiles: int,
                       device: torch.device, dest: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Everything an (M, N) gemm with this epilogue returns, allocated (uninitialised but
        for select_col's pre-fill): ``D`` (``dest`` when given; none when the fn returns no D),
        the extra outputs, the saved head statistics, the reductions (over ``tiles`` N tiles)."""
        bufs = {}
        if dest is not None:
            bufs["D"] = dest
        elif self.stores_d:
            bufs["D"] = torch.empty(self.d_shape(m, n), dtype=out_dtype, device=device)
        width = self.output_width(n)
        for name, dtype in self.outputs.items():
            bufs[name] = torch.empty(m, width, dtype=dtype, device=device)
        for name, stat in self.head_stats.items():
            if stat.save:
                bufs[name] = torch.empty(m, n // operands[name], dtype=torch.float32, device=device)
        for name, red in self.reductions.items():
            bufs[name] = red.result_buffer(m, width, tiles, device)
        return bufs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        how = f"gemm(A, B, {self.name}, ...)" if self.reads_acc else f"tile_pass({self.name}, ...)"
        raise CatalogueError(f"epilogue {self.name!r} is not called directly; pass it to {how}")

    def __repr__(self) -> str:
        return f"<epilogue {self.name} operands={ {k: v.name for k, v in self.operands.items()} }>"


def _fn_line(fn: Callable, node: ast.AST | None = None) -> int | None:
    first = fn.__code__.co_firstlineno
    if node is None:
        return first
    # The parsed source starts at the decorator line (co_firstlineno).
    return first + getattr(node, "lineno", 1) - 1


def _check_body(fn: Callable) -> None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return  # no source (interactive); the dry run still validates behaviour
    tree = parse(source)
    fdef = tree.body[0]
    for node in ast.walk(fdef):
        if node is fdef:
            continue
        what = _BANNED_NODES.get(type(node))
        if what is not None:
            hint = ("use where(cond, a, b) for a data-dependent choice" if isinstance(
                node, (ast.If, ast.IfExp, ast.BoolOp)) else "write straight-line math")
            raise CatalogueError(
                f"epilogue {fn.__name__!r}: {what} is not allowed in an epilogue fn (it is traced "
                f"once per element on the GPU); {hint}", line=_fn_line(fn, node))


def _resolve_kind(fn: Callable, pname: str, ann: Any) -> type[Kind]:
    if isinstance(ann, str):
        kind = KINDS.get(ann.split(".")[-1])
    elif isinstance(ann, type) and issubclass(ann, Kind):
        kind = ann
    else:
        kind = None
    if kind is None:
        shown = "nothing" if ann is inspect.Parameter.empty else repr(ann)
        raise CatalogueError(
            f"epilogue {fn.__name__!r}: operand {pname!r} must declare its kind, e.g. "
            f"`{pname}: Tile` (one of {', '.join(KINDS)}); got {shown}", line=_fn_line(fn))
    return kind


def epilogue(outputs: dict[str, str] | None = None,
             reductions: dict[str, Reduction] | None = None,
             pairs: str | None = None,
             head_stats: dict[str, HeadRms] | None = None) -> Callable[[Callable], Epilogue]:
    """Declare an epilogue fn (see the module docstring for the contract)."""
    outputs = dict(outputs or {})
    reductions = dict(reductions or {})
    head_stats = dict(head_stats or {})

    def wrap(fn: Callable) -> Epilogue:
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise CatalogueError("@epilogue decorates a plain function `def fn(acc, ...)`")
        line = _fn_line(fn)
        params = list(inspect.signature(fn).parameters.values())
        if not params:
            raise CatalogueError(f"epilogue {fn.__name__!r} takes no parameters: a GEMM epilogue starts "
                                 "with `acc` (the fp32 accumulator element), a pass takes only operands",
                                 line=line)
        for p in params:
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.default is not p.empty:
                raise CatalogueError(f"epilogue {fn.__name__!r}: parameter {p.name!r} must be a "
                                     "plain name without default, *args or **kwargs", line=line)
        reads_acc = params[0].name == "acc"
        if any(p.name == "acc" for p in params[1:]):
            raise CatalogueError(f"epilogue {fn.__name__!r}: `acc` (the fp32 accumulator element) must be "
                                 "the first parameter", line=line)
        if not reads_acc and (pairs == "acc" or head_stats):
            what = "pairs='acc'" if pairs == "acc" else "head_stats"
            raise CatalogueError(f"epilogue {fn.__name__!r} has no `acc`, so it is a pass without a GEMM, "
                                 f"and {what} reads the accumulator; pair a PairedTile operand instead, "
                                 "or make `acc` the first parameter and run it in a gemm", line=line)
        operands = {p.name: _resolve_kind(fn, p.name, p.annotation) for p in params[1 if reads_acc else 0:]}
        for name, dt in outputs.items():
            if dt not in OUTPUT_DTYPES:
                raise CatalogueError(f"epilogue {fn.__name__!r}: output {name!r} has dtype {dt!r}; "
                                     f"use one of {sorted(OUTPUT_DTYPES)}", line=line)
        for name, red in reductions.items():
            if not isinstance(red, Reduction):
                raise CatalogueError(f"epilogue {fn.__name__!r}: reduction {name!r} must be declared "
                                     "with col_sum(), col_max(), row_sum(), col_amax(), row_amax(), online_lse() or "
                                     "select_col(...)", line=line)
        stat_params = {n for n, k in operands.items() if k is HeadStat}
        for name, stat in head_stats.items():
            if not isinstance(stat, HeadRms):
                raise CatalogueError(f"epilogue {fn.__name__!r}: head_stats[{name!r}] must be declared "
                                     "with head_rstd(eps), or head_rstd() to take eps at the call", line=line)
        if stat_params != set(head_stats):
            raise CatalogueError(
                f"epilogue {fn.__name__!r}: every head_stats entry needs a `name: HeadStat` parameter "
                f"and vice versa (declared {sorted(head_stats)}, parameters {sorted(stat_params)})",
                line=line)
        if len(head_stats) > 1:
            raise CatalogueError(f"epilogue {fn.__name__!r}: at most one head statistic per epilogue",
                                 line=line)
        names = [*operands, *outputs, *reductions]
        reserved = sorted(set(names) & RESERVED)
        if reserved:
            raise CatalogueError(f"epilogue {fn.__name__!r}: {', '.join(map(repr, reserved))} "
                                 f"{'is a reserved name' if len(reserved) == 1 else 'are reserved names'} "
                                 f"({RESERVED_WHY}); rename it, e.g. {reserved[0] + '_'!r}", line=line)
        taken = sorted(set(operands) & CALL_KEYWORDS)
        if taken:
            raise CatalogueError(f"epilogue {fn.__name__!r}: operand {taken[0]!r} has the name of gemm's and "
                                 f"tile_pass's own parameter {taken[0]}=, so it cannot be passed by name; rename "
                                 f"it, e.g. {taken[0] + '_'!r}", line=line)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise CatalogueError(f"epilogue {fn.__name__!r}: {', '.join(map(repr, twice))} used twice; operands, "
                                 "outputs and reductions need distinct names", line=line)
        paired = [n for n, k in operands.items() if k is PairedTile]
        if len(paired) > 1:
            raise CatalogueError(f"epilogue {fn.__name__!r}: at most one PairedTile operand "
                                 f"(got {paired})", line=line)
        if pairs not in (None, "acc"):
            raise CatalogueError(f"epilogue {fn.__name__!r}: pairs= takes 'acc' or nothing "
                                 "(a PairedTile operand declares its own pairing)", line=line)
        if pairs == "acc" and paired:
            raise CatalogueError(f"epilogue {fn.__name__!r}: pairs='acc' and a PairedTile operand "
                                 "cannot be combined", line=line)
        mode_pairs = pairs or (paired[0] if paired else None)
        narrow = sorted(n for n, dt in outputs.items() if dt.startswith("fp8"))
        if mode_pairs is not None and narrow:
            raise CatalogueError(
                f"epilogue {fn.__name__!r}: outputs {narrow} are fp8, but a paired epilogue's stores are "
                "16-bit on SM90 (quack's paired store path); store them as bf16 and quantize_rows() "
                "them, or write them from an element-mode epilogue", line=line)
        if mode_pairs is not None:
            for name, red in reductions.items():
                if not (red.pairable if pairs == "acc" else red.beside_pairs):
                    raise CatalogueError(
                        f"epilogue {fn.__name__!r}: reduction {name!r} ({red.describe()}) is not "
                        "available in a paired epilogue; only col_sum(), col_max(), col_amax() and row_amax() "
                        "are (and row_sum(), one value per pair, beside a PairedTile operand)", line=line)
        _check_body(fn)
        epi = Epilogue(fn=fn, operands=operands,
                       outputs={k: OUTPUT_DTYPES[v] for k, v in outputs.items()},
                       reductions=reductions, pairs=mode_pairs, head_stats=head_stats, reads_acc=reads_acc,
                       line=line)
        epi.stores_d = _dry_run(epi)
        epi.key = _register(epi)
        return epi

    return wrap


_REGISTRY: dict[str, Epilogue] = {}


def registered(key: str) -> Epilogue:
    """The epilogue registered under ``key`` (see the module docstring)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise CatalogueError(f"no epilogue is registered as {key!r} in this process; a compiled graph "
                             "names its epilogues, so load the program that defines it first") from None


def _outside_value(v: Any) -> str:
    """What a value the body reads from outside contributes to its key: numbers and strings
    by value, catalogue math and anything else by type and name."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return repr(v)
    return f"{type(v).__module__}.{type(v).__qualname__}:{getattr(v, 'name', getattr(v, '__name__', ''))}"


def _register(epi: Epilogue) -> str:
    fn = epi.fn
    try:
        body = inspect.getsource(fn)
    except (OSError, TypeError):
        body = fn.__code__.co_code.hex() + repr(fn.__code__.co_consts)
    outside = sorted((n, _outside_value(fn.__globals__[n])) for n in fn.__code__.co_names if n in fn.__globals__)
    cells = [_outside_value(c.cell_contents) for c in fn.__closure__ or ()]
    # In declared order: the op passes operands and results by position.
    declaration = ([(k, v.name) for k, v in epi.operands.items()], [(k, str(v)) for k, v in epi.outputs.items()],
                   [(k, r.describe()) for k, r in epi.reductions.items()], epi.pairs,
                   [(k, repr(v)) for k, v in epi.head_stats.items()], epi.stores_d)
    digest = hashlib.sha256(repr((body, declaration, outside, cells)).encode()).hexdigest()[:16]
    key = f"{epi.name}.{digest}"
    _REGISTRY.setdefault(key, epi)
    return key


def _dry_run(epi: Epilogue) -> bool:
    """Call the fn once on tiny tensors; check the returned keys. Returns whether D is stored."""
    m, n = 2, 4
    # An eps given at each call (head_rstd()) is any positive number here: the dry run checks keys.
    probe = dataclasses.replace(epi, head_stats={k: s if s.eps is not None else HeadRms(1e-6, s.save)
                                                 for k, s in epi.head_stats.items()})
    args = probe.tile_arguments(torch.randn(m, n), {name: kind.dry_run_value(m, n)
                                                    for name, kind in epi.operands.items()})
    try:
        result = epi.fn(**args)
    except CatalogueError as e:
        e.line = e.line or _traceback_line(e, epi)
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the candidate's fn is reported
        raise CatalogueError(f"epilogue {epi.name!r} fails on a dry run: {type(e).__name__}: {e}",
                             line=_traceback_line(e, epi)) from None
    if not isinstance(result, dict):
        raise CatalogueError(f"epilogue {epi.name!r} must return a dict like "
                             "{'D': ..., <outputs>..., <reductions>...}", line=epi.line)
    declared = {*epi.outputs, *epi.reductions}
    unknown = sorted(set(result) - declared - {"D"})
    if unknown:
        raise CatalogueError(f"epilogue {epi.name!r} returns {unknown}, which are not declared; add "
                             "them to outputs={...} or reductions={...}", line=epi.line)
    missing = sorted(declared - set(result))
    if missing:
        raise CatalogueError(f"epilogue {epi.name!r} declares {missing} but does not return them",
                             line=epi.line)
    if epi.pairs is not None and "D" in result and not isinstance(result["D"], Pair):
        raise CatalogueError(f"epilogue {epi.name!r} is paired: return D as pack(a, b)", line=epi.line)
    return "D" in result


def _traceback_line(exc: BaseException, epi: Epilogue) -> int | None:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is epi.fn.__code__:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
