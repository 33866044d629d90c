"""Suite B of the LLaMA-3 tasks: QK-norm + RoPE, LM head + cross-entropy (forward,
and the fused training step), the MLP sub-block.

For every task: the spec loads; the expert program passes the static stage; it
matches the task reference on the CPU shape sets under the reference lowering
(forward, and backward against autograd through the reference) by the verifier's
own inputs, references and compare (tests/suite_checks.py); and (slow) every GEMM
of its forward and backward compiles for sm_90a with HGMMA in the SASS and no
register spills beyond those measured harmless on the H200.
"""

from __future__ import annotations

import pytest
import torch
from suite_checks import check_spec, draw, load_expert, problems, run_program, static_violations
from suite_checks import task as _task

from coda_agent.primitives import compile_only

TASKS = ["qk_norm_rope", "lm_head_xent_fwd", "lm_head_xent", "mlp_block", "llama3_block"]
CPU_SETS = ["small", "ragged"]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", TASKS)
def test_spec_loads(name):
    check_spec(name)


@pytest.mark.parametrize("name", TASKS)
def test_expert_is_static_clean(name):
    assert not static_violations(name)


@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_matches_reference(name, shape_set):
    failures = problems(_task(name), shape_set, seed=1234)
    assert not failures, f"{name}/{shape_set}:\n" + "\n".join(failures)


# Spills accepted where an H200 measurement showed the spilling config is still the
# fastest (bench/results/h200-2026-11-29-b/bench-llama3-1b-tuned.json): the logits +
# online-LSE epilogue at 128x192 c2 ran 2.70 ms against 3.64 ms at the spill-free
# 128x128 c1.  Any other spill, or more of this one, fails.
MEASURED_SPILLS = {("logits_lse", "128x192 c2x1 pingpong"): 26}


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_expert_compiles_for_sm90(name):
    task = _task(name)
    prog = load_expert(task)
    inputs, grads = draw(task, "small", seed=7)
    with compile_only() as kernels, torch.no_grad():
        run_program(task, prog, inputs, grads)
    assert kernels, f"{name}: no GEMM compiled"
    seen = set()
    for k in kernels:
        key = (k.epilogue, k.config)
        if key in seen:
            continue
        seen.add(key)
        assert k.sass is not None, "cuobjdump missing (pip install nvidia-cuda-cuobjdump)"
        assert k.sass.sm90a and k.sass.hgmma > 0, f"{name}/{k.epilogue}: no HGMMA in SASS"
        assert k.sass.calls == 0, f"{name}/{k.epilogue} [{k.config}]: {k.sass.calls} slow-path CALLs"
        spills = k.sass.spill_stores + k.sass.spill_loads
        allowed = MEASURED_SPILLS.get((k.epilogue, k.config), 0)
        assert spills <= allowed, f"{name}/{k.epilogue} [{k.config}]: register spills {k.sass}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_on_gpu(name, shape_set):
    """The cute lowering (quack's SM90 GEMM) against the fp64 CPU reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (Hopper)")
    failures = problems(_task(name), shape_set, seed=4321, lowering_name="cute", device="cuda")
    assert not failures, f"{name}/{shape_set} on GPU:\n" + "\n".join(failures)


MUTANTS = [
    # (task, original, mutant): each plausible slip must fail the check.
    ("mlp_block", "hr * rstd * s * inv_dim", "hr * rstd * 0.0 * inv_dim"),  # RMSNorm backward without s
    ("qk_norm_rope", "e * s + o * c", "e * s - o * c"),  # RoPE sign
    ("lm_head_xent", "dloss[r0:r1]", "dloss[0:r1 - r0]"),  # every chunk weighted like the first
    ("llama3_block", '{"s": du * u}', '{"s": du}'),  # QKV-side statistic without the saved output
]


@pytest.mark.parametrize("name,orig,mutant", MUTANTS)
def test_checker_catches_mutant(name, orig, mutant):
    task = _task(name)
    src = task.expert_path.read_text()
    assert orig in src
    assert problems(task, "small", seed=99, source=src.replace(orig, mutant)), f"{name}: mutant passed"
