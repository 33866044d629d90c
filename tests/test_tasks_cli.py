"""`coda-agent tasks new/check/list` and `verify`'s run directory, through the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.tasks.spec import load_task

pytestmark = pytest.mark.usefixtures("agent_env")

REFERENCE = '''import torch


def rowwise(x, w, target, eps=1e-5, causal=False):
    """Logits and their per-row maximum; target only picks a column."""
    logits = x @ w
    return {"logits": logits.to(x.dtype), "row_max": logits.float().amax(dim=1),
            "picked": logits.float().gather(1, target.long().view(-1, 1)).view(-1),
            "both": torch.cat([logits, logits], dim=1).to(x.dtype)}
'''


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


def family_copy(name: str, into: Path) -> Path:
    """The files of tests/tasks/families/NAME copied into ``into``; its task file there."""
    folder = Path(__file__).parent / "tasks" / "families" / name
    for f in folder.iterdir():
        (into / f.name).write_text(f.read_text())
    (task,) = (into / f.name for f in folder.glob("*.yaml"))
    return task


def test_new_infers_outputs_dtypes_and_symbolic_shapes_and_leaves_todos(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(REFERENCE)
    r = cli("tasks", "new", "rows", "--reference", "ref.py:rowwise", "--input", "x=T,H", "--input", "w=H,V",
            "--input", "target=T:int64", "--param", "eps=1e-6", "--shapes", "small=T:64,H:32,V:96",
            "--shapes", "ragged=T:50,H:40,V:104", "--out", "tasks")
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path("tasks/rows.yaml").read_text())
    assert raw["reference"] == "../ref.py:rowwise"  # relative to the task file, not to where it was written from
    assert raw["params"] == {"eps": 1e-6, "causal": False}  # --param, then the reference's own defaults
    assert raw["outputs"] == {"logits": {"shape": ["T", "V"], "dtype": "bf16"}, "row_max": {"shape": ["T"], "dtype": "fp32"},
                              "picked": {"shape": ["T"], "dtype": "fp32"}, "both": {"shape": ["T", "2*V"], "dtype": "bf16"}}
    # gather(1, target) picks one of V columns: target is an index below V
    assert raw["inputs"]["target"] == {"shape": ["T"], "dtype": "int64", "role": "index",
                                       "init": {"dist": "randint", "high": "V"}}
    assert raw["summary"] == "Logits and their per-row maximum; target only picks a column."
    assert "the reference's forward runs [[T, V, H]]" in raw["gemms"]
    r = cli("tasks", "check", "tasks")
    assert r.exit_code == 1, r.output
    todo = [line.split(": ")[1] for line in r.output.splitlines() if "still TODO" in line]
    assert todo == ["families", "gemms", "target"]
    written = Path("tasks/rows.yaml").read_text()
    r = cli("tasks", "new", "rows", "--reference", "ref.py:rowwise", "--input", "x=T,H", "--shapes", "small=T:1,H:1",
            "--out", "tasks")
    assert r.exit_code == 2 and "tasks/rows.yaml exists; remove it or give another NAME or --out" in r.output
    assert Path("tasks/rows.yaml").read_text() == written  # nothing already written is lost


def test_new_names_the_backward_gemms_of_the_gradients_asked_for(tmp_path, monkeypatch):
    """Per forward matmul (M, N, K): dA (M, K, N), and dB (N, K, M) for a weight stored (N, K) as
    nn.Linear keeps it or (K, N, M) for one stored (K, N); none for an input without a gradient.
    Without --gradients the task is forward only, and the gradients line waits commented out."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("def two(x, w, b):\n    return {'y': (x @ w) @ b.t()}\n")
    shapes = "--shapes", "small=T:64,H:32,I:48", "--shapes", "ragged=T:50,H:40,I:72"
    r = cli("tasks", "new", "two", "--reference", "ref.py:two", "--input", "x=T,H", "--input", "w=H,I",
            "--input", "b=H,I", *shapes, "--gradients", "x,w")
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path("two.yaml").read_text())
    assert raw["gradients"] == ["x", "w"]
    assert raw["gemms"].endswith("the reference's forward runs [[T, I, H], [T, H, I]], and its backward of those "
                                 "[[T, H, I], [H, I, T], [T, I, H]]")
    r = cli("tasks", "new", "fwd", "--reference", "ref.py:two", "--input", "x=T,H", "--input", "w=H,I",
            "--input", "b=H,I", *shapes)
    text = Path("fwd.yaml").read_text()
    assert "gradients" not in yaml.safe_load(text) and "\n# gradients: [x, w, b]  <- uncomment" in text
    assert yaml.safe_load(text)["gemms"].endswith("the reference's forward runs [[T, I, H], [T, H, I]]")
    Path("step.py").write_text("def step(x, w):\n    return {'y': x @ w, 'dx': x * 2}\n")
    r = cli("tasks", "new", "step", "--reference", "step.py:step", "--input", "x=T,H", "--input", "w=H,H", *shapes[:2])
    assert r.exit_code == 0 and "gradients" not in yaml.safe_load(Path("step.yaml").read_text())  # it returns them
    # ... under torch.autograd.grad, whose matmuls no call records: the hint names those the returned
    # gradients need (the logits' dx = dz @ w and dw = dz^T @ x), not the forward's alone
    Path("xent.py").write_text(
        "import torch\nimport torch.nn.functional as F\n\n\ndef xent(x, w, target):\n"
        "    with torch.enable_grad():\n        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()\n"
        "        loss = F.cross_entropy(F.linear(xg, wg).float(), target, reduction='sum')\n"
        "        dx, dw = torch.autograd.grad(loss, (xg, wg))\n    return {'loss': loss.detach(), 'dx': dx, 'dw': dw}\n")
    r = cli("tasks", "new", "xent", "--reference", "xent.py:xent", "--input", "x=T,H", "--input", "w=I,H",
            "--input", "target=T:int64", *shapes)
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(Path("xent.yaml").read_text())["gemms"].endswith(
        "the reference's forward runs [[T, I, H]], and the gradients it returns (dx, dw) need [[T, H, I], [I, H, T]]")


