"""The static stage's provenance rules on what an honest program needs (the corpus covers the
refusals): names resolve like Python resolves them, constants may be computed from math."""

from __future__ import annotations

import pytest
from verifier_helpers import TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier.static import check_source

HEAD = "from coda_agent.primitives import Tile, epilogue, gemm, sigmoid\n"
BACKWARD = '''

def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
'''


@pytest.fixture(scope="module")
def spec():
    return load_task(TASK_PATH).spec


def _program(module_level: str, epilogue_body: str = "return {\"D\": acc + residual}", forward: str = "") -> str:
    return (HEAD + module_level + f'''

@epilogue()
def add_residual(acc, residual: Tile):
    {epilogue_body}


def forward(x, w, r):
    {forward or 'return {"y": gemm(x, w, add_residual, residual=r)["D"]}'}
''' + BACKWARD)


@pytest.mark.parametrize("module_level,body,forward", [
    ("import math\nGELU_C = math.sqrt(2 / math.pi)", "return {\"D\": acc + residual * GELU_C}", ""),
    ("from math import pi as PI, sqrt\nC = sqrt(PI) * 2 ** -3", "return {\"D\": acc + residual * C}", ""),
    ("SCALES = (1.0, -0.5, 2 ** 3)", "return {\"D\": acc + residual * SCALES[1]}", ""),
    ("", "s = sigmoid(acc)\n    return {\"D\": acc * s + residual}", ""),
    ("from math import e as fr", "return {\"D\": acc + residual}",
     "fr = [gemm(x, w, add_residual, residual=r)[\"D\"] for _ in range(1)]\n    return {\"y\": fr[0]}"),
    ("", "return {\"D\": acc + residual}",
     "n = len(x.shape)\n    assert n == 2, f\"{n} dims\"\n    return {\"y\": gemm(x, w, add_residual, residual=r)[\"D\"]}"),
    ("", "return {\"D\": acc + residual}",
     "if len(x.shape) != 2:\n        raise ValueError(\"x is \" + str(x.shape))\n    return {\"y\": x}"),
])
def test_honest_constructs_pass(spec, module_level, body, forward):
    assert check_source(_program(module_level, body, forward), spec) == []


@pytest.mark.parametrize("module_level,body,forward,why", [
    ("from math import e as fr", "return {\"D\": acc + residual}",
     "fr = fr.real\n    return {\"y\": gemm(x, w, add_residual, residual=r)[\"D\"]}", "attribute `.real`"),
    ("", "return {\"D\": acc + residual}", "return {\"y\": gemm.__wrapped__(x, w)}", "dunder attributes"),
    ("", "return {\"D\": acc + residual}", "g = gemm.cache\n    return {\"y\": g}", "do not reach inside them"),
    ("X = [1, 2]", "return {\"D\": acc + residual}", "", "module-level state"),
    ("", "return {\"D\": acc + residual}", "import math\n    return {\"y\": x}", "inside a function"),
    ("", "return {\"D\": acc + residual}", "return {\"y\": id(x)}", "`id`: dynamic code"),
    ("", "return {\"D\": acc + residual}", "return {\"y\": frobnicate(x)}", "neither defined in the program"),
    ("gemm = 3", "return {\"D\": acc + residual}", "", "bound twice at module level"),
    # a value read as text (the device a rank runs on): only an error's message may hold one
    ("", "return {\"D\": acc + residual}", "d = str(x.device)\n    return {\"y\": x}", "`str`: a program reads no "
     "value as text"),
    ("", "return {\"D\": acc + residual}", "d = f\"{x.device}\"\n    return {\"y\": x}", "a value formatted as text"),
    ("", "return {\"D\": acc + residual}", "d = \"%s\" % (x.device,)\n    return {\"y\": x}", "a value formatted as text"),
])
def test_provenance_refusals(spec, module_level, body, forward, why):
    text = "; ".join(map(str, check_source(_program(module_level, body, forward), spec)))
    assert why in text, text


