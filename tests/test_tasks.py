"""Task specs: references beside the YAML and what the prompt shows of them, optional experts,
params, init offsets, per-output tolerances, outputs without gradients, and errors that name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda_agent.tasks import TaskSpecError, load_task
from coda_agent.tasks.spec import load_suite, scan_suite

TASK = """\
name: {name}
summary: y = x @ w + r, and h = x @ w kept for the backward.
families: [tile]
inputs:
  x: {{shape: [T, K]}}
  w: {{shape: [K, N], role: weight, init: {{dist: normal, scale: 1 / sqrt(K)}}}}
  r: {{shape: [T, N], role: residual}}
outputs:
  y: {{shape: [T, N]}}
  h: {{shape: [T, N], role: saved}}
shapes:
  small: {{T: 64, K: 32, N: 48}}
reference: {reference}
gradients: [x, w, r]
gemms: [[T, N, K], [T, K, N], [K, N, T]]
"""

REFERENCE = '''"""The task's references; conventions live here."""
import torch

from helpers import matmul_hi

UNUSED = 3


def unrelated(x):
    return x


# y and the saved product
def proj_residual(x, w, r):
    """y = x @ w + r; h = x @ w."""
    h = matmul_hi(x, w)
    return {"y": (h + r).to(x.dtype), "h": h.to(x.dtype)}
'''

HELPERS = '''import torch

SCALE = 1.0


def matmul_hi(a, b):
    return (a.to(torch.promote_types(a.dtype, torch.float32)) @ b.to(torch.promote_types(b.dtype, torch.float32))) * SCALE


def other():
    return 0
'''

# forward returns y and the saved h; backward gets dy only (h is role: saved).
PROGRAM = '''from coda_agent.primitives import Tile, epilogue, gemm


@epilogue(outputs={"h": "bf16"})
def add_residual(acc, r: Tile):
    return {"D": acc + r, "h": acc}


def forward(x, w, r):
    out = gemm(x, w, add_residual, r=r)
    return {"y": out["D"], "h": out["h"]}


def backward(saved, dy):
    return {"dx": gemm(dy, saved["w"].t())["D"], "dw": gemm(saved["x"].t(), dy)["D"], "dr": dy}