def test_new_draws_rotary_inputs_and_offset_norm_weights_as_they_are_used(tmp_path, monkeypatch):
    """Inputs an angle of sin/cos is made of (through the tensors computed from them) are drawn as
    positions below 4096 and frequencies in (0, 1), not N(0, 1), where sin is nearly its angle; a
    1-D weight applied as 1 + w (Gemma's, LayerNorm1P) is drawn near 0."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(
        "import torch\n\n\ndef rope(x, positions, theta, w, eps=1e-6):\n"
        "    xn = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())\n"
        "    a = positions[:, None] * theta[None, :]\n"
        "    e, o = xn[:, 0::2], xn[:, 1::2]\n"
        "    y = torch.stack([e * a.cos() - o * a.sin(), e * a.sin() + o * a.cos()], -1)\n"
        "    return {'y': y.flatten(1).to(x.dtype)}\n")
    r = cli("tasks", "new", "rope", "--reference", "ref.py:rope", "--input", "x=T,D", "--input", "positions=T:fp32",
            "--input", "theta=D//2:fp32", "--input", "w=D", "--shapes", "small=T:64,D:32", "--shapes", "r=T:50,D:48")
    assert r.exit_code == 0, r.output
    inputs = yaml.safe_load(Path("rope.yaml").read_text())["inputs"]
    assert inputs["positions"]["role"] == "index" and inputs["positions"]["init"] == {"dist": "positions", "high": 4096}
    assert inputs["theta"]["role"] == "table" and inputs["theta"]["init"]["dist"] == "uniform"
    assert inputs["w"]["role"] == "norm_weight" and inputs["w"]["init"] == {"dist": "normal", "scale": 0.1}
    assert inputs["x"]["init"] == {"dist": "normal", "scale": 1.0} and "role" not in inputs["x"]


def test_check_reads_a_folder_of_task_folders():
    families = Path(__file__).parent / "tasks" / "families"
    r = cli("tasks", "check", families)
    assert r.exit_code == 0, r.output
    assert {line.split()[1] for line in r.output.splitlines() if line.startswith("ok: ")} >= {"moe_router", "post_ln"}


def test_new_finds_output_sizes_among_the_inputs_dimensions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("import torch\n\ndef qkv(x, w, g):\n"
                              "    return {'both': torch.cat([x @ w.t(), x @ g.t()], dim=1)}\n")
    r = cli("tasks", "new", "qkv", "--reference", "ref.py:qkv", "--input", "x=T,H", "--input", "w=3*NH*D,H",
            "--input", "g=2*I,H", "--shapes", "small=T:64,H:32,NH:2,D:16,I:48", "--shapes", "r=T:50,H:40,NH:3,D:8,I:40")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(Path("qkv.yaml").read_text())["outputs"]["both"]["shape"] == ["T", "3*NH*D+2*I"]


def test_check_asks_for_the_values_the_reference_treats_apart_to_be_drawn(tmp_path):
    """A cross-entropy's ignore_index (or an index compared with a constant) that no draw holds
    lets a program that counts padding rows pass every check: `tasks check` names the fix."""
    task = family_copy("gemma2", tmp_path)
    assert cli("tasks", "check", task).exit_code == 0
    task.write_text(task.read_text().replace(", ignore: {value: -100, fraction: 0.125}", ""))
    r = cli("tasks", "check", task)
    assert r.exit_code == 1 and ("inputs.target.init: the reference treats target == -100 apart (an ignore_index), "
                                 "but no draw holds it; add ignore: {value: -100, fraction: 0.125}") in r.output
    (tmp_path / "padded_ref.py").write_text((tmp_path / "softcap_ref.py").read_text().replace(
        "F.cross_entropy(logits, target, reduction=\"none\")",
        "torch.where(target == -7, 0.0, F.cross_entropy(logits, target.clamp(min=0), reduction=\"none\"))"))
    task.write_text(task.read_text().replace("softcap_ref.py", "padded_ref.py"))
    assert "target == -7 apart" in cli("tasks", "check", task).output  # a comparison counts too


def test_new_says_when_one_shape_set_cannot_tell_two_symbols_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("def double(x):\n    return {'y': x.repeat(1, 2)}\n")
    r = cli("tasks", "new", "double", "--reference", "ref.py:double", "--input", "x=T,H", "--shapes",
            "small=T:64,H:32")
    assert r.exit_code == 0, r.output
    line = next(line for line in Path("double.yaml").read_text().splitlines() if line.startswith("  y:"))
    assert line.startswith("  y: {shape: [T, T], dtype: bf16}  # T could also be 2*H")
    assert "a further shape set tells them apart" in line


def test_new_calls_a_gpu_sized_set_on_meta_tensors(tmp_path, monkeypatch):
    """A set sized for the GPU (here 2 x 16384 x 16384 bf16 inputs, and a 16384^3 GEMM the CPU would
    take minutes over) costs shapes only; a reference that needs values (.item()) is still called on
    the CPU there, at a set small enough to afford it."""
    monkeypatch.chdir(tmp_path)
    calls = tmp_path / "calls.txt"
    Path("ref.py").write_text(f"""import torch

