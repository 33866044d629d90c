"""The FP8 suite (tasks/llama3_fp8) through the verifier, one judge for the module.

Each expert passes the static stage, the reference stage (the reference
lowering against the fp8 reference run and the exact math, CODA's rule with
the task's tolerance, on every CPU shape set); a program that drops a scale
fails.  The compile stage for sm_90a with warpgroup MMAs (QGMMA) in the SASS is
in tests/test_expert_compiles.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda_agent.tasks import load_task
from coda_agent.tasks.llama3_fp8 import references
from coda_agent.verifier import Verifier, inputs
from coda_agent.verifier.static import check_source

SUITE = Path(__file__).resolve().parent.parent / "tasks" / "llama3_fp8"
TASKS = ["swiglu_fwd_fp8", "swiglu_bwd_fp8", "mlp_block_fp8", "llama3_block_fp8"]


def _task(name: str):
    return load_task(SUITE / f"{name}.yaml")


@pytest.fixture(scope="module")
def judged():
    with Verifier(stages=["static", "reference"], cache=False, timeout_s=300) as v:
        yield v


def _stage(verifier: Verifier, name: str, stage: str, source: str | None = None):
    t = _task(name)
    return verifier.check(t, source or t.expert_path.read_text()).stage(stage)


@pytest.mark.parametrize("name", TASKS)
def test_expert_is_static_clean_and_matches_the_fp8_reference(name, judged):
    t = _task(name)
    assert not [str(v) for v in check_source(t.expert_path.read_text(), t.spec)]
    res = _stage(judged, name, "reference")
    assert res.status == "passed", res.message
    assert {"small", "ragged", "ragged+256"} <= set(res.details["shape_sets"])


def test_a_program_that_drops_a_scale_is_rejected(judged):
    t = _task("swiglu_fwd_fp8")
    mutant = t.expert_path.read_text().replace("acc * x_scale * w_scale", "acc * x_scale")
    assert mutant != t.expert_path.read_text()
    res = _stage(judged, "swiglu_fwd_fp8", "reference", mutant)
    assert res.status == "failed" and "differs from the reference" in res.message


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
    with Verifier(stages=["static", "reference", "compile", "correctness"], cache=False,
                  shape_sets=["small", "ragged", "llama3-8b"]) as v:
        res = _stage(v, name, "correctness")
    assert res.status == "passed", res.message
