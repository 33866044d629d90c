"""A person's own task file, wrong in the ways people get it wrong, through the real CLI.

Each bad variant of the README's GeGLU task is one problem: ``tasks check``
lists it as one line that names the field and the fix (exit 1), and
``verify`` refuses the task with ``error: ...`` and exit 2 before judging any
program, never with a traceback and never as "the verifier itself failed".
The unusual-but-valid variants load and verify.  ``tasks new`` refuses bad
arguments and references the same way and writes nothing then.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda_agent.cli import app

pytestmark = pytest.mark.usefixtures("agent_env")

REFERENCE = '''"""GeGLU, the gated GELU unit of T5 v1.1, PaLM and Gemma MLPs."""
import torch.nn.functional as F


def geglu(x, w_gu, approximate="tanh"):
    """y = gelu(g) * u with (g, u) = x @ w_gu, gate and up interleaved."""
    pre = x @ w_gu
    g, u = pre[:, 0::2], pre[:, 1::2]
    return {"y": (F.gelu(g, approximate=approximate) * u).to(x.dtype)}
'''

TASK = """\
name: geglu
summary: y = gelu(g) * u with (g, u) = x @ w_gu, gate and up interleaved.
families: [pairwise, elementwise]
inputs:
  x: {shape: [T, H], dtype: bf16, init: {dist: normal, scale: 1.0}}
  w_gu: {shape: [H, 2*I], dtype: bf16, init: {dist: normal, scale: 1.0}}
params: {approximate: tanh}
outputs:
  y: {shape: [T, I], dtype: bf16}
shapes:
  small: {T: 64, H: 32, I: 48}
  ragged: {T: 50, H: 40, I: 72}
  llama-1b: {T: 16384, H: 2048, I: 8192}