'''


def write(folder: Path, name: str = "proj", reference: str = "ref.py:proj_residual", extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ref.py").write_text(REFERENCE)
    (folder / "helpers.py").write_text(HELPERS)
    path = folder / f"{name}.yaml"
    path.write_text(TASK.format(name=name, reference=reference) + extra)
    return path


@pytest.mark.parametrize("reference", ["ref.py:proj_residual", "./ref.py:proj_residual"])
def test_a_reference_file_beside_the_yaml_needs_no_pythonpath(tmp_path, reference):
    task = load_task(write(tmp_path / "mine", reference=reference))
    assert task.expert_path is None  # no expert: fine
    x, w, r = torch.ones(2, 3), torch.ones(3, 4), torch.zeros(2, 4)
    assert task.reference_fn(x=x, w=w, r=r)["y"].tolist() == [[3.0] * 4] * 2


def test_a_reference_in_a_subfolder_and_two_tasks_with_the_same_file_name(tmp_path):
    one = load_task(write(tmp_path / "one"))
    (tmp_path / "two/refs").mkdir(parents=True)
    two_path = write(tmp_path / "two", reference="refs/ref.py:proj_residual")
    (tmp_path / "two/refs/ref.py").write_text(REFERENCE.replace("(h + r)", "(h - r)"))
    (tmp_path / "two/refs/helpers.py").write_text(HELPERS)
    two = load_task(two_path)
    x, w, r = torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    assert one.reference_fn(x=x, w=w, r=r)["y"].item() == 2 and two.reference_fn(x=x, w=w, r=r)["y"].item() == 0


@pytest.mark.parametrize("reference,match", [
    ("nope.py:proj_residual", r"reference: .*nope.py does not exist \(a reference file's path is relative to the "
                              r"task file's folder"),
    ("ref.py:proj", r"reference: ref.py has no function 'proj' \(it defines proj_residual, unrelated\)"),
    ("ref:proj_residual", r"cannot import module 'ref' .*; ref.py is beside the task file: write "
                          r"'ref.py:proj_residual'"),
    ("ref.py", r"reference: 'ref.py' must be 'path/to/file.py:function' \(relative to the task file"),
    ("no_such_pkg.mod:fn", r"cannot import module 'no_such_pkg.mod' .*fix the module path, or name a file"),
])
def test_a_bad_reference_names_the_fix(tmp_path, reference, match):
    with pytest.raises(TaskSpecError, match=match):
        load_task(write(tmp_path, reference=reference))


def test_the_prompt_shows_the_reference_with_what_it_uses_from_its_folder(tmp_path):
    task = load_task(write(tmp_path))
    src = task.reference_source()
    assert src.startswith('# ref.py\n\n"""The task\'s references; conventions live here."""')
    assert "# y and the saved product\ndef proj_residual" in src and "from helpers import matmul_hi" in src
    assert "# helpers.py" in src and "def matmul_hi" in src and "SCALE = 1.0" in src
    for unused in ("def unrelated", "UNUSED", "def other"):
        assert unused not in src
    assert [p.name for p in task.reference_files()] == ["ref.py", "helpers.py"]


def test_a_packaged_reference_shows_its_helpers():
    from coda_agent.tasks import SUITE_DIR

    src = load_task(SUITE_DIR / "qk_norm_rope.yaml").reference_source()
    assert "def _rms_norm" in src and "def _rope" in src and "def _hi" in src and "def lm_head_xent" not in src


def test_saved_outputs_get_no_gradient_everywhere(tmp_path):
    """h has role saved: the upstream gradients, the static contract and the reference's autograd
    all leave it out, so backward(saved, dy) passes the real static and reference stages."""
    from coda_agent.verifier import Verifier
    from coda_agent.verifier.inputs import make_grads

    task = load_task(write(tmp_path))
    assert task.spec.grad_outputs == ["y"]
    assert set(make_grads(task.spec, "small", seed=1)) == {"dy"}
    report = Verifier(stages=["static", "reference"], cache=False).check(task, PROGRAM)
    assert report.outcome == "cpu_passed", [s.message for s in report.stages]
    wrong = PROGRAM.replace("def backward(saved, dy):", "def backward(saved, dy, dh):")
    report = Verifier(stages=["static"], cache=False).check(task, wrong)
    assert report.outcome == "rejected" and "must be (dy)" in report.stages[0].message


def test_params_of_any_scalar_type_and_init_offsets(tmp_path):
    path = write(tmp_path, extra="params: {eps: 1.0e-5, heads: 4, causal: true, act: gelu}\n")
    path.write_text(path.read_text().replace("r: {shape: [T, N], role: residual}",
                                             "r: {shape: [T, N], role: residual, init: {mean: 3.0, scale: 0.5}}"))
    (tmp_path / "ref.py").write_text(REFERENCE.replace("def proj_residual(x, w, r):",
                                                       "def proj_residual(x, w, r, eps, heads, causal, act):"))
    spec = load_task(path).spec
    assert spec.params == {"eps": 1e-5, "heads": 4, "causal": True, "act": "gelu"}
    assert [type(v) for v in spec.params.values()] == [float, int, bool, str]
    from coda_agent.verifier.inputs import make_inputs

    r = make_inputs(spec, "small", seed=0)["r"].float()
    assert abs(r.mean().item() - 3.0) < 0.1 and abs(r.std().item() - 0.5) < 0.1
    path.write_text(path.read_text().replace("{mean: 3.0, scale: 0.5}", "{dist: randint, mean: 1}"))
    with pytest.raises(TaskSpecError, match=r"init.mean offsets only dist normal or uniform, not randint"):
        load_task(path)


def test_ignored_targets_are_drawn_as_the_spec_says_everywhere(tmp_path):
    """``ignore`` sets about its fraction of a randint input to the ignore_index, at positions that
    differ per seed; the verifier's draw and the reference's dry run are the same function."""
    path = write(tmp_path)
    path.write_text(path.read_text().replace(
        "  r: {shape: [T, N], role: residual}",
        "  r: {shape: [T, N], role: residual}\n  t: {shape: [T], dtype: int64, role: index, "
        "init: {dist: randint, high: N, ignore: {value: -100, fraction: 0.25}}}"))
    (tmp_path / "ref.py").write_text(REFERENCE.replace("def proj_residual(x, w, r):", "def proj_residual(x, w, r, t):"))
    spec = load_task(path).spec
    from coda_agent.tasks import dryrun
    from coda_agent.verifier.inputs import make_inputs

    draws = [make_inputs(spec, "small", seed=s)["t"] for s in range(40)]
    ignored = torch.stack([d == -100 for d in draws]).float()
    assert 0.2 < ignored.mean().item() < 0.3  # a quarter of 40 x 64 entries
    assert not torch.equal(ignored[0], ignored[1])  # the positions follow the seed
    kept = torch.cat([d[d != -100] for d in draws])
    assert kept.min().item() >= 0 and kept.max().item() < 48 and kept.unique().numel() > 40
    gen = torch.Generator().manual_seed(7)
    t = dryrun.draw_input(spec, spec.inputs["t"], "small", gen)
    assert t.dtype == torch.int64 and set(t.unique().tolist()) - set(range(48)) <= {-100}


def test_per_output_tolerances_override_the_task_wide_rule(tmp_path):
    path = write(tmp_path, extra="tolerance: {factor: 3.0, rel_norm: 0.01}\ntolerances: {h: {factor: 8.0}, "
                                 "dw: {rel_norm: 0.05}}\n")
    spec = load_task(path).spec
    assert (spec.tolerance_for("y").factor, spec.tolerance_for("y").rel_norm) == (3.0, 0.01)
    assert (spec.tolerance_for("h").factor, spec.tolerance_for("h").rel_norm) == (8.0, 0.01)
    assert (spec.tolerance_for("dw").factor, spec.tolerance_for("dw").rel_norm) == (3.0, 0.05)
    path.write_text(path.read_text().replace("dw: {rel_norm", "dz: {rel_norm"))
    with pytest.raises(TaskSpecError, match=r"tolerances: 'dz' is neither an output nor a gradient of this task "
                                            r"\(compared tensors: y, h, dx, dw, dr\)"):
        load_task(path)


def test_the_verifier_compares_each_output_with_its_own_tolerance(tmp_path):
    from coda_agent.verifier.calls import Case, verdict

    loose = load_task(write(tmp_path / "loose", extra="tolerances: {h: {factor: 4.0, rel_norm: 1.0}}\n"))
    strict = load_task(write(tmp_path / "strict"))
    hi = {"y": torch.randn(64, 48, dtype=torch.float64), "h": torch.randn(64, 48, dtype=torch.float64)}
    lo = {k: v.to(torch.bfloat16) for k, v in hi.items()}
    signs = torch.ones(64 * 48, dtype=torch.float64)
    signs[::2] = -1  # h off by far more than bf16 noise, one way as often as the other (no bias)
    got = {"y": lo["y"], "h": (hi["h"] + 0.02 * signs.view(64, 48)).to(torch.bfloat16)}
    case = Case("small", "seed", {}, None, hi, lo)
    assert [m.tensor for m in verdict(strict.spec, case, got)] == ["h"]
    assert verdict(loose.spec, case, got) == []


def test_an_unbound_symbol_names_the_tensors_using_it(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace("small: {T: 64, K: 32, N: 48}", "small: {T: 64, N: 48}"))
    with pytest.raises(TaskSpecError, match=r"shapes.small does not bind K \(used by inputs.x, inputs.w, "
                                            r"gemms\[0\], gemms\[1\], gemms\[2\]\); add K: <int> to shapes.small"):
        load_task(path)


def test_todo_fields_are_reported_by_name(tmp_path):
    path = write(tmp_path)
    text = path.read_text().replace("families: [tile]", "families: TODO pick some").replace(
        "gemms: [[T, N, K], [T, K, N], [K, N, T]]", "gemms: [[T, N, K], TODO the backward's]")
    path.write_text(text)
    with pytest.raises(TaskSpecError) as e:
        load_task(path)
    assert str(e.value).splitlines() == [f"{path}: families: still TODO pick some; fill it in",
                                         f"{path}: gemms[1]: still TODO the backward's; fill it in"]


def test_a_folder_with_a_bad_file_loads_the_others(tmp_path):
    write(tmp_path, "a")
    write(tmp_path, "b")
    (tmp_path / "c.yaml").write_text(TASK.format(name="a", reference="ref.py:proj_residual"))  # a's name again
    (tmp_path / "d.yaml").write_text("name: d\n")
    tasks, errors = scan_suite(tmp_path)
    assert [t.name for t in tasks] == ["a", "b"]
    assert [str(e).split(":")[0] for e in errors] == [str(tmp_path / "c.yaml"), str(tmp_path / "d.yaml")]
    assert "'a' is also the name of" in str(errors[0]) and "summary: required field is missing" in str(errors[1])
    with pytest.raises(TaskSpecError, match="d.yaml: summary"):
        load_suite(tmp_path)


def test_every_suite_task_still_loads_and_means_the_same():
    """role: saved outputs exist only in forward-only suite tasks, so no suite task's gradients change."""
    from coda_agent.tasks import SUITE_DIR

    for task in load_suite(SUITE_DIR):
        s = task.spec
        floats = [o for o, t in s.outputs.items() if t.dtype in ("bf16", "fp16", "fp32")]
        assert s.grad_outputs == (floats if s.gradients else []), s.name
        assert task.expert_path is not None and task.expert_path.is_file(), s.name



def test_gradient_subsets_are_the_sets_a_frozen_parameter_or_input_leaves():
    """What a backward that takes ``needs`` is verified for and asked for: the whole set, the
    activations' (every parameter frozen), the parameters' (a frozen input), each set less one."""
    from coda_agent.tasks import SUITES

    spec = load_task(SUITES["llama3"] / "out_proj_residual.yaml").spec  # attn, Wo (weight), residual
    assert spec.gradient_subsets == [frozenset({"dattn", "dWo", "dresidual"}), frozenset({"dattn", "dresidual"}),
                                     frozenset({"dWo"}), frozenset({"dWo", "dresidual"}),
                                     frozenset({"dattn", "dWo"})]
    biased = load_task(SUITES["gpt2"] / "out_proj_residual.yaml").spec  # attn, x; w_o, b_o (weights)
    assert biased.gradient_subsets[1:3] == [frozenset({"dattn", "dx"}), frozenset({"dw_o", "db_o"})]
    assert len(biased.gradient_subsets) == 3 + 4