def gated(x, w):
    open({str(calls)!r}, "a").write(x.device.type + "\\n")
    h = x @ w
    return {{"y": (torch.sigmoid(h[:, 0::2]) * h[:, 1::2]).to(x.dtype), "norm": h.float().norm(dim=1)}}


def counted(x):
    return {{"y": x[: int(x.abs().sum().item() > -1) * x.shape[0]] * 2}}
""")
    big = "--shapes", "wide=T:16384,H:16384,I:8192"
    t0 = time.perf_counter()
    r = cli("tasks", "new", "gated", "--reference", "ref.py:gated", "--input", "x=T,H", "--input", "w=H,2*I",
            "--shapes", "small=T:64,H:32,I:48", "--shapes", "ragged=T:50,H:40,I:72", *big)
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - t0 < 20
    assert calls.read_text().split() == ["cpu", "cpu", "meta"]
    raw = yaml.safe_load(Path("gated.yaml").read_text())
    assert raw["outputs"] == {"y": {"shape": ["T", "I"], "dtype": "bf16"}, "norm": {"shape": ["T"], "dtype": "fp32"}}
    assert raw["shapes"]["wide"] == {"T": 16384, "H": 16384, "I": 8192}
    assert "the reference's forward runs [[T, 2*I, H]]" in raw["gemms"]
    r = cli("tasks", "new", "counted", "--reference", "ref.py:counted", "--input", "x=T,H",
            "--shapes", "small=T:64,H:32", "--shapes", "wide=T:8192,H:4160")  # 68 MB: past the meta bound
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(Path("counted.yaml").read_text())["outputs"]["y"]["shape"] == ["T", "H"]


@pytest.mark.parametrize("args,match", [
    (["--input", "x=T,H"], "the reference takes 'w': give --input w=SHAPE"),
    (["--input", "x=T,H", "--input", "w=H,V", "--input", "q=T"], "the reference does not take q"),
    (["--input", "x=T,H", "--input", "w"], "--input 'w': write NAME=DIM,DIM[:DTYPE]"),
    (["--input", "x=T,Q", "--input", "w=H,V"], "--input x: Q uses Q, which --shapes small does not bind"),
    (["--input", "x=T,2*H", "--input", "w=H,V"], "calling the reference on shape set small {'T': 8, 'H': 8, 'V': 8} "
                                                 "failed"),
])
def test_new_names_the_fix(tmp_path, monkeypatch, args, match):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("def mm(x, w, target=None):\n    return {'y': x @ w}\n")
    r = cli("tasks", "new", "mm", "--reference", "ref.py:mm", "--shapes", "small=T:8,H:8,V:8", *args)
    assert r.exit_code == 2 and match in r.output and r.output.startswith("error: "), r.output
    assert not Path("mm.yaml").exists()


def test_verify_writes_a_run_that_review_and_export_take(tmp_path, monkeypatch):
    """A hand-written program: verify's run directory goes through review and export like a solve run."""
    from verifier_helpers import EXPERT_PATH, TASK_PATH

    monkeypatch.chdir(tmp_path)
    r = cli("verify", TASK_PATH, EXPERT_PATH, "--stages", "static,reference", "--sets", "small", "--no-cache")
    assert r.exit_code == 3, r.output
    (run,) = Path("runs").glob("*-outproj_residual-verify")
    assert f"run: {run}" in r.output
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["program"] == str(EXPERT_PATH) and config["config"]["verifier"]["shape_sets"] == ["small"]
    assert (run / "best/program.py").read_text() == EXPERT_PATH.read_text()
    assert json.loads((run / "result.json").read_text())["stop_reason"] == "cpu_passed"
    assert (run / "reference/verifier_helpers.py").is_file()
    assert cli("review", run, "--approve", "--allow-cpu-only", "--who", "me").exit_code == 0
    r = cli("export", run, "--to", "out", "--allow-cpu-only")
    assert r.exit_code == 0 and Path("out/coda_outproj_residual.py").is_file(), r.output
    r = cli("solve", "--resume", run)
    assert r.exit_code == 2 and "is a `coda-agent verify` verdict, not a solve run" in r.output
    r = cli("verify", TASK_PATH, "missing.py")
    assert r.exit_code == 2 and "error: missing.py: no such program file" in r.output
    r = cli("verify", TASK_PATH, EXPERT_PATH, "--stages", "static,nonsense", "--no-save")
    assert r.exit_code == 2 and "error: --stages: unknown stages ['nonsense']" in r.output