reference: geglu_ref.py:geglu
gemms: [[T, 2*I, H]]
target: {vs_gemm: 1.1, vs_compile: 1.1}
"""

PROGRAM = '''from coda_agent.primitives import epilogue, gelu_tanh, gemm, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def geglu(acc):
    g, u = unpack(acc)
    return {"y": gelu_tanh(g) * u}


def forward(x, w_gu, approximate):
    return {"y": gemm(x, w_gu, geglu)["y"]}
'''

RAISE = ("    pre = x @ w_gu", "    raise ValueError('boom')")
AS_TENSOR = ('return {"y": (F.gelu(g, approximate=approximate) * u).to(x.dtype)}',
             "return (F.gelu(g, approximate=approximate) * u).to(x.dtype)")

# name: (YAML edits, reference edits, what the one problem line says)
BAD = {
    "duplicate key": ([("target:", "families: [tile]\ntarget:")], [],
                      r"not valid YAML at line 16, column 1: 'families' is given twice \(first on line 3\); keep one"),
    "syntax error": ([("[pairwise, elementwise]", "[pairwise, elementwise")], [],
                     r"not valid YAML at line 4, column 7: expected ',' or '\]', but got ':' .*; fix the YAML there"),
    "tab": ([("  x: {shape", "\tx: {shape")], [], r"line 5, column 1: .*indent with spaces"),
    "a list": ([(TASK, "- name: geglu\n- summary: s\n")], [], r"holds a YAML list; a task file is a YAML mapping"),
    "misspelled key": ([("gemms:", "gemm:")], [], r"geglu.yaml: gemm: unknown field; did you mean 'gemms'\?$"),
    "dtype bfloat16": ([("x: {shape: [T, H], dtype: bf16", "x: {shape: [T, H], dtype: bfloat16")], [],
                       r"inputs.x.dtype: 'bfloat16' is not one of bf16, .*; write 'bf16'"),
    "negative size": ([("T: 64,", "T: -4,")], [], r"shapes.small.T is -4; sizes are integers >= 0"),
    "H/3": ([("x: {shape: [T, H]", "x: {shape: [T, H/3]")], [],
            r"inputs.x.shape\[1\]: H/3 is 10.6667 on shape set small, not a size; use // \(floor division\)"),
    "division by zero": ([("y: {shape: [T, I]", "y: {shape: [T, I//(H-H)]")], [],
                         r"outputs.y.shape\[1\]: I//\(H-H\) cannot be evaluated on shape set small .*ZeroDivision"),
    "output is an input": ([("  y: {shape: [T, I]", "  x: {shape: [T, I]")], [],
                           r"outputs: 'x' is also an input; rename one"),
    "not a Python name": ([("w_gu", "w-gu")] * 1, [], r"inputs: 'w-gu' is not a Python name .*e.g. 'w_gu'"),
    "name is a path": ([("name: geglu", "name: geglu/v2")], [], r"name: 'geglu/v2' contains a path separator"),
    "int input drawn normal": ([("x: {shape: [T, H], dtype: bf16", "x: {shape: [T, H], dtype: int64")], [],
                               r"inputs.x.init.dist: x is int64, which dist normal does not draw; write init: "
                               r"\{dist: randint"),
    "init symbol unknown": ([("scale: 1.0}}\n  w_gu", "scale: 1/sqrt(K)}}\n  w_gu")], [],
                            r"inputs.x.init.scale: expression '1/sqrt\(K\)': unknown symbol 'K' \(the shape set "
                            r"binds H, I, T\); use those, or bind K in every shape set"),
    "init scale 0": ([("scale: 1.0}}\n  w_gu", "scale: 0}}\n  w_gu")], [],
                     r"inputs.x.init.scale: 0: every value of x would be the same"),
    "high without randint": ([("scale: 1.0}}\n  w_gu", "scale: 1.0, high: 4}}\n  w_gu")], [],
                             r"init.high bounds only dist randint or positions, not normal; remove it"),
    "ignore without randint": ([("scale: 1.0}}\n  w_gu", "scale: 1.0, ignore: {value: -100}}}\n  w_gu")], [],
                               r"init.ignore marks entries of an index input \(dist randint\), not of dist normal; remove it"),
    "ignore among the values": ([("x: {shape: [T, H], dtype: bf16, init: {dist: normal, scale: 1.0}}",
                                  "x: {shape: [T, H], dtype: int64, init: {dist: randint, high: 4, "
                                  "ignore: {value: 2}}}")], [],
                                r"inputs.x.init.ignore.value: 2 lies in \[0, 4\) on shape set small, among the "
                                r"values randint draws.*use a value outside it \(-100"),
    "ignore fraction 1": ([("x: {shape: [T, H], dtype: bf16, init: {dist: normal, scale: 1.0}}",
                            "x: {shape: [T, H], dtype: int64, init: {dist: randint, high: 4, "
                            "ignore: {fraction: 1.0}}}")], [],
                          r"fraction is 1.0; it is the share of entries ignored, strictly between 0 and 1"),
    "param is a list": ([("{approximate: tanh}", "{approximate: tanh, dims: [1, 2]}")], [],
                        r"params: dims is a list \(\[1, 2\]\); a param is one number, true/false or string"),
    "shape param not whole": ([("{approximate: tanh}", "{approximate: tanh, width: H / 5}")], [],
                              r"params.width: 'H / 5' is 6.4 on shape set small, not a whole number; a shape param "
                              r"is a size or a count \(use // for floor division\)"),
    "shape param of an unbound symbol": ([("{approximate: tanh}", "{approximate: tanh, width: H // Q}"),
                                          ("small: {T: 64,", "small: {Q: 2, T: 64,")], [],
                                         r"params.width: expression 'H // Q': unknown symbol 'Q' \(the shape set "
                                         r"binds"),
    "param the reference lacks": ([("{approximate: tanh}", "{approximate: tanh, eps: 1.0e-6}")], [],
                                  r"reference: geglu\(\) takes no keyword argument 'eps' \(params gives it"),
    "argument the spec lacks": ([("params: {approximate: tanh}\n", "")], [('approximate="tanh"', "approximate")],
                                r"reference: geglu\(\) takes 'approximate', which is neither an input nor a param"),
    "gradient of an int": ([("x: {shape: [T, H], dtype: bf16, init: {dist: normal, scale: 1.0}}",
                             "x: {shape: [T, H], dtype: int32, init: {dist: randint, high: 4}}"),
                            ("target:", "gradients: [x]\ntarget:")], [],
                           r"gradients: 'x' is int32; only bf16, fp16, fp32 inputs have gradients"),
    "negative tolerance": ([("target:", "tolerance: {factor: -1}\ntarget:")], [],
                           r"tolerance.factor: Input should be greater than or equal to 0"),
    "target 0": ([("vs_gemm: 1.1", "vs_gemm: 0")], [], r"target.vs_gemm: Input should be greater than 0"),
    "no gemm": ([("gemms: [[T, 2*I, H]]", "gemms: []")], [], r"gemms: no GEMM given; list the GEMMs"),
    "flat gemm": ([("gemms: [[T, 2*I, H]]", "gemms: [T, 2*I, H]")], [],
                  r"gemms: \['T', '2\*I', 'H'\] is not a list of \[M, N, K\] entries; write e.g. \[\[T, 2\*I, H\]\]"),
    "no outputs": ([("outputs:\n  y: {shape: [T, I], dtype: bf16}\n", "outputs: {}\n")], [],
                   r"outputs: none given"),
    "expert is a folder": ([("target:", "expert: .\ntarget:")], [], r"expert: .* is a folder; point it at"),
    "reference raises": ([], [RAISE], r"reference: calling geglu\(\) on shape set small \{T: 64, H: 32, I: 48\} "
                                      r"failed: ValueError: boom; fix the reference"),
    "reference returns a tensor": ([], [AS_TENSOR], r"reference: geglu\(\) returned a Tensor; a task's reference "
                                                    r"returns its outputs by name, e.g. return \{'y': y\}"),
    "reference's key": ([], [('return {"y":', 'return {"out":')],
                        r"outputs.y: the reference returns no 'y' \(it returns out\); rename the output"),
    "declared shape": ([("y: {shape: [T, I]", "y: {shape: [T, H]")], [],
                       r"outputs.y.shape: \[T, H\] is \[64, 32\] on shape set small, but the reference returns "
                       r"\[64, 48\]; write shape: \[T, I\] \(it fits every shape set\)"),
    "reference's shape": ([], [(".to(x.dtype)}", ".to(x.dtype)[:, :-1]}")],
                          r"outputs.y.shape: \[T, I\] is \[64, 48\] on shape set small, but the reference returns "
                          r"\[64, 47\]; fix the declared shape, or the reference"),
    "mixed input dtypes": ([("x: {shape: [T, H], dtype: bf16", "x: {shape: [T, H], dtype: fp16")], [],
                           r"calling geglu\(\) on shape set small .* failed: RuntimeError: expected m1 and m2 to "
                           r"have the same dtype"),
}

# Unusual but valid: each loads, and the program above (with its edits) passes the CPU stages.
VALID = {
    "an empty shape set": ([("ragged: {T: 50,", "ragged: {T: 0,")], []),
    "CRLF line ends": ([("\n", "\r\n")], []),
    "a name with a space": ([("name: geglu", "name: my geglu")], []),
    "a fp32 output of a bf16 reference": ([("y: {shape: [T, I], dtype: bf16}", "y: {shape: [T, I], dtype: fp32}")],
                                          [], [('outputs={"y": "bf16"}', 'outputs={"y": "fp32"}')]),
    "a reference taking **kwargs": ([], [('def geglu(x, w_gu, approximate="tanh"):',
                                          'def geglu(x, w_gu, **kw):\n    approximate = kw["approximate"]')]),
    "a reference returning more": ([], [('return {"y":', 'return {"n": 3, "y":')]),
    "a reference beside a helper": ([], [("import torch.nn.functional as F", "from helper import F")]),
    "a shape param": ([("{approximate: tanh}", "{approximate: tanh, width: H, half: I // 2}")],
                      [('def geglu(x, w_gu, approximate="tanh"):',
                        'def geglu(x, w_gu, width, half, approximate="tanh"):\n'
                        '    assert (width, half) == (x.shape[1], w_gu.shape[1] // 4), (width, half)')],
                      [("def forward(x, w_gu, approximate):",
                        "def forward(x, w_gu, approximate, width, half):\n"
                        "    assert (width, half) == (x.shape[1], w_gu.shape[1] // 4), (width, half)")]),
    "shape expressions": ([("y: {shape: [T, I]", "y: {shape: [T, 2*I//2]"),
                           ("scale: 1.0}}\n  w_gu", "scale: 1 / sqrt(H), mean: 0.5}}\n  w_gu")], []),
}


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


def write(folder: Path, yaml_edits, ref_edits, program_edits=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text, ref, program = TASK, REFERENCE, PROGRAM
    for old, new in program_edits:
        program = program.replace(old, new)
    for old, new in yaml_edits:
        assert old in text, old
        text = text.replace(old, new)
    for old, new in ref_edits:
        assert old in ref, old
        ref = ref.replace(old, new)
    (folder / "geglu_ref.py").write_text(ref)
    (folder / "helper.py").write_text("import torch.nn.functional as F\n")
    (folder / "prog.py").write_text(program)
    path = folder / "geglu.yaml"
    path.write_bytes(text.encode())
    return path


@pytest.mark.parametrize("variant", sorted(BAD))
def test_a_bad_task_file_is_one_line_naming_the_fix(tmp_path, monkeypatch, variant):
    yaml_edits, ref_edits, says = BAD[variant]
    path = write(tmp_path / "task", yaml_edits, ref_edits)
    monkeypatch.chdir(path.parent)
    r = cli("tasks", "check", "geglu.yaml")
    problems = [line for line in r.output.splitlines() if line.startswith("geglu.yaml")]
    assert r.exit_code == 1 and len(problems) == 1 and re.search(says, problems[0]), r.output
    r = cli("verify", "geglu.yaml", "prog.py", "--stages", "static,reference", "--no-save", "--no-cache")
    assert r.exit_code == 2 and r.output.startswith("error: geglu.yaml") and re.search(says, r.output), r.output
    assert "Traceback" not in r.output and "verifier" not in r.output


@pytest.mark.parametrize("variant", sorted(VALID))
def test_an_unusual_task_file_works(tmp_path, monkeypatch, variant):
    path = write(tmp_path / variant.replace("*", "star"), *VALID[variant])
    monkeypatch.chdir(path.parent)
    r = cli("tasks", "check", "geglu.yaml")
    assert r.exit_code == 0 and r.output.startswith("ok: "), r.output
    r = cli("verify", "geglu.yaml", "prog.py", "--stages", "static,reference", "--no-save", "--no-cache")
    assert r.exit_code == 3 and "outcome: cpu_passed" in r.output, r.output


SCALED = ([("params: {approximate: tanh}", "params: {approximate: tanh, scale: 5e-1}")],
          [('def geglu(x, w_gu, approximate="tanh"):', 'def geglu(x, w_gu, approximate="tanh", scale=1.0):'),
           (".to(x.dtype)}", "* scale).to(x.dtype)}"), ("return {\"y\": (", "return {\"y\": ((")])
# The program of SCALED with the param typed in: y times 0.5 in a tile pass, `scale` unread.
TYPED_IN = [("import epilogue,", "import Tile, epilogue, tile_pass,"),
            ("@epilogue(", "@epilogue()\ndef half(y: Tile):\n    return {'D': y * 0.5}\n\n\n@epilogue("),
            ("def forward(x, w_gu, approximate):", "def forward(x, w_gu, approximate, scale):"),
            ('return {"y": gemm(x, w_gu, geglu)["y"]}',
             'return {"y": tile_pass(half, y=gemm(x, w_gu, geglu)["y"])["D"]}')]


@pytest.mark.parametrize("fixed", [False, True])
def test_a_float_param_is_the_calls_and_a_program_that_types_it_in_fails(tmp_path, monkeypatch, fixed):
    """The judge varies a float param (here written `5e-1`, which YAML 1.1 reads as a string and
    the spec as the number): a program that multiplies by 0.5 instead of `scale` is right at the
    written value only and is rejected, naming the param; a task that fixes the param
    (`fixed_params`) keeps it as written, and the same program passes."""
    yaml_edits, ref_edits = SCALED
    yaml_edits = [*yaml_edits, ("target:", "fixed_params: [scale]\ntarget:")] if fixed else yaml_edits
    path = write(tmp_path / "task", yaml_edits, ref_edits, TYPED_IN)
    monkeypatch.chdir(path.parent)
    r = cli("verify", "geglu.yaml", "prog.py", "--stages", "static,reference", "--no-save", "--no-cache")
    if fixed:
        assert r.exit_code == 3 and "outcome: cpu_passed" in r.output, r.output
    else:
        says = (r"`y` differs .* with params scale=[\d.e+-]+ \(the task's values varied by the judge: a program "
                r"takes its params from the call")
        assert r.exit_code == 1 and re.search(says, r.output), r.output


@pytest.mark.parametrize("folder", ["with space", "tâche ü"])
def test_a_task_in_a_folder_with_spaces_or_non_ascii_loads(tmp_path, monkeypatch, folder):
    path = write(tmp_path / folder, [], [("import torch.nn.functional as F", "from helper import F")])
    monkeypatch.chdir(tmp_path)
    r = cli("verify", path, path.parent / "prog.py", "--stages", "static,reference", "--no-cache")
    assert r.exit_code == 3, r.output
    (run,) = Path("runs").glob("*-geglu-verify")
    assert (run / "reference" / "helper.py").is_file()


def test_a_file_that_is_not_text_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("geglu.yaml").write_bytes(b"\x00\x01\xff\xfe")
    r = cli("verify", "geglu.yaml", "prog.py")
    assert r.exit_code == 2 and r.output.startswith("error: geglu.yaml: not a text file"), r.output


# `tasks new`: (arguments after the reference, what the error says); nothing is written.
NEW_BAD = {
    "dtype bfloat16": (["--input", "x=T,H:bfloat16", "--input", "w_gu=H,2*I"],
                       "--input 'x=T,H:bfloat16': 'bfloat16' is not a dtype here; write x=T,H:bf16"),
    "division by zero": (["--input", "x=T,H//0", "--input", "w_gu=H,2*I"],
                         "--input x: H//0 cannot be evaluated on shape set small"),
    "H/3": (["--input", "x=T,H/3", "--input", "w_gu=H,2*I"],
            "--input x: H/3 is 10.6667 on shape set small, not a size"),
    "input twice": (["--input", "x=T,H", "--input", "x=T", "--input", "w_gu=H,2*I"],
                    "--input 'x=T': x is given already"),
    "keyword input": (["--input", "lambda=T,H", "--input", "w_gu=H,2*I"], "with NAME a Python name"),
    "negative size": (["--input", "x=T,H", "--input", "w_gu=H,2*I", "--shapes", "ragged=T:-1,H:8,I:8"],
                      "T:-1; sizes are integers >= 0"),
    "set twice": (["--input", "x=T,H", "--input", "w_gu=H,2*I", "--shapes", "small=T:8,H:8,I:8"],
                  "a shape set 'small' is given already"),
}


@pytest.mark.parametrize("case", sorted(NEW_BAD))
def test_new_refuses_bad_arguments_and_writes_nothing(tmp_path, monkeypatch, case):
    args, says = NEW_BAD[case]
    monkeypatch.chdir(tmp_path)
    Path("geglu_ref.py").write_text(REFERENCE)
    r = cli("tasks", "new", "geglu", "--reference", "geglu_ref.py:geglu", "--shapes", "small=T:64,H:32,I:48", *args)
    assert r.exit_code == 2 and r.output.startswith("error: ") and says in r.output, r.output
    assert "Traceback" not in r.output and sorted(p.name for p in Path().iterdir()) == ["geglu_ref.py"]


@pytest.mark.parametrize("name,says", [("a/b", "NAME: 'a/b' contains a path separator"), ("", "NAME is empty"),
                                       ("3d", "NAME: '3d' does not start with a letter or _")])
def test_new_refuses_a_name_that_is_a_path_or_no_name(tmp_path, monkeypatch, name, says):
    monkeypatch.chdir(tmp_path)
    Path("geglu_ref.py").write_text(REFERENCE)
    r = cli("tasks", "new", name, "--reference", "geglu_ref.py:geglu", "--input", "x=T,H", "--input", "w_gu=H,2*I",
            "--shapes", "small=T:64,H:32,I:48")
    assert r.exit_code == 2 and r.output.startswith(f"error: {says}"), r.output
    assert sorted(p.name for p in Path().iterdir()) == ["geglu_ref.py"]


@pytest.mark.parametrize("body,says", [
    ("return {}", "the reference returned an empty dict"),
    ("return {'y-out': x}", "the reference's output 'y-out' is not a Python name"),
    ("return {'x': x * 2}", "the reference's output 'x' is also an input"),
])
def test_new_refuses_outputs_a_task_cannot_have(tmp_path, monkeypatch, body, says):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(f"def f(x):\n    {body}\n")
    r = cli("tasks", "new", "f", "--reference", "ref.py:f", "--input", "x=T,H", "--shapes", "small=T:8,H:8")
    assert r.exit_code == 2 and r.output.startswith(f"error: {says}"), r.output
    assert not Path("f.yaml").exists()


def test_new_refuses_an_out_that_is_a_file_and_a_reference_without_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("geglu_ref.py").write_text(REFERENCE)
    base = ["tasks", "new", "geglu", "--input", "x=T,H", "--input", "w_gu=H,2*I", "--shapes", "small=T:64,H:32,I:48"]
    r = cli(*base, "--reference", "geglu_ref.py:geglu", "--out", "geglu_ref.py")
    assert r.exit_code == 2 and r.output.startswith("error: --out geglu_ref.py is a file"), r.output
    r = cli(*base, "--reference", "geglu_ref.py")
    assert r.exit_code == 2 and "error: --reference 'geglu_ref.py' must be 'path/to/file.py:function'" in r.output
    assert Path("geglu_ref.py").read_text() == REFERENCE and not Path("geglu.yaml").exists()


def test_new_takes_an_fp8_input_and_what_it_writes_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text("import torch\n\n\ndef scale(x):\n    \"\"\"y = 2 x.\"\"\"\n"
                              "    return {'y': (x.float() * 2).to(torch.bfloat16)}\n")
    r = cli("tasks", "new", "scale", "--reference", "ref.py:scale", "--input", "x=T,H:fp8_e4m3",
            "--shapes", "small=T:64,H:32", "--shapes", "ragged=T:50,H:40")
    assert r.exit_code == 0, r.output
    text = Path("scale.yaml").read_text()
    assert "x: {shape: [T, H], dtype: fp8_e4m3" in text and "y: {shape: [T, H], dtype: bf16}" in text
    Path("scale.yaml").write_text(re.sub(r"(?m)^(families|gemms|target): .*$", "", text) +
                                  "families: [elementwise]\ngemms: [[T, H, H]]\n")
    r = cli("tasks", "check", "scale.yaml")
    assert r.exit_code == 0, r.output
