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
   per-row/per-column math on finished statistics (``vector_pass``), and
   LayerNorm's rank-1 form (``layernorm_fold``, ``normalize_rows``);
3. tile load/store: ``Tile`` operands and extra ``outputs`` with their own dtype,
   and epilogues over tiles without a GEMM (``tile_pass``);
4. tile reductions: ``col_sum``, ``col_max``, ``row_sum``, ``col_amax``, ``row_amax`` and the aux kernels
   that finish them (``rms_rstd``, ``layernorm_stats``, ``row_stats``);
   per-head statistics (``head_rstd``);
5. stateful transforms: ``online_lse`` and ``select_col`` across N tiles.

FP8 (:mod:`.fp8`): ``gemm`` on fp8 operands with their scales as vector
operands, fp8 outputs, and ``quantize_rows``/``quantize_both`` (:mod:`.quantize`)
for what no epilogue writes.

Two lowerings (:mod:`.lowering`): ``cute`` (quack's SM90 GEMM + CuTeDSL, on
Hopper; or compile-only for sm_90a on any machine) and ``reference`` (a
PyTorch interpreter, any device).  ``coda-agent catalogue`` renders this API
from the code (:mod:`.catalogue`); the LLM's prompt uses the same text.

Importing the catalogue loads torch and nothing of quack or CuTeDSL, and
changes nothing in the process: the settings quack needs (the compile target
without a GPU, the cubin for the SASS gate, the pipeline-depth guard) are
entered around each compile and launch and undone after it (:mod:`.dsl_scope`).

The modules, each built only on those before it (tests/test_primitives_scope.py
holds them to it): ``errors``, ``version``, ``fp8``, ``dispatch`` -> ``pair`` -> ``reductions`` ->
``operands`` -> ``epilogue`` -> ``tile_config``, ``lowering``, ``math``,
``program``, ``timing`` -> ``reference``, ``dsl_scope``, ``sass`` -> ``cute``, ``pass_kernel`` (with its
CuTeDSL side, ``pass_kernel_dsl``) -> ``tuning``
-> ``gemm`` -> ``passes`` -> ``aux`` (with its Triton kernel, ``xent_triton``), ``quantize``
(with ``quantize_triton``) -> ``norm`` -> ``catalogue``.
"""

# PROGRAM_API, what a program may import, is the rules table's (the static stage enforces the same).
from coda_agent.program_rules import PROGRAM_API

from .aux import (add, broadcast, column_index, concat_rows, deinterleave_columns, interleave_columns, pad,
                  rms_prepare, rms_rstd, to_fp32, xent_grad_, xent_loss, zeros, zeros_like)
from .catalogue import render as render_catalogue
from .dsl_scope import compile_target
from .epilogue import Epilogue, epilogue
from .errors import CatalogueError
from .gemm import gemm
from .lowering import (CompiledKernel, Launch, SassReport, compile_only, current_lowering, launch_ledger, lowering,
                       plain_gemms)
from .math import (cos, erf, exp, exp2, expm1, fma, gelu, gelu_grad, gelu_tanh, gelu_tanh_grad, log, maximum, minimum,
                   reciprocal, round_bf16, round_fp16, rsqrt, sigmoid, sigmoid_grad, silu, silu_grad, sin, sqrt, tanh,
                   tanh_fast, tanh_grad, where)
from .norm import layernorm_fold, layernorm_stats, normalize_rows, row_stats
from .operands import ColVec, HeadStat, PairedTile, RowVec, Scalar, Tile
from .pair import pack, unpack
from .passes import tile_pass, vector_pass
from .program import load_program
from .quantize import quantize_both, quantize_rows
from .reductions import col_amax, col_max, col_sum, head_rstd, online_lse, row_amax, row_sum, select_col
from .tile_config import TileConfig
from .version import CATALOGUE_VERSION

__all__ = [*PROGRAM_API, "CATALOGUE_VERSION", "CatalogueError", "CompiledKernel", "Epilogue", "Launch",
           "SassReport", "compile_only", "compile_target", "current_lowering", "launch_ledger", "load_program",
           "lowering", "plain_gemms", "render_catalogue"]
