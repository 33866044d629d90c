"""`coda-agent tasks check` through the CLI: what it finds in a task beyond its spec's validation
(`tasks/lint.py`), each with the fix, and the shipped files passing."""

from __future__ import annotations

import pytest
import yaml

from coda_agent.tasks import SUITE_DIR
from test_tasks_cli import cli, family_copy

pytestmark = pytest.mark.usefixtures("agent_env")


def test_check_names_a_float_param_the_reference_takes_only_as_written(tmp_path):
    """The judge varies each float param between draws and keeps the written value where the
    reference refuses every nearby one: a program that typed it in would then pass.  `tasks check`
    names such a param and the two ways on (fixed_params, or a reference that takes nearby values)."""
    task = family_copy("gemma2", tmp_path)
    ref = tmp_path / "softcap_ref.py"  # a reference that asserts Gemma-2's cap
    ref.write_text(ref.read_text().replace("    with torch.enable_grad():", "    assert cap == 30.0, cap\n"
                                           "    with torch.enable_grad():", 1))
    r = cli("tasks", "check", task)
    assert r.exit_code == 1 and ("params.cap: the reference refuses cap = 30.0 x 2^+-0.25 (tried 25.2269 and "
                                 "35.6762), so the verifier never varies it") in r.output, r.output
    assert "list it in fixed_params if it is a constant of the task" in r.output
    task.write_text(task.read_text().replace("params: {cap: 30.0}", "params: {cap: 30.0}\nfixed_params: [cap]"))
    assert cli("tasks", "check", task).exit_code == 0


def test_check_names_a_float_param_written_as_a_whole_number(tmp_path):
    """`cap: 30` loads as an integer, which the judge never varies, though the reference's default
    (30.0) says it is a float: `tasks check` asks for 30.0; the file as shipped passes."""
    task = family_copy("gemma2", tmp_path)
    assert cli("tasks", "check", task).exit_code == 0
    task.write_text(task.read_text().replace("params: {cap: 30.0}", "params: {cap: 30}"))
    r = cli("tasks", "check", task)
    assert r.exit_code == 1 and "params.cap: written 30 (an integer) where the reference's default is 30.0" \
        in r.output and "write 30.0" in r.output, r.output


def test_check_names_a_models_parameter_drawn_as_an_activation(tmp_path):
    """CLIP's MLP biases and Apertus's trained slopes hold no token size: drawn as activations, the
    judge scales them whole with the tokens, never spreading a bias over zero or a slope over a
    trained model's values.  `tasks check` names each and the role that draws it as a parameter;
    the families as shipped pass."""
    for family, names in (("clip", ("b1", "b2")), ("apertus", ("alpha_p", "alpha_n"))):
        task = family_copy(family, tmp_path)
        assert cli("tasks", "check", task).exit_code == 0
        task.write_text(task.read_text().replace("role: weight, init: {dist: normal, scale: 1.0}",
                                                 "init: {dist: normal, scale: 1.0}"))
        r = cli("tasks", "check", task)
        assert r.exit_code == 1, r.output
        for name in names:
            assert f"inputs.{name}: drawn as an activation, but no token size (T)" in r.output
        assert "(role: weight)" in r.output


def test_check_names_a_gradient_through_a_kink_on_the_default_rule(tmp_path):
    """The Apertus family without its tolerances: `tasks check` names dx and dw_up, which pass
    through xIELU's clamp, and the tolerance to give each; not dw_down or the slopes' gradients.
    The shipped file and the fp8 suite, whose quantizers' clamps run inside custom autograd
    Functions (their backward is the author's), pass."""
    task = family_copy("apertus", tmp_path)
    assert cli("tasks", "check", task).exit_code == 0
    raw = yaml.safe_load(task.read_text())
    del raw["tolerances"]
    task.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = cli("tasks", "check", task)
    assert r.exit_code == 1, r.output
    named = {line.split(": ", 2)[1] for line in r.output.splitlines() if "whose derivative jumps" in line}
    assert named == {"tolerances.dx", "tolerances.dw_up"}, r.output
    assert "tolerances: {dx: {factor: 1000, norm_factor: 2}}" in r.output
    assert cli("tasks", "check", SUITE_DIR.parent / "llama3_fp8").exit_code == 0


def test_check_names_a_result_whose_rows_no_kernel_can_store(tmp_path):
    """The GEMM suite's own out_proj_residual with a width of 3 on one set: y's rows are 6 bytes,
    which no TMA store writes; `tasks check` says so and how the reference pads it."""
    task = tmp_path / "out_proj_residual.yaml"
    raw = yaml.safe_load((SUITE_DIR / "out_proj_residual.yaml").read_text())
    del raw["expert"]
    task.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert cli("tasks", "check", task).exit_code == 0
    raw["shapes"]["narrow"] = {**raw["shapes"]["small"], "H": 3}
    task.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = cli("tasks", "check", task)
    assert r.exit_code == 1 and "outputs.y: on shape set narrow its rows are 3 bf16 values, 6 bytes" in r.output \
        and "pad its last dimension to a multiple of 8" in r.output, r.output
