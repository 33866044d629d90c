"""The program rules table (program_rules.py): what the catalogue text says is what the static stage accepts.

Programs go through the real static stage (``check_source``) against the
verifier tests' task; the catalogue text is the real rendered one.
"""

from __future__ import annotations

import pytest
import torch
from verifier_helpers import TASK_PATH

from coda_agent import program_rules as rules
from coda_agent.tasks import load_task
from coda_agent.verifier.static import check_source

HEADER = "import math\nfrom coda_agent.primitives import Tile, epilogue, gemm, zeros_like\n"
FORWARD = '''

@epilogue()
def add_r(acc, r: Tile):
    return {"D": acc + r}


def forward(x, w, r):
    BODY
    return {"y": gemm(x, w, add_r, r=r)["D"]}


def backward(saved, dy):
    return {"dx": gemm(dy, saved["w"].t())["D"], "dw": gemm(saved["x"].t(), dy)["D"], "dr": dy}
'''


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH).spec


@pytest.fixture(scope="module")
def catalogue() -> str:
    from coda_agent.primitives import render_catalogue

    return render_catalogue()


def program(body: str, module_level: str = "") -> str:
    return HEADER + module_level + FORWARD.replace("BODY", body)


def test_module_constants_from_math_are_allowed(task):
    src = program("scale = GELU_C * HALF", "GELU_C = math.sqrt(2 / math.pi)\nHALF = 0.5 * GELU_C\n")
    assert check_source(src, task) == []
    src = program("scale = 1.0", "CACHE = {}\n")
    assert "module-level state" in str(check_source(src, task)[0])


def test_every_tensor_attribute_and_method_of_the_table_passes_the_static_stage(task):
    """``.device`` is read as a catalogue call's argument (it is not kept: see below)."""
    reads = "; ".join(f"a{i} = x.{a}" if a != "device" else f"a{i} = zeros_like(x.device)"
                      for i, a in enumerate(rules.TENSOR_ATTRIBUTES))
    calls = "; ".join(f"m{i} = x.{m}()" if m != "view" else f"m{i} = x.view(-1)"
                      for i, m in enumerate(rules.TENSOR_METHODS))
    containers = "outs = {}; parts = []; parts.append(x); keys = outs.keys(); v = outs.values(); " \
                 "it = outs.items(); g = outs.get('y')"
    body = f"{reads}; {calls}; {containers}; chunk = x[0:8]; assert x.shape[0] > 0\n    " \
           "for i in range(2):\n        parts.append(i)"
    assert check_source(program(body), task) == []


@pytest.mark.parametrize("body", ["d = x.device", "y = zeros_like(x, x.device == x.device)",
                                  "y = zeros_like(x, [x.device])"])
def test_a_device_is_read_only_as_a_catalogue_calls_argument(task, body):
    (v,) = check_source(program(body), task)
    assert "`.device` is read only as an argument of a catalogue call" in v.message


def test_a_method_outside_the_table_is_rejected_naming_the_table(task):
    (v,) = check_source(program("h = x.float()"), task)
    assert "method call `.float()`" in v.message
    for m in (*rules.TENSOR_METHODS, *rules.CONTAINER_METHODS):
        assert f".{m}()" in v.message
    (v,) = check_source(program("h = x.is_contiguous"), task)
    assert all(f".{a}" in v.message for a in rules.TENSOR_ATTRIBUTES)


def test_the_catalogue_text_states_the_table(catalogue):
    for name in rules.PROGRAM_API:
        assert f"`{name}`" in catalogue, name
    for a in rules.TENSOR_ATTRIBUTES:
        assert f"`.{a}`" in catalogue, a
    for m in (*rules.TENSOR_METHODS, *rules.CONTAINER_METHODS):
        assert f"`.{m}()`" in catalogue, m
    for r in rules.HOST_RULES:
        assert r.rule in catalogue
    assert "`GELU_C = math.sqrt(2 / math.pi)`" in catalogue and "accumulate_into=buf" in catalogue
    assert "no tensor methods beyond" not in catalogue


