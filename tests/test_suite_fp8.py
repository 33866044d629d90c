"""The FP8 suite (tasks/llama3_fp8): the references' two runs (the exact math, and the
fp8 recipe that sets the noise floor) and what the experts compute besides their
outputs; (GPU tier) every expert is correct on the H200.

Through the verifier on the CPU, with the other suites' experts and one judge
(tests/test_verifier_suite.py): each expert passes the static stage and the
reference stage (the reference lowering against the fp8 reference run and the exact
math, CODA's rule with the task's tolerance, on every CPU shape set), and a program
that drops a scale fails.  The compile stage for sm_90a with warpgroup MMAs (QGMMA)
in the SASS is in tests/test_expert_compiles.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda_agent.tasks import load_task
from coda_agent.tasks.llama3_fp8 import references
from coda_agent.verifier import Verifier, inputs

SUITE = Path(__file__).resolve().parent.parent / "tasks" / "llama3_fp8"
TASKS = ["swiglu_fwd_fp8", "swiglu_bwd_fp8", "mlp_block_fp8", "llama3_block_fp8"]


def _task(name: str):
    return load_task(SUITE / f"{name}.yaml")


def test_the_truth_is_exact_and_the_fp8_run_sets_the_noise_floor():
    """The upcast reference run quantizes nothing; the run in the declared dtypes
    emulates the recipe, a few percent away (the tolerance the program gets)."""
    t = _task("mlp_block_fp8")
    x = inputs.make_inputs(t.spec, "small", 3)
    hi = inputs.run_reference(t, x, None, torch.float64)
    lo = inputs.run_reference(t, x, None, None)
    exact = references.mlp_block_fp8(**{k: v.double() for k, v in x.items()}, **t.spec.params)
    assert torch.equal(hi["y"], exact["y"])
    rel = float((lo["y"].double() - hi["y"]).norm() / hi["y"].norm())
    assert 0.005 < rel < t.spec.tolerance.rel_norm / 2, rel


def test_llama3_block_fp8_epilogues_reduce_the_amax_of_what_they_store():
    """The expert's forward returns the row amax of h1 * gamma_mlp and h2 * gamma_attn
    (for the next step's delayed scales): the reference's statistic of its outputs."""
    from coda_agent.primitives import load_program, lowering

    t = _task("llama3_block_fp8")
    x = inputs.make_inputs(t.spec, "small", 5)
    with lowering("reference"):
        out = load_program(t.expert_path.read_text(), "amax").forward(**x, **t.spec.params)
    for amax, h, gamma in (("hg1_amax", out["h1"], x["gamma_mlp"]), ("hg2_amax", out["h_out"], x["gamma_attn"])):
        torch.testing.assert_close(out[amax], references.hg_amax(h, gamma).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", TASKS)
def test_expert_is_correct_on_the_gpu(name):
    t = _task(name)
    with Verifier(stages=["static", "reference", "compile", "correctness"], cache=False,
                  shape_sets=["small", "ragged", "llama3-8b"]) as v:
        res = v.check(t, t.expert_path.read_text()).stage("correctness")
    assert res.status == "passed", res.message