@pytest.mark.parametrize("module_level,body,why", [
    ("", "return {\"D\": acc + residual * len(residual)}", "`len(...)` is not the catalogue's epilogue math"),
    ("", "return {\"D\": acc + residual.float()}", "`.float()` calls a method"),
    ("", "return {\"D\": acc + residual[0]}", "indexing (`x[...]`)"),
    ("", "return {\"D\": acc + (residual if acc.dtype else 0.0)}", "a Python branch or loop on values"),
    ("", "return {\"D\": acc + sum(residual for _ in range(2))}", "`sum(...)` is not the catalogue's"),
    ("", "return {\"D\": acc + sigmoid(*[residual])}", "unpacking with * is not epilogue math"),
    ("SCALES = (1.0, 2.0)", "return {\"D\": acc + residual * 0.0}\n\n\n@epilogue()\ndef shadow(acc, SCALES: Tile):\n"
     "    return {\"D\": acc + SCALES[0]}", "indexing (`x[...]`)"),  # a parameter, not the module's tuple
    ("def helper(v):\n    return v.sum()", "return {\"D\": acc + helper(residual)}",
     "inside `helper`, which the @epilogue fn `add_residual` calls: `.sum()` calls a method"),
])
def test_an_epilogue_body_is_epilogue_math(spec, module_level, body, why):
    """Both lowerings evaluate the body, the compiled kernel on values with no attributes, items,
    length or truth value: a body that reads them computes something else on the GPU."""
    text = "; ".join(map(str, check_source(_program(module_level, body), spec)))
    assert why in text, text


def test_a_program_too_deep_to_parse_is_refused_not_a_crash(spec):
    text = "; ".join(map(str, check_source("x = " + "(" * 5000 + "1" + ")" * 5000 + "\n", spec)))
    assert "cannot be read" in text or "syntax error" in text


@pytest.mark.parametrize("signature,why", [
    ("saved, dy, needs", None),
    ("saved, dy, *, needs", None),
    ("saved, dy, needs, scale", "parameters ['scale'] the verifier does not pass"),
    ("saved, dy, need", "parameters ['need'] the verifier does not pass"),
])
def test_backward_may_declare_needs_and_nothing_else(spec, signature, why):
    """``needs`` (the gradients the caller reads, kernels/contract.py) is the one parameter a
    backward may add to the task's upstream gradients."""
    source = _program("").replace("def backward(saved, dy):", f"def backward(saved, {signature.split(', ', 1)[1]}):")
    assert f"def backward({signature})" in source
    text = "; ".join(map(str, check_source(source, spec)))
    assert (why in text) if why else text == "", text


# Python evaluates a function's defaults, decorators and annotations, and a comprehension's first
# iterable, in the scope around it: a name there that the inner scope also binds is the outer one.
SCOPE_ESCAPES = {
    "lambda default": "    g = (lambda getattr=getattr: getattr)()\n",
    "lambda keyword-only default": "    g = (lambda *, open=open: open)()\n",
    "list comprehension iterable": "    g = [getattr for getattr in [getattr]][0]\n",
    "dict comprehension iterable": "    g = {vars: 0 for vars in [vars]}\n",
    "generator iterable": "    g = list(eval for eval in [eval])\n",
    "set comprehension iterable": "    g = {open for open in [open]}\n",
}


@pytest.mark.parametrize("name", list(SCOPE_ESCAPES))
def test_a_name_is_resolved_where_python_evaluates_it(name):
    source = ("from coda_agent.primitives import epilogue, gemm\n\n\ndef forward(x, w, r):\n"
              + SCOPE_ESCAPES[name] + "    return {}\n")
    found = "; ".join(str(v) for v in check_source(source, load_task(TASK_PATH).spec))
    assert "dynamic code" in found or "files, the network" in found, found


def test_a_decorator_argument_and_an_annotation_are_read_outside_the_function():
    source = ("from coda_agent.primitives import epilogue, gemm\n\n\n@epilogue(outputs=vars)\ndef f(acc, vars):\n"
              "    return {'D': acc}\n\n\ndef helper(x, eval: eval):\n    return x\n\n\ndef forward(x, w, r):\n"
              "    return {}\n")
    found = "; ".join(str(v) for v in check_source(source, load_task(TASK_PATH).spec))
    assert "line 4: `vars`" in found and "line 9: `eval`" in found, found