@pytest.mark.parametrize("columns", [72, 180])
def test_the_tasks_table_follows_the_terminal_width(columns):
    r = CliRunner().invoke(app, ["tasks"], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert r.exit_code == 0 and "swiglu_fwd" in r.output, r.output
    widths = [len(line) for line in r.output.splitlines() if line.strip()]
    assert max(widths) <= columns and max(widths) > columns - 10


GEGLU_RESIDUAL = '''import torch.nn.functional as F


def geglu_mlp(x, w_gu, w_down):
    """y = x + (gelu(g) * u) @ w_down^T with (g, u) = x @ w_gu^T, gate and up rows interleaved."""
    pre = F.linear(x, w_gu)
    return {"y": x + (F.gelu(pre[:, 0::2], approximate="tanh") * pre[:, 1::2]) @ w_down.t()}
'''

NO_RESIDUAL = '''from coda_agent.primitives import epilogue, gelu_tanh, gemm, unpack


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def geglu(acc):
    g, u = unpack(acc)
    return {"D": acc, "act": gelu_tanh(g) * u}


def forward(x, w_gu, w_down):
    return {"y": gemm(gemm(x, w_gu.t(), geglu)["act"], w_down.t())["D"]}   # the residual x left out
'''


def test_new_draws_weights_at_their_fan_in_so_a_dropped_residual_fails(tmp_path, monkeypatch):
    """A matmul's right operand (views such as w.t() and F.linear's weight included) is drawn at
    1/sqrt(K): at scale 1 the MLP's output is ~1000 and the residual x (~1) hides under its bf16
    rounding, so the task `tasks new` wrote passed a program that leaves the residual out."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(GEGLU_RESIDUAL)
    Path("prog.py").write_text(NO_RESIDUAL)
    r = cli("tasks", "new", "mlp", "--reference", "ref.py:geglu_mlp", "--input", "x=T,H", "--input", "w_gu=2*I,H",
            "--input", "w_down=H,I", "--shapes", "small=T:256,H:128,I:192", "--shapes", "ragged=T:200,H:136,I:264",
            "--shapes", "big=T:16384,H:2048,I:8192")  # the big set on meta tensors: views are still recognised
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path("mlp.yaml").read_text())
    assert raw["inputs"]["x"] == {"shape": ["T", "H"], "dtype": "bf16", "init": {"dist": "normal", "scale": 1.0}}
    assert raw["inputs"]["w_gu"]["init"]["scale"] == "1 / sqrt(H)" and raw["inputs"]["w_gu"]["role"] == "weight"
    assert raw["inputs"]["w_down"]["init"]["scale"] == "1 / sqrt(I)"
    text = Path("mlp.yaml").read_text().replace(raw["families"], "[pairwise, tile]")
    text = text.replace(f"'{raw['target']}'", "{vs_gemm: 1.1}").replace(raw["gemms"], "[[T, 2*I, H], [T, H, I]]")
    Path("mlp.yaml").write_text(text)
    r = cli("verify", "mlp.yaml", "prog.py", "--stages", "static,reference", "--no-save", "--no-cache")
    assert r.exit_code == 1 and "`y` differs from the reference" in r.output, r.output


def test_new_says_when_gradients_pass_through_a_kink(tmp_path, monkeypatch):
    """ReLU's derivative jumps: a correct program's bias gradient can miss the default rule there
    (OPT's MLP did), so the file says which rule to widen; a smooth reference gets no such note, nor
    does a squared ReLU (Primer's: its derivative 2 relu(x) is continuous), unless the ReLU's result
    is also used unsquared."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("import torch\nimport torch.nn.functional as F\n\n\ndef mlp(x, w1, b1):\n"
                              "    return {'y': F.relu(F.linear(x, w1, b1))}\n\n\ndef smooth(x, w1, b1):\n"
                              "    return {'y': F.gelu(F.linear(x, w1, b1))}\n\n\ndef squared(x, w1, b1):\n"
                              "    r = F.relu(F.linear(x, w1, b1))\n    return {'y': r ** 2 + torch.square(r) + r * r}\n"
                              "\n\ndef mixed(x, w1, b1):\n"
                              "    r = F.relu(F.linear(x, w1, b1))\n    return {'y': r ** 2 + r}\n")
    args = ["--input", "x=T,H", "--input", "w1=I,H", "--input", "b1=I", "--shapes", "small=T:64,H:32,I:48",
            "--gradients", "x,w1,b1"]
    assert cli("tasks", "new", "mlp", "--reference", "ref.py:mlp", *args).exit_code == 0
    text = Path("mlp.yaml").read_text()
    assert "# The reference calls relu, whose derivative jumps: a gradient through it (dx, dw1, db1)" in text
    assert yaml.safe_load(text)["tolerances"] == dict.fromkeys(("dx", "dw1", "db1"),
                                                               {"factor": 1000, "norm_factor": 2})
    assert "give it alone rel_norm: 0.06" in text
    assert cli("tasks", "new", "smooth", "--reference", "ref.py:smooth", *args).exit_code == 0
    assert cli("tasks", "new", "fwd", "--reference", "ref.py:mlp", *args[:-2]).exit_code == 0
    assert "derivative jumps" not in Path("smooth.yaml").read_text() + Path("fwd.yaml").read_text()
    for name, kinked in (("squared", False), ("mixed", True)):
        assert cli("tasks", "new", name, "--reference", f"ref.py:{name}", *args).exit_code == 0
        assert ("derivative jumps" in Path(f"{name}.yaml").read_text()) is kinked, name


@pytest.mark.parametrize("act", ["F.prelu(h, a)", "F.selu(h)", "F.elu(h, 1.5)", "F.hardswish(h, inplace=True)",
                                 "F.hardsigmoid(h)"])
def test_new_says_so_for_the_activations_with_a_slope_of_their_own_or_corners(tmp_path, monkeypatch, act):
    """PReLU's trained slope, SELU's and ELU's alpha below 0 and the hard activations' corners at
    -3 and 3 are kinks as ReLU's is: each file gets the note."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("import torch.nn.functional as F\n\n\ndef mlp(x, w1, a):\n"
                              f"    h = F.linear(x, w1)\n    return {{'y': {act} * a}}\n")
    r = cli("tasks", "new", "mlp", "--reference", "ref.py:mlp", "--input", "x=T,H", "--input", "w1=I,H", "--input",
            "a=1", "--shapes", "small=T:64,H:32,I:48", "--gradients", "x,w1,a")
    assert r.exit_code == 0, r.output
    assert "whose derivative jumps" in Path("mlp.yaml").read_text()


def test_new_widens_the_rule_of_the_gradients_through_a_kink_alone(tmp_path, monkeypatch):
    """Apertus's xIELU clamps the up projection's output: dx and dw_up pass through the kink and
    get its tolerance; dw_down (after it) and the slopes' gradients (of values continuous at the
    kink) keep the default rule, and the written file loads with those tolerances.  Its honest
    program failed 7 of 66 verifies on the default rule."""
    monkeypatch.chdir(tmp_path)
    family = Path(__file__).parent / "tasks" / "families" / "apertus"
    Path("ref.py").write_text((family / "apertus_ref.py").read_text())
    r = cli("tasks", "new", "xielu_mlp", "--reference", "ref.py:xielu_mlp", "--input", "x=T,H", "--input",
            "w_up=I,H", "--input", "w_down=H,I", "--input", "alpha_p=1", "--input", "alpha_n=1", "--gradients",
            "x,w_up,w_down,alpha_p,alpha_n", "--shapes", "small=T:256,H:128,I:512", "--shapes",
            "ragged=T:200,H:136,I:520")
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path("xielu_mlp.yaml").read_text())
    assert set(raw["tolerances"]) == {"dx", "dw_up"}
    shipped = yaml.safe_load((family / "xielu_mlp.yaml").read_text())
    text = Path("xielu_mlp.yaml").read_text().replace(raw["families"], "[elementwise]")
    text = text.replace(f"'{raw['target']}'", "{vs_gemm: 1.1}").replace(raw["gemms"], str(shipped["gemms"]))
    Path("xielu_mlp.yaml").write_text(text)
    spec = load_task(Path("xielu_mlp.yaml")).spec
    assert spec.tolerance_for("dx").kinked and spec.tolerance_for("dw_up").kinked
    assert not any(spec.tolerance_for(g).kinked for g in ("dw_down", "dalpha_p", "dalpha_n"))


LAYERNORM = '''import torch.nn as nn
import torch.nn.functional as F


def ln_linear(x, gamma, beta, w, eps=1e-5):
    """y = LayerNorm(x) @ w^T."""
    return {"y": F.layer_norm(x, (x.shape[-1],), gamma, beta, eps) @ w.t()}


def rms(x, g):
    """y = RMSNorm(x) * g, through the module."""
    norm = nn.RMSNorm(x.shape[-1], eps=1e-6, device=x.device, dtype=x.dtype)
    norm.weight = nn.Parameter(g)
    return {"y": norm(x)}


def no_centring(x, gamma, beta):
    """y = LayerNorm(x) without the mean taken out: a slip the task must catch."""
    xf = x.float()
    y = xf * (xf.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    return {"y": (y * gamma.float() + beta.float()).to(x.dtype)}
'''


def test_new_draws_a_norms_parameters_and_a_layernorms_input_as_trained_ones_are(tmp_path, monkeypatch):
    """A normalisation's weight is drawn near 1 and its bias at 0.5 (role norm_weight), and the
    input a LayerNorm centres with mean 1: at N(0, 1) a row's mean is small and a LayerNorm without
    its centring is off by 17%, at mean 1 by 80%.  An RMSNorm's input keeps mean 0."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(LAYERNORM)
    sets = ["--shapes", "small=T:64,H:32,N:48", "--shapes", "ragged=T:50,H:40,N:56",
            "--shapes", "big=T:16384,H:4096,N:4096"]  # the big set runs on meta tensors
    r = cli("tasks", "new", "ln", "--reference", "ref.py:ln_linear", "--input", "x=T,H", "--input", "gamma=H",
            "--input", "beta=H", "--input", "w=N,H", *sets)
    assert r.exit_code == 0, r.output
    inputs = yaml.safe_load(Path("ln.yaml").read_text())["inputs"]
    assert inputs["x"]["init"] == {"dist": "normal", "mean": 1.0, "scale": 1.0}
    assert inputs["gamma"] == {"shape": ["H"], "dtype": "bf16", "role": "norm_weight",
                               "init": {"dist": "ones_plus_noise", "scale": 0.1}}
    assert inputs["beta"]["role"] == "norm_weight" and inputs["beta"]["init"] == {"dist": "normal", "scale": 0.5}
    assert inputs["w"]["role"] == "weight"  # a matmul's operand stays one
    assert "x: a LayerNorm's input, drawn with mean 1" in Path("ln.yaml").read_text()
    r = cli("tasks", "new", "rms", "--reference", "ref.py:rms", "--input", "x=T,H", "--input", "g=H", *sets[:4])
    assert r.exit_code == 0, r.output
    inputs = yaml.safe_load(Path("rms.yaml").read_text())["inputs"]
    assert inputs["x"]["init"] == {"dist": "normal", "scale": 1.0}
    assert inputs["g"]["role"] == "norm_weight"
    # drawn as the file says, the inputs tell a LayerNorm from one without its centring
    import torch

    from coda_agent.tasks.inits import Init, draw

    raw = yaml.safe_load(Path("ln.yaml").read_text())["inputs"]
    env, gen = {"T": 64, "H": 32, "N": 48}, torch.Generator().manual_seed(3)
    args = {k: draw(Init(**v["init"]), tuple(env[d] for d in v["shape"]), torch.bfloat16, env, gen)
            for k, v in raw.items()}
    ns = {}
    exec(LAYERNORM, ns)
    want = ns["ln_linear"](**args)["y"].float()
    slip = ns["no_centring"](args["x"], args["gamma"], args["beta"])["y"].float() @ args["w"].float().t()
    assert (slip - want).norm() > 0.5 * want.norm()


def test_new_evaluates_a_param_of_the_shape_symbols_on_each_set(tmp_path, monkeypatch):
    """`--param head_dim=D` reaches the reference as an int on every shape set, and the task keeps
    it as the expression."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("def heads(q, head_dim):\n"
                              "    t = q.shape[0]\n"
                              "    return {'y': (q.view(t, -1, head_dim) * 2.0).view(t, -1)}\n")
    r = cli("tasks", "new", "heads", "--reference", "ref.py:heads", "--input", "q=T,NH*D", "--param", "head_dim=D",
            "--shapes", "small=T:64,NH:4,D:16", "--shapes", "wide=T:32,NH:2,D:64")
    assert r.exit_code == 0, r.output
    assert "params: {head_dim: D}" in Path("heads.yaml").read_text()
