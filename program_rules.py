"""The rules of an epilogue program, as data: one table, read twice.

The catalogue text the model reads (``primitives/catalogue.py``) renders these
rules, and the verifier's static stage (``verifier/static.py``) takes its
allow-lists from :func:`static_allow_list`: what the model is told and what the
judge accepts are one table, so they cannot disagree.

What lives here:

- :data:`API`: every name a program may import from ``coda_agent.primitives``,
  grouped by what it is; :data:`PROGRAM_API` flattens it; :data:`HARNESS_ONLY`
  are catalogue names for the verifier, not for programs.
- :data:`TENSOR_ATTRIBUTES`, :data:`TENSOR_METHODS`, :data:`CONTAINER_METHODS`:
  what host code (``forward``/``backward``) may touch on a value the catalogue
  did not make; anything else on a tensor is PyTorch compute.
- :data:`HOST_RULES`: the host-side grammar, one rule per construct.
- :data:`RAGGED_LANES`: what each reduction and stateful op does with the padded
  lanes of a ragged last tile (the kernel's truth, which the CPU reference
  lowering does not show: it folds the real extent only).
- :data:`CONFIG_CASES`: the calls whose ``config=None`` tile the catalogue text
  states; the tiles themselves are computed from ``primitives/gemm.py``
  ``default_config`` when the text is rendered, so the text is the code's.

This module imports nothing from the package, so the static stage reads it
without importing the catalogue (and quack).
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOGUE_MODULE = "coda_agent.primitives"
MATH_MODULE = "math"  # `import math` / `from math import ...`: host-side arithmetic on numbers

API: dict[str, tuple[str, ...]] = {
    "declaring an epilogue": ("epilogue",),
    "the mainloop": ("gemm", "TileConfig"),
    "passes without a GEMM": ("tile_pass", "vector_pass"),
    "operand kinds": ("Tile", "RowVec", "ColVec", "Scalar", "PairedTile", "HeadStat"),
    "reductions and stateful transforms": ("col_sum", "col_max", "row_sum", "col_amax", "row_amax", "head_rstd",
                                           "online_lse", "select_col"),
    "math inside epilogue fns": ("unpack", "pack", "exp", "exp2", "log", "rsqrt", "sqrt", "reciprocal", "tanh",
                                 "tanh_fast", "sin", "cos", "sigmoid", "silu", "gelu_tanh", "erf", "gelu", "expm1",
                                 "sigmoid_grad", "silu_grad", "tanh_grad", "gelu_tanh_grad", "gelu_grad", "round_bf16",
                                 "round_fp16", "maximum", "minimum", "where", "fma"),
    "auxiliary kernels and layout helpers": ("rms_rstd", "rms_prepare", "xent_loss", "xent_grad_",
                                             "column_index", "to_fp32", "interleave_columns",
                                             "deinterleave_columns", "zeros_like", "zeros", "broadcast", "pad", "add",
                                             "concat_rows"),
    "LayerNorm": ("row_stats", "layernorm_stats", "layernorm_fold", "normalize_rows"),
    "fp8": ("quantize_rows", "quantize_both"),
}
PROGRAM_API: tuple[str, ...] = tuple(name for names in API.values() for name in names)
# The catalogue calls a module-level constant may make: declarations, which hold no tensor
# (``SQ = col_sum()``, ``CFG = TileConfig(...)``).  A tensor made at module level (``zeros(...)``)
# is state that survives between calls.
DECLARATIONS: tuple[str, ...] = (*API["reductions and stateful transforms"], *API["operand kinds"], "TileConfig")
HARNESS_ONLY: tuple[str, ...] = ("load_program", "lowering", "compile_only", "launch_ledger", "CatalogueError")

# On a tensor (or any value the catalogue did not return as a catalogue object), host code may
# read these attributes and call these methods: metadata and free views, never compute.
TENSOR_ATTRIBUTES: tuple[str, ...] = ("shape", "dtype", "ndim", "device", "T", "mT")
TENSOR_METHODS: tuple[str, ...] = ("t", "view", "size", "dim")
# On the dicts and lists a function builds, and on `saved` (read only).
CONTAINER_METHODS: tuple[str, ...] = ("items", "keys", "values", "get", "append")
# The builtins a program may name; the static stage refuses every other one, and a loaded
# program's module sees only these (``primitives/program.py``), so a name the static stage
# resolved wrongly still finds no ``eval`` or ``getattr`` when it runs.
BUILTINS: frozenset[str] = frozenset({
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "int", "isinstance", "len", "list", "max",
    "min", "pow", "print", "range", "reversed", "round", "sorted", "sum", "tuple", "zip", "None", "True", "False",
    "ArithmeticError", "AssertionError", "NotImplementedError", "RuntimeError", "TypeError", "ValueError"})
MESSAGE_BUILTINS: frozenset[str] = frozenset({"str", "repr", "format"})  # text, only inside an error's message


@dataclass(frozen=True)
class Rule:
    construct: str
    rule: str


def _dotted(names: tuple[str, ...], call: bool) -> str:
    return ", ".join(f"`.{n}()`" if call else f"`.{n}`" for n in names)


HOST_RULES: tuple[Rule, ...] = (
    Rule("imports", f"`from {CATALOGUE_MODULE} import NAME, ...` (the names below) and `import math` / "
                    "`from math import ...`; nothing else."),
    Rule("module level", "the docstring, imports, `def`s, and constants: numbers, strings, tuples of them, "
                         "arithmetic over them, `math` calls (`GELU_C = math.sqrt(2 / math.pi)`) and catalogue "
                         "declarations (`SQ = col_sum()`: reductions, operand kinds, `TileConfig`). No module-level "
                         "dict, list, set or tensor: state that survives between calls is the cached-output cheat "
                         "(the verifier also checks that a call leaves the module's values as it found them). No "
                         "assignment expressions (`:=`) anywhere."),
    Rule("functions", "`forward(<inputs and params by name>)` returns a dict holding every task output (extra "
                      "entries are state for backward); `backward(saved, d<output>...)` returns `d<input>` for "
                      "each task gradient; `saved` holds forward's inputs and params by name and "
                      "whatever else forward returned. Params are values of the call: the verifier varies the "
                      "float ones between draws, so pass them on (a `Scalar` operand, `rms_rstd(..., eps)`, "
                      "`head_rstd()` with `rstd=(head_dim, eps)`) and never write their values into the "
                      "program. A backward that adds a parameter `needs` is passed the set of "
                      "`d<input>` names its caller reads and may skip the rest (`if \"dw\" in needs:` "
                      "around a frozen weight's gradient GEMM); each set a caller may ask for is verified. "
                      "Helper `def`s are fine. Default arguments are constants. "
                      "`@epilogue` fns are declared at module level, never inside a function. Their body "
                      "(and any helper it calls) applies operators (`+ - * / **`, comparisons) and the "
                      "catalogue's math functions to its values, nothing else: no attributes (`.dtype`), "
                      "slices, `len` or `str` of them (the compiled kernel's values have none)."),
    Rule("control flow", "`for` over `range(...)` or over a list (e.g. token chunks), `if` on Python values "
                         "(shapes, params), `assert`, `return`; Python builtins on numbers (`len`, `min`, `max`, "
                         "`int`, `range`, `zip`, `enumerate`). No `try`, `with`, classes, `global`/`nonlocal`, "
                         "`async`, dunder names. No value read as text (`str()`, f-strings, `%`) but in an "
                         "`assert` message or a `raise`: a program computes the same on every device and rank."),
    Rule("containers", "dicts and lists the function builds itself (`outs = {}`, `parts = []`, "
                       f"{_dotted(CONTAINER_METHODS, True)}); item assignment only into those, never into an "
                       "input, `saved` or a tensor."),
    Rule("tensors", f"read {_dotted(TENSOR_ATTRIBUTES, False)} (`.device` only as a catalogue call's argument: "
                    f"`column_index(n, x.device)`); call {_dotted(TENSOR_METHODS, True)}; slice with "
                    "ints and ranges (`x[r0:r1]`, `w[:, c0:c1]`: views, no copy). Anything else on a tensor "
                    "(`+`, `.float()`, `.sum()`, `torch.*`) is PyTorch compute: rejected statically, or by the "
                    "reference stage's audit of the program's own lines."),
    Rule("gemm operands", "A is (M, K) and B is (K, N), bf16 or fp16; either may be a transposed view: "
                          "`gemm(x, w.t(), ...)` for a weight stored (N, K), `gemm(dy.t(), x)` for the weight "
                          "gradient dy^T @ x. Operands are passed by the names the epilogue declares."),
    Rule("gemm results", "a dict: `'D'` (unless the epilogue returns no D), each declared output and each "
                         "finished reduction. With `accumulate_into=buf` (an (M, N) tensor, e.g. a slice of a "
                         "`zeros_like` buffer) D is added into `buf` in place and `'D'` is `buf` itself; with "
                         "`out=buf` D is written over `buf` (D's shape and dtype; a buffer dead after this GEMM, "
                         "which may be a Tile or the PairedTile the epilogue reads, never A or B, and never one of the "
                         "task's inputs); either way the "
                         "epilogue must return a D. Results are dense row-major tensors: a column slice of "
                         "one GEMM's D is a view, not a result (run one GEMM per part, over the weight's "
                         "row slices)."),
    Rule("what is checked", "every output and gradient against the task's reference, on the task's shape sets "
                            "and sizes the task file does not hold (past its largest CPU set, and a token count "
                            "that is odd and below its smallest), on inputs at their drawn scale, with rows and "
                            "whole tensors scaled up to 2^12 and down to 2^-12 (zero rows, negated rows, "
                            "centres moved), norm weights, scales, tables and biases of any size and sign, zeros "
                            "included, packed sequences' positions, the float params varied, and the "
                            "forward alone as well as with its backward. Write the math, not a fit to the draws."),
)


@dataclass(frozen=True)
class RaggedLanes:
    op: str
    rule: str


_PADDED = ("there `acc` is 0 and so are Tile loads (vector and Scalar operands need not be), so return 0 "
           "there: a product with `acc` or with a Tile is. A constant term (`acc + 1.0`, `exp(acc)`, "
           "`sigmoid(acc)`) is added once per padded lane: wrong on ragged shapes only, which the CPU reference "
           "stage (exact over the real extent) cannot show")
RAGGED_LANES: tuple[RaggedLanes, ...] = (
    RaggedLanes("col_sum", "folds every lane of the row's last N tile, padded lanes included: " + _PADDED + "."),
    RaggedLanes("col_sum(partials=True)", "the same per N tile: the last tile's partial includes its padded "
                                          "lanes."),
    RaggedLanes("row_sum", "folds every lane of the column's last M tile, padded rows included: " + _PADDED + "."),
    RaggedLanes("col_max", "padded lanes are masked to -inf: any value is safe."),
    RaggedLanes("col_amax, row_amax", "fold every lane of the last tile, padded lanes included (their 0 is the "
                                      "identity of a largest absolute value): " + _PADDED + "."),
    RaggedLanes("online_lse", "padded lanes are masked to -inf: any value is safe (an unaligned vocabulary "
                              "is fine)."),
    RaggedLanes("select_col", "reads only column `index[m]`; a row whose index is outside [0, N) gets 0.0."),
    RaggedLanes("tile_pass", "a pass's fn runs over whole tiles as a GEMM epilogue does, with no `acc`: in "
                             "padded lanes its Tile loads are 0 and its vector operands need not be, so each "
                             "reduction above holds for it with `acc` left out."),
    RaggedLanes("head_rstd", "whole heads only: N and the tile width are multiples of the head width, so no head "
                             "straddles the edge."),
)


@dataclass(frozen=True)
class ConfigCase:
    """A ``gemm`` call whose ``config=None`` tile the catalogue text states: ``epilogue`` is one of
    ``primitives/catalogue.py``'s sample epilogues (None: a plain GEMM); ``tile_pass``: the
    epilogue runs as a ``tile_pass`` (no GEMM)."""

    what: str
    epilogue: str | None
    m: int
    n: int
    tile_pass: bool = False


CONFIG_CASES: tuple[ConfigCase, ...] = (
    ConfigCase("a plain GEMM, 16384 x 4096", None, 16384, 4096),
    ConfigCase("a plain GEMM whose N the 192 tile pads, 16384 x 1024", None, 16384, 1024),
    ConfigCase("an elementwise epilogue, 16384 x 14336", "elementwise", 16384, 14336),
    ConfigCase("the same epilogue at a small shape set's 256 x 384 (few tiles: what the compile stage "
               "compiles)", "elementwise", 256, 384),
    ConfigCase("an output at most 128 wide, 16384 x 128", "elementwise", 16384, 128),
    ConfigCase("an output at most 64 wide, 16384 x 64", "elementwise", 16384, 64),
    ConfigCase("a PairedTile epilogue, 16384 x 14336", "paired", 16384, 14336),
    ConfigCase("exposed partials, col_sum(partials=True), 16384 x 4096", "partials", 16384, 4096),
    ConfigCase("a head statistic of 128-wide heads, 16384 x 4096", "head", 16384, 4096),
    ConfigCase("reductions in both directions (a row_sum and a col_sum), 16384 x 16384", "both", 16384, 16384),
    ConfigCase("a tile_pass the pass kernel does not stream (a PairedTile, fp8 outputs, partials), on quack's "
               "zero mainloop, 16384 x 16384", "pass", 16384, 16384, tile_pass=True),
)


@dataclass(frozen=True)
class StaticAllowList:
    """What the static stage accepts, all of it from the tables above."""

    catalogue_module: str
    math_module: str
    program_api: frozenset[str]
    harness_only: frozenset[str]
    attributes: frozenset[str]  # readable on non-catalogue values
    methods: frozenset[str]  # callable on non-catalogue values
    declarations: frozenset[str]  # catalogue calls a module-level constant may make
    epilogue_math: frozenset[str]  # catalogue calls an @epilogue fn's body may make


def static_allow_list() -> StaticAllowList:
    return StaticAllowList(CATALOGUE_MODULE, MATH_MODULE, frozenset(PROGRAM_API), frozenset(HARNESS_ONLY),
                           frozenset(TENSOR_ATTRIBUTES), frozenset(TENSOR_METHODS + CONTAINER_METHODS),
                           frozenset(DECLARATIONS), frozenset(API["math inside epilogue fns"]))
