"""Every packaged expert (LLaMA-3, GPT-2, LLaMA-3 FP8) compiles for sm_90a on the CPU,
forward and backward, and passes the verifier's compile-stage gate (tests/suite_checks.py:
``compile_stage``): warpgroup MMAs (HGMMA, QGMMA for fp8) in the SASS, no slow-path CALL,
and register spills only where the H200 measured them harmless.  All marked slow.

One module, so one xdist worker (scripts/test.sh: ``--dist loadfile``) and one process
compile them all: quack keeps every kernel it compiled, keyed on the epilogue's
fingerprint, dtypes, layouts and tile config, so a kernel that several experts share
(every backward's plain GEMMs, a LayerNorm pass, a whole sub-block inside a block task)
is compiled once for the suite, and its SASS read once (primitives/sass.py).
"""

from __future__ import annotations

import pytest
from suite_checks import compile_stage, compiled, sass_problems, task
from test_gpt2_suite import TASKS as GPT2
from test_suite_a import TASKS as LLAMA3_A
from test_suite_b import TASKS as LLAMA3_B
from test_suite_fp8 import TASKS as FP8
from test_suite_fp8 import _task as fp8_task

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- LLaMA-3


@pytest.mark.parametrize("name", LLAMA3_A)
def test_llama3_expert_compiles_one_kernel_per_gemm(name):
    """Suite A: one sm_90a kernel with HGMMA per GEMM of the task, no spills."""
    t = task(name)
    kernels = compiled(t)
    assert len(kernels) == len(t.spec.gemms), [k["epilogue"] for k in kernels]
    assert not sass_problems(name, kernels)


# Spills accepted where an H200 measurement showed the spilling config is still the
# fastest (bench/results/h200-2026-11-29-b/bench-llama3-1b-tuned.json): the logits +
# online-LSE epilogue at 128x192 c2 ran 2.70 ms against 3.64 ms at the spill-free
# 128x128 c1.  Any other spill, or more of this one, fails.
MEASURED_SPILLS = {("logits_lse", "128x192 c2x1 pingpong"): 26}


@pytest.mark.parametrize("name", LLAMA3_B)
def test_llama3_expert_compiles_with_only_measured_spills(name):
    """Suite B: sm_90a with HGMMA, spills only where measured harmless."""
    kernels = compiled(task(name))
    assert kernels, f"{name}: no GEMM compiled"
    assert not sass_problems(name, kernels, MEASURED_SPILLS)


# --------------------------------------------------------------------------- GPT-2

# GEMMs and passes per expert, counted at the CPU shape set: every GEMM of the
# task's speed of light, plus each pass without a GEMM (row statistics, weight
# folds, normalized tensors, tile passes), and nothing else.
GPT2_KERNELS = {
    "out_proj_residual": (3, 1), "gelu_fwd": (1, 0), "gelu_bwd": (1, 0), "linear_gelu": (3, 1),
    "ln_qkv": (3, 3), "residual_layernorm": (2, 1), "layernorm_bwd": (2, 0), "lm_head_xent": (3, 3),
    "mlp_block": (6, 2), "mlp_block_tanh": (6, 2), "gpt2_block": (12, 4), "gelu_mlp": (6, 0), "gelu_tanh_mlp": (6, 0),
    "relu_mlp": (6, 0), "relu2_mlp": (6, 0), "linear_gelu_tanh": (3, 1), "linear_relu": (3, 1),
}
GPT2_PASSES = {"row_moments", "layernorm_fold", "normalize", "bias_grad", "dgelu", "dgelu_tanh", "drelu",
               "ln_grad_stats", "ln_backward"}
# At the CPU shapes' 128x128 tile: dGELU with three reductions keeps 6 values in local
# memory (6 STL + 6 LDL of ~6700 instructions); the H200 run measures what it costs.
GPT2_KNOWN_SPILLS = {"dgelu_stats": 12}


@pytest.mark.parametrize("name", GPT2)
def test_gpt2_expert_compiles_one_kernel_per_gemm_and_pass(name):
    res, kernels = compile_stage(task(name, "gpt2"))
    assert res.status == "passed", res.message
    passes = [k for k in kernels if k.kind == "pass"]
    gemms = len(kernels) - len(passes)
    assert (gemms, len(passes)) == GPT2_KERNELS[name], [(k.epilogue, k.shapes) for k in kernels]
    assert {k.epilogue for k in passes} <= GPT2_PASSES
    assert not sass_problems(name, res.details["kernels"], GPT2_KNOWN_SPILLS)


# --------------------------------------------------------------------------- LLaMA-3 FP8


@pytest.mark.parametrize("name", FP8)
def test_fp8_expert_compiles_with_fp8_warpgroup_mmas(name):
    kernels = compiled(fp8_task(name))
    gemms = [k for k in kernels if k["kind"] == "gemm"]
    assert gemms and all(k["sm90a"] for k in kernels) and all(k["hgmma"] > 0 for k in gemms)
    # the one kernel without a mainloop: llama3_block_fp8's QKV-side statistic (row_dot)
    assert {k["epilogue"] for k in kernels if k["kind"] != "gemm"} <= {"row_dot"}
    # The out-proj/down epilogue of llama3_block_fp8 (fp8 store, amax, sum of squares,
    # a residual tile) spills a little at fast accumulation's pingpong tile (34 STL/LDL
    # at the small shapes); everything else is spill-free.
    spills = {k["epilogue"]: k["spill_stores"] + k["spill_loads"] for k in kernels if k["spill_stores"]}
    assert set(spills) <= {"residual_norm_stats"} and all(n <= 64 for n in spills.values()), spills
