"""Suite B of the LLaMA-3 tasks: QK-norm + RoPE, LM head + cross-entropy (forward,
and the fused training step, with soft-capped logits too), the MLP sub-block, and a SwiGLU or GeGLU MLP alone.

For every task (its spec and the static stage: tests/test_suite_specs.py): the expert program
matches the task reference on the CPU shape sets under the reference lowering
(forward, and backward against autograd through the reference) by the verifier's
own inputs, references and compare (tests/suite_checks.py).  Every GEMM of its
forward and backward compiling for sm_90a (HGMMA in the SASS, no register spills
beyond those measured harmless on the H200) is tested in tests/test_expert_compiles.py.
"""

from __future__ import annotations

import pytest
import torch
from suite_checks import draw, load_expert, mutant_problems, problems, run_program
from suite_checks import task as _task


TASKS = ["qk_norm_rope", "lm_head_xent_fwd", "lm_head_xent", "lm_head_xent_frozen", "lm_head_xent_softcap",
         "lm_head_xent_softcap_frozen", "mlp_block", "swiglu_mlp", "swiglu_clamp_mlp",
         "geglu_mlp", "llama3_block"]
CPU_SETS = ["small", "ragged"]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_matches_reference(name, shape_set):
    failures = problems(_task(name), shape_set, seed=1234)
    assert not failures, f"{name}/{shape_set}:\n" + "\n".join(failures)


def _chunked_lm_head(shape_set: str, mutant: tuple[str, str] | None = None,
                     name: str = "lm_head_xent") -> tuple[list[str], float, float]:
    """An LM head expert with 128-row chunks (2 at small, 8 at ragged; the CPU
    shapes' logits would fit one): the names among loss and dx that fail the
    verifier's compare, dw's max error against fp64 and the bf16 reference's
    (0, 0 for a frozen head)."""
    import re

    from coda_agent.primitives import lowering
    from coda_agent.verifier.compare import compare
    from coda_agent.verifier.inputs import run_reference

    t = _task(name)
    src = t.expert_path.read_text()
    assert re.search(r"^LOGITS_BYTES = ", src, re.M), "the expert's chunk budget moved; update this test"
    src = re.sub(r"^LOGITS_BYTES = .*$", "LOGITS_BYTES = 1  # one 128-row M tile per chunk", src, flags=re.M)
    src = re.sub(r"^DX_TILES = .*$", "DX_TILES = 1  # no floor of rows for the dx GEMM's wave", src, flags=re.M)
    if mutant:
        assert mutant[0] in src
        src = src.replace(*mutant)
    inputs, _ = draw(t, shape_set, seed=4321)
    with lowering("reference"):
        got = run_program(t, load_expert(t, src, tag="lm_head_chunked"), inputs, None)
    hi = run_reference(t, inputs, None, torch.float64)
    lo = run_reference(t, inputs, None, None)
    bad = [k for k in ("loss", "dx") if compare(k, shape_set, got[k], hi[k], lo[k], t.spec.tolerance)]
    if "dw" not in got:
        return bad, 0.0, 0.0
    rel = float((got["dw"].double() - hi["dw"]).norm() / hi["dw"].norm())
    assert rel <= t.spec.tolerance.rel_norm or mutant, rel
    err = float((got["dw"].double() - hi["dw"]).abs().max())
    return bad, err, float((lo["dw"].double() - hi["dw"]).abs().max())


@pytest.mark.parametrize("shape_set", CPU_SETS)
def test_lm_head_chunk_loop_sums_dw_across_chunks(shape_set):
    """loss and dx pass the verifier's compare with the chunk loop running; dw, rounded
    once more per chunk, stays within 4x the bf16 reference's max error and within
    the relative-norm tolerance (at LLaMA-3 1B, 8 chunks, the H200 measured 1.2-1.33x)."""
    bad, err, lo_err = _chunked_lm_head(shape_set)
    assert not bad
    assert 0 < err <= 4 * lo_err, (err, lo_err)


@pytest.mark.parametrize("name", ["lm_head_xent_softcap", "lm_head_xent_softcap_frozen"])
def test_soft_capped_heads_chunk_loops_match_the_reference(name):
    """The soft-capped experts with 128-row chunks, as at LLaMA-3's widths on a GPU (the CPU sets
    fit one chunk, and the dx GEMM's wave alone asks for more rows than they have)."""
    bad, err, lo_err = _chunked_lm_head("ragged", name=name)
    assert not bad
    assert err <= 4 * lo_err, (err, lo_err)


