"""Helpers for the agent tests: a tiny task, its reference, programs, and a rule verifier.

:class:`RuleVerifier` is a real judge with a simple rule (not a mock of the
loop): a program must parse, import only from ``coda_agent.primitives``, define
``forward`` taking exactly the task's inputs and params, and do its math in an
``@epilogue`` function.  A program that computes outside the epilogue is
rejected at the reference stage, the way the real verifier's launch audit
would; a syntax error fails the static stage with its line number.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from coda_agent.verifier.report import GPU_STAGES, STAGES, Report, StageResult


def scale_add_ref(x, w, r, alpha):
    """D = alpha * (x @ w) + r"""
    return {"D": alpha * (x @ w) + r}


GOOD = '''from coda_agent.primitives import Scalar, Tile, epilogue, gemm


@epilogue()
def scale_add(acc, r: Tile, alpha: Scalar):
    return {"D": acc * alpha + r}


def forward(x, w, r, alpha):
    return {"D": gemm(x, w, scale_add, r=r, alpha=alpha)}
'''

# Computes the epilogue math outside the GEMM: the rule rejects it.
WRONG = '''from coda_agent.primitives import gemm


def forward(x, w, r, alpha):
    return {"D": gemm(x, w) * alpha + r}
'''

# Line 7 does not parse.
SYNTAX_ERROR = '''from coda_agent.primitives import Scalar, Tile, epilogue, gemm


@epilogue()
def scale_add(acc, r: Tile, alpha: Scalar):
    return {"D": acc * alpha + r}
def forward(x, w, r, alpha)
    return {"D": gemm(x, w, scale_add, r=r, alpha=alpha)}
'''

TASK_YAML = """\
name: {name}
summary: D = alpha * (x @ w) + r, the residual scale-add as one GEMM epilogue.
families: [{families}]
inputs:
  x: {{shape: [T, K]}}
  w: {{shape: [K, N], role: weight}}
  r: {{shape: [T, N], role: residual}}
params: {{alpha: 0.5}}
outputs:
  D: {{shape: [T, N], role: output}}
shapes:
  small: {{T: 64, K: 32, N: 48}}
reference: agent_fixtures:scale_add_ref
expert: experts/{name}.py
gemms: [[T, N, K]]
"""


def fenced(program: str, prose: str = "Here is the program.") -> str:
    return f"{prose}\n\n```python\n{program}```\n"


def write_task(folder: Path, name: str = "scale_add", families: str = "elementwise, tile",
               expert: str = GOOD) -> Path:
    (folder / "experts").mkdir(parents=True, exist_ok=True)
    (folder / "experts" / f"{name}.py").write_text(expert)
    path = folder / f"{name}.yaml"
    path.write_text(TASK_YAML.format(name=name, families=families))
    return path


class RuleVerifier:
    def __init__(self, good_outcome: str = "accepted", shape_sets: list[str] | None = None):
        self.good_outcome = good_outcome  # "accepted" (as on a GPU) or "cpu_passed"
        self.shape_sets = shape_sets  # recorded in each report, as the real verifier's GPU stages use them
        self.checked: list[str] = []
        self._lock = threading.Lock()

    def check(self, task, program_source: str) -> Report:
        with self._lock:
            self.checked.append(program_source)
        stages = self._stages(task, program_source)
        versions = {} if self.shape_sets is None else {"shape_sets": ",".join(self.shape_sets)}
        return Report(task=task.name, program_sha256=hashlib.sha256(program_source.encode()).hexdigest(),
                      outcome=Report.outcome_of(stages), stages=stages, versions=versions)

    def _stages(self, task, source: str) -> list[StageResult]:
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            return [StageResult(name="static", status="failed", line=e.lineno,
                                message=f"SyntaxError: {e.msg} (line {e.lineno})")]
        for node in ast.walk(tree):
            bad_from = isinstance(node, ast.ImportFrom) and node.module != "coda_agent.primitives"
            if isinstance(node, ast.Import) or bad_from:
                return [StageResult(name="static", status="failed", line=node.lineno,
                                    message="import only from coda_agent.primitives")]
        fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        want = [*task.spec.inputs, *task.spec.params]
        forward = fns.get("forward")
        if forward is None or [a.arg for a in forward.args.args] != want:
            return [StageResult(name="static", status="failed", line=forward.lineno if forward else None,
                                message=f"define forward({', '.join(want)})")]
        stages = [StageResult(name="static", status="passed")]
        if not any(_is_epilogue(d) for f in fns.values() for d in f.decorator_list):
            return stages + [StageResult(name="reference", status="failed", line=forward.lineno,
                                         message="no @epilogue function: the math runs outside the GEMM")]
        gpu = "passed" if self.good_outcome == "accepted" else "skipped"
        stages += [StageResult(name=s, status="passed", log="ptxas: 0 spills" if s == "compile" else "")
                   for s in STAGES[1:] if s not in GPU_STAGES]
        return stages + [StageResult(name=s, status=gpu) for s in GPU_STAGES]


def _is_epilogue(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id == "epilogue"


def cpu_verifier(shape_sets: list[str] | None = None) -> RuleVerifier:
    """A verifier factory for the CLI's ``--verifier``: a machine without a GPU."""
    return RuleVerifier("cpu_passed", shape_sets)


@contextlib.contextmanager
def cli_killed_when(server, requests: int, *args, gates: tuple[threading.Event, ...] = ()) -> Iterator[None]:
    """``coda-agent ARGS`` in a child process (these fixtures on its PYTHONPATH) until ``server``
    has seen ``requests`` requests; the body runs while it waits there, then the process is
    killed and ``gates`` (the server's hanging replies) are released."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "coda_agent.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(server.requests) < requests:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, f"the CLI never sent request {requests}"
            time.sleep(0.05)
        yield
    finally:
        proc.kill()
        proc.wait()
        for gate in gates:
            gate.set()

