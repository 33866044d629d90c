"""The catalogue: what an epilogue program is made of.

A program is one Python module that imports only from here.  It declares
epilogue fns with :func:`epilogue` and composes them in ``forward``/``backward``
with :func:`gemm`, the auxiliary kernels and the weight-layout helpers::

    from coda_agent.primitives import epilogue, gemm, Tile, RowVec, col_sum, rms_rstd

    @epilogue(outputs={"h": "bf16"}, reductions={"sqsum": col_sum()})
    def residual_rms(acc, residual: Tile, gamma: RowVec):
        h = acc + residual
        return {"D": h * gamma, "h": h, "sqsum": h * h}

The five CODA families:

1. elementwise and pairwise maps: arithmetic on the fp32 accumulator, the math
   vocabulary in :mod:`.math`, and Pairs of adjacent columns (``unpack``/``pack``);
2. vector load: ``RowVec`` (one value per column) and ``ColVec`` (one per row);
3. tile load/store: ``Tile`` operands and extra ``outputs`` with their own dtype;
4. tile reductions: ``col_sum``, ``col_max``, ``row_sum`` and the aux kernels
   that finish them (``rms_rstd``); per-head statistics (``head_rstd``);
5. stateful transforms: ``online_lse`` and ``select_col`` across N tiles.

Two lowerings (:mod:`.lowering`): ``cute`` (quack's SM90 GEMM + CuTeDSL, on
Hopper; or compile-only for sm_90a on any machine) and ``reference`` (a
PyTorch interpreter, any device).  ``coda-agent catalogue`` renders this API
from the code (:mod:`.catalogue`); the LLM's prompt uses the same text.
"""

import os as _os

# Without a GPU the DSL must be told which architecture to compile for (unset,
# it targets sm_100a and quack's SM90 GEMM refuses it).  Must precede the
# first cutlass import, which the modules below trigger.
if not _os.environ.get("CUDA_VISIBLE_DEVICES", "x") or not _os.path.exists("/dev/nvidia0"):
    _os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    _os.environ.setdefault("QUACK_ARCH", "90")
# Keep the cubin for the SASS gate, with or without a GPU (seen on the H200: without
# it the compile stage there had no cubin to read). The dump directory must exist
# or the DSL silently writes nothing.
_os.environ.setdefault("CUTE_DSL_KEEP", "cubin")
_os.makedirs(_os.environ.setdefault(
    "CUTE_DSL_DUMP_DIR", _os.path.join(__import__("tempfile").gettempdir(), "coda-cutedsl-dump")),
    exist_ok=True)

from .aux import (add, column_index, concat_rows, deinterleave_columns, interleave_columns, rms_prepare,  # noqa: E402
                  rms_rstd, to_fp32, xent_grad_, xent_loss, zeros_like)
from .epilogue import Epilogue, epilogue, pack, unpack  # noqa: E402
from .errors import CatalogueError  # noqa: E402
from .gemm import TileConfig, gemm  # noqa: E402
from .lowering import (CompiledKernel, Launch, SassReport, compile_only, current_lowering,  # noqa: E402
                       launch_ledger, lowering)
from .math import (cos, exp, exp2, fma, gelu_tanh, log, maximum, minimum, reciprocal, rsqrt,  # noqa: E402
                   sigmoid, silu, sin, sqrt, tanh, where)
from .operands import (ColVec, HeadStat, PairedTile, RowVec, Scalar, Tile, col_max, col_sum,  # noqa: E402
                       head_rstd, online_lse, row_sum, select_col)
from .program import load_program  # noqa: E402
from .version import CATALOGUE_VERSION  # noqa: E402


def render_catalogue() -> str:
    """The catalogue as Markdown (signatures, semantics, constraints, examples)."""
    from .catalogue import render

    return render()


# What a program may import (the verifier's static stage enforces it).
PROGRAM_API = (
    "epilogue", "gemm", "TileConfig", "unpack", "pack",
    "Tile", "RowVec", "ColVec", "Scalar", "PairedTile", "HeadStat",
    "col_sum", "col_max", "row_sum", "head_rstd", "online_lse", "select_col",
    "exp", "exp2", "log", "rsqrt", "sqrt", "reciprocal", "tanh", "sin", "cos", "sigmoid", "silu", "gelu_tanh",
    "maximum", "minimum", "where", "fma",
    "rms_rstd", "rms_prepare", "xent_loss", "xent_grad_", "column_index", "to_fp32",
    "interleave_columns", "deinterleave_columns", "zeros_like", "add", "concat_rows",
)

__all__ = [*PROGRAM_API, "CATALOGUE_VERSION", "CatalogueError", "CompiledKernel", "Epilogue", "Launch",
           "SassReport", "compile_only", "current_lowering", "launch_ledger", "load_program",
           "lowering", "render_catalogue"]