def test_every_reduction_has_its_ragged_lane_rule(catalogue):
    from coda_agent.primitives import reductions

    declared = {reductions.col_sum, reductions.col_max, reductions.row_sum, reductions.online_lse,
                reductions.select_col, reductions.head_rstd}
    ruled = {r.op.split("(")[0] for r in rules.RAGGED_LANES}
    assert {f.__name__ for f in declared} <= ruled
    for r in rules.RAGGED_LANES:
        assert f"- `{r.op}`: {r.rule}" in catalogue


def test_config_none_lines_are_what_gemm_picks(catalogue):
    """The text is computed, not written: each case's tile is default_config's, and the small-shape
    case is what a real gemm call records in the launch ledger."""
    from coda_agent.primitives import Scalar, epilogue, gemm, launch_ledger, lowering
    from coda_agent.primitives.catalogue import config_lines

    lines = config_lines()
    assert len(lines) == len(rules.CONFIG_CASES) and all(line in catalogue for line in lines)

    @epilogue()
    def scaled(acc, s: Scalar):
        return {"D": acc * s}

    small = next(c for c in rules.CONFIG_CASES if c.epilogue == "elementwise" and c.m < 1024)
    a, b = torch.randn(small.m, 64).bfloat16(), torch.randn(64, small.n).bfloat16()
    with lowering("reference"), launch_ledger() as ledger:
        gemm(a, b, scaled, s=2.0)
    (launch,) = ledger
    assert f"- {small.what}: `{launch.config}`" in catalogue
    big = next(c for c in rules.CONFIG_CASES if c.epilogue == "elementwise" and c.m >= 1024)
    assert f"- {big.what}: `{launch.config}`" not in catalogue  # the two differ: the text says which is which


# A program the static stage misread (a name resolved in the wrong scope) still runs by the rules:
# its module's builtins are the table's, and its imports find the catalogue's program API and math.
ESCAPES = {
    "a lambda default": ("def forward(x):\n    return (lambda e=eval: e)()('1')\n", "name 'eval' is not defined"),
    "a comprehension's iterable": ("def forward(x):\n    return [g for g in [getattr]][0](x, 'shape')\n",
                                   "name 'getattr' is not defined"),
    "vars": ("def forward(x):\n    return vars(x)\n", "name 'vars' is not defined"),
    "open": ("def forward(x):\n    return open('/etc/hostname').read()\n", "name 'open' is not defined"),
    "an import in a function": ("def forward(x):\n    import os\n    return os.environ\n", "import of `os`"),
    "a harness entry point": ("def forward(x):\n    from coda_agent.primitives import load_program\n"
                              "    return load_program\n", "cannot import name 'load_program'"),
    "a catalogue submodule": ("def forward(x):\n    from coda_agent.primitives import program\n"
                              "    return program\n", "cannot import name 'program'"),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_a_loaded_program_finds_only_the_builtins_and_imports_of_the_rules(name):
    from coda_agent.primitives import load_program

    source, error = ESCAPES[name]
    mod = load_program("import math\nfrom coda_agent.primitives import gemm\n\n" + source, "escape")
    assert mod.gemm is not None and mod.math.sqrt(4.0) == 2.0
    with pytest.raises((NameError, ImportError), match=error):
        mod.forward(torch.zeros(2, 2))
    assert set(mod.__builtins__) == rules.BUILTINS | rules.MESSAGE_BUILTINS | {"__import__"}


def test_without_the_python_rules_a_program_has_pythons_builtins():
    """What the verifier does without its static stage (its tests' stand-in for an escaped program)."""
    from coda_agent.primitives import load_program

    mod = load_program(ESCAPES["vars"][0], "escaped", python_rules=False)
    assert mod.forward(torch.zeros(2)) is not None


def test_pytorchs_own_imports_from_a_programs_frame_find_their_modules():
    """A tensor compared with a Python number makes PyTorch's C code import `torch` through the
    running frame's builtins, the program's, once per process: a fresh process loads a program
    whose epilogue does that (its dry run runs the fn on the host)."""
    import subprocess
    import sys
    from pathlib import Path

    program = Path(__file__).parent / "bad_programs" / "extreme" / "flushes_small_values.py"
    code = ("from coda_agent.primitives import load_program\n"
            f"load_program(open({str(program)!r}).read(), 'fresh')\nprint('loaded')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]
