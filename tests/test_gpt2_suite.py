"""The GPT-2 suite (tasks/gpt2/; every spec and the static stage: tests/test_suite_specs.py):
every expert program matches its task reference on the CPU shape sets
(forward, and backward against autograd through the reference) by the
verifier's own inputs, references and compare (tests/suite_checks.py), and fails
for a one-token bug; its sm_90a compile is in tests/test_expert_compiles.py, the
verifier's own CPU stages in tests/test_verifier_suite.py, and (GPU tier) every
verifier stage accepts it on the H200.  The references' math: tests/test_gpt2_references.py."""

from __future__ import annotations

import pytest
from suite_checks import mutant_problems, problems
from suite_checks import task as _task

from coda_agent.tasks import SUITES, load_suite

SUITE = "gpt2"
TASKS = sorted(t.name for t in load_suite(SUITES[SUITE]))
CPU_SETS = ["small", "ragged"]


def task(name: str):
    return _task(name, SUITE)


def test_the_suite_covers_every_non_attention_op_of_the_block():
    assert TASKS == ["gelu_bwd", "gelu_fwd", "gelu_mlp", "gelu_tanh_mlp", "gpt2_block", "layernorm_bwd",
                     "linear_gelu", "linear_gelu_tanh", "linear_relu", "lm_head_xent", "ln_qkv", "mlp_block",
                     "mlp_block_tanh", "out_proj_residual", "relu2_mlp", "relu_mlp", "residual_layernorm"]




@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_matches_reference(name, shape_set):
    failures = problems(task(name), shape_set, seed=2020 + TASKS.index(name))
    assert not failures, f"{name}/{shape_set}:\n" + "\n".join(failures)


MUTANTS = [
    # (task, original, mutant): each plausible slip must fail the check.
    ("out_proj_residual", "acc + b + x", "acc + x"),  # the bias dropped
    ("out_proj_residual", '{"db": dy}', '{"db": dy * dy}'),
    ("gelu_fwd", '"y": gelu(pre)', '"y": gelu(acc)'),  # GELU before the bias
    ("gelu_bwd", "pre * exp(-0.5 * pre * pre)", "exp(-0.5 * pre * pre)"),  # Phi only half of gelu'
    ("linear_gelu", '{"D": dpre, "db": dpre}', '{"D": dpre, "db": dy}'),
    ("gelu_mlp", '{"D": acc, "db": dy}', '{"D": acc, "db": acc}'),  # b_proj's gradient off dx's accumulator
    ("gelu_mlp", "acc * gelu_grad(pre)", "acc * gelu(pre)"),  # GELU for its derivative
    ("gelu_tanh_mlp", "pre = acc + b\n", "pre = acc\n"),  # the fc bias dropped
    ("relu2_mlp", "dpre = acc * (r + r)", "dpre = acc * r"),  # relu^2's derivative halved
    ("relu_mlp", "where(a > 0.0, acc, 0.0)", "where(a >= 0.0, acc, 0.0)"),  # ReLU's derivative 1 everywhere
    ("relu_mlp", '{"D": dpre, "db": dpre}', '{"D": dpre, "db": acc}'),  # b_fc's gradient past the kink
    ("ln_qkv", "rstd * (acc - mean * gw) + shift", "rstd * acc + shift"),  # no centring
    ("ln_qkv", '"s2": du * (u - shift)', '"s2": du * u'),  # the bias left in the statistic
    ("residual_layernorm", '"sumsq": a * a', '"sumsq": a * acc'),
    ("layernorm_bwd", '"dbeta": acc}', '"dbeta": acc * xhat}'),
    ("layernorm_bwd", "dres + rstd * gamma * acc + p * h + q", "dres + rstd * gamma * acc + q"),
    ("lm_head_xent", '"s2": gg * (h - mean) * rstd', '"s2": gg * h * rstd'),
    ("mlp_block", '"s2": dpre * (pre - shift)', '"s2": dpre * pre'),
    ("mlp_block", '"db_res": dy}', '"db_res": acc}'),
    # the tanh GELU's derivative: the cubic term's factor 3a dropped, the cubic dropped from the angle
    ("mlp_block_tanh", "(HALF_K + HALF_K_3A * pre * pre)", "(HALF_K + HALF_K * pre * pre)"),
    ("mlp_block_tanh", "t = tanh_fast(K * (pre + A * pre * pre * pre))", "t = tanh_fast(K * pre)"),
    ("gpt2_block", '"db_res": dy}', '"db_res": acc}'),
    ("gpt2_block", 'mean=st2["mean"], rstd=st2["rstd"]', 'mean=st1["mean"], rstd=st2["rstd"]'),
]


@pytest.mark.parametrize("name,orig,mutant", MUTANTS)
def test_checker_catches_mutant(name, orig, mutant):
    assert mutant_problems(task(name), orig, mutant, "small", seed=7), f"{name}: mutant {mutant!r} passed"


def test_padded_lanes_catch_a_bias_in_a_sum():
    """Folding h = acc + b + x itself is right on the real extent and wrong on the
    GPU at a ragged width (each padded column adds the stale bias): the plain
    reference cannot tell, the padded one can."""
    t = task("residual_layernorm")
    src = t.expert_path.read_text()
    for old, new in (('"sum": a, "sumsq": a * a, "bias_dot": a * b}', '"sum": a + b, "sumsq": (a + b) * (a + b), "bias_dot": 0.0 * a}'),
                     ("bias=b_o, bias_dot=a[\"bias_dot\"]", "")):
        assert old in src, old
        src = src.replace(old, new)
    src = src.replace("eps, )", "eps)")
    assert not problems(t, "ragged", seed=5, source=src)
    assert problems(t, "ragged", seed=5, source=src, padded=True)


def test_lm_head_chunk_loop_matches_reference():
    """lm_head_xent with 128-row chunks (8 at ragged; the CPU shapes' logits would fit
    one): the per-chunk statistics and the reduce-added dwte and dln still pass."""
    import re

    t = task("lm_head_xent")
    src = t.expert_path.read_text()
    assert re.search(r"^LOGITS_BYTES = ", src, re.M), "the expert's chunk budget moved; update this test"
    src = re.sub(r"^LOGITS_BYTES = .*$", "LOGITS_BYTES = 1  # one 128-row M tile per chunk", src, flags=re.M)
    assert not problems(t, "ragged", seed=11, source=src)