@pytest.mark.parametrize("name", ["lm_head_xent", "lm_head_xent_softcap_frozen"])
def test_lm_head_chunk_slip_is_caught(name):
    """Every chunk weighted by the first chunk's dloss: dx is wrong from chunk 2 on."""
    bad, _, _ = _chunked_lm_head("small", ("dloss[r0:r1]", "dloss[0:r1 - r0]"), name=name)
    assert "dx" in bad


MUTANTS = [
    # (task, original, mutant): each plausible slip must fail the check.
    ("mlp_block", "hr * rstd * s * inv_dim", "hr * rstd * 0.0 * inv_dim"),  # RMSNorm backward without s
    ("qk_norm_rope", "e * s + o * c", "e * s - o * c"),  # RoPE sign
    # lm_head_xent's chunk slip is in test_lm_head_chunk_slip_is_caught: the
    # CPU shapes run one chunk, where every chunk *is* the first.
    ("llama3_block", '{"s": du * u}', '{"s": du}'),  # QKV-side statistic without the saved output
]


@pytest.mark.parametrize("name,orig,mutant", MUTANTS)
def test_checker_catches_mutant(name, orig, mutant):
    assert mutant_problems(_task(name), orig, mutant, "small", seed=99), f"{name}: mutant {mutant!r} passed"


def test_the_clamped_expert_flips_at_a_kink_where_a_bf16_model_does():
    """A gate pre-activation that rounds to bf16 onto the bf16-rounded limit: torch's clamp of a
    bf16 tensor (an HF bf16 expert) passes its gradient there, the fp64 reference, whose
    pre-activation lies past the exact limit, does not.  The expert clamps at the bf16 limit: its
    b_gu gradient is the bf16 model's, so its flips at the kink fall where the bf16 reference's do."""
    from coda_agent.kernels import contract
    from coda_agent.primitives import lowering
    from coda_agent.tasks.llama3.references_heads import swiglu_clamp_mlp

    t = _task("swiglu_clamp_mlp")
    inputs, grads = draw(t, "small", 3)
    params = dict(t.spec.params, limit=0.593)  # bf16 rounds it to 0.59375
    inputs["w_gu"] = torch.zeros_like(inputs["w_gu"])  # (g, u) = b_gu, exactly
    b = inputs["b_gu"].float()
    b[0::2] = torch.where(torch.arange(b.numel() // 2) % 2 == 0, 0.59375, b[0::2])  # half the gates on the bound
    b[1::2] = 0.25
    inputs["b_gu"] = b.to(torch.bfloat16)
    with lowering("reference"):
        got = contract.run(load_expert(t), {k: v.clone() for k, v in inputs.items()}, params, grads,
                           t.spec.outputs, t.spec.gradients)

    def db_gate(dtype, limit):
        leaf = {k: v.to(dtype).clone().requires_grad_(k == "b_gu") for k, v in inputs.items()}
        y = swiglu_clamp_mlp(**leaf, **dict(params, limit=limit))["y"]
        y.backward(grads["dy"].to(dtype))
        return leaf["b_gu"].grad[0::2].double()

    on_bound = slice(0, None, 2)
    bf16, exact = db_gate(torch.bfloat16, 0.593), db_gate(torch.float64, 0.593)
    assert (exact[on_bound] == 0).all() and (bf16[on_bound] != 0).all()
    # the bf16 model's semantics without its bf16 sums: fp64 with the limit it compares against
    at_bf16_limit, ours = db_gate(torch.float64, 0.59375), got["db_gu"][0::2].double()
    torch.testing.assert_close(ours, at_bf16_limit, rtol=0.02, atol=0.01 * float(at_bf16_limit.abs().max()))


@pytest.mark.parametrize("shape_set", CPU_SETS)
def test_the_clamped_mlp_candidate_with_row_sums_matches_the_reference(shape_set):
    """bench/candidates/swiglu_clamp_mlp_row_sums.py, the expert with b_gu's gradient folded into
    its dSwiGLU epilogue (row_sum beside a PairedTile), passes the verifier's compare as the
    expert does; which of the two is faster is the GPU's to say (BENCHMARKS)."""
    from pathlib import Path

    source = (Path(__file__).resolve().parent.parent / "bench/candidates/swiglu_clamp_mlp_row_sums.py").read_text()
    assert not problems(_task("swiglu_clamp_mlp"), shape_set, seed=77, source=source)
