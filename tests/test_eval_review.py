"""`coda-agent review` and `export`: list, show, decide on the record, export an autograd Function.

The export test runs the real verifier's static and reference stages on the
real out_proj_residual task (the expert program), approves the CPU-only
result explicitly, exports it and trains through it: its gradients must match
the task reference's autograd gradients.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch
from eval_fixtures import perf_program, three_tasks, write_tasks
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.kernels import Kernel
from coda_agent.tasks import SUITE_DIR, load_task

pytestmark = pytest.mark.usefixtures("agent_env")


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


def batch_of(tmp_path: Path, tasks: Path, *extra) -> Path:
    r = cli("eval", tasks, "--author", "expert", "--runs-dir", tmp_path / "runs", *extra)
    assert r.exit_code in (0, 3), r.output  # accepted, or cpu_passed (the CPU-only verifiers)
    (batch,) = (tmp_path / "runs").iterdir()
    return batch


@pytest.fixture
def cpu_batch(tmp_path):
    return batch_of(tmp_path, three_tasks(tmp_path / "tasks"), "--verifier", "eval_fixtures:SimVerifier")


def test_list_show_and_decide_on_cpu_only_runs(cpu_batch, monkeypatch):
    monkeypatch.setenv("USER", "carol")
    r = cli("review", cpu_batch)
    assert r.exit_code == 0, r.output
    # alpha and gamma passed the CPU stages; beta was rejected and is not reviewable
    assert "alpha" in r.output and "gamma" in r.output and "beta" not in r.output
    assert r.output.count("NOT accepted: CPU stages only") == 2

    run = cpu_batch / "alpha/sample-0"
    r = cli("review", run)
    assert r.exit_code == 0, r.output
    for part in ("NOT ACCEPTED: CPU stages only", "## Program", "## Diff against the expert program",
                 "(identical)", "## Transcript", "turn 1: attempt 01 cpu_passed", "performance: n/a",
                 "shape sets: small {'T': 64, 'K': 32, 'N': 48}", "ran on: cpu-"):
        assert part in r.output, part

    r = cli("review", run, "--approve")
    assert r.exit_code == 2 and "needs --allow-cpu-only" in r.output and not (run / "review.json").exists()
    r = cli("review", run, "--reject")
    assert r.exit_code == 2 and "--reject needs --why" in r.output
    r = cli("review", run, "--approve", "--allow-cpu-only")
    assert r.exit_code == 0 and "approved by carol" in r.output, r.output
    rec = json.loads((run / "review.json").read_text())
    assert (rec["decision"], rec["who"], rec["cpu_only"], rec["kind"]) == ("approved", "carol", True, "best")
    assert rec["when"].startswith("20") and len(rec["program_sha256"]) == 64

    r = cli("review", cpu_batch / "gamma/sample-0", "--reject", "--why", "duplicate of alpha", "--who", "dave")
    assert r.exit_code == 0, r.output
    assert json.loads((cpu_batch / "gamma/sample-0/review.json").read_text())["why"] == "duplicate of alpha"

    r = cli("review", cpu_batch)  # decided runs leave the queue
    assert "alpha" not in r.output and "gamma" not in r.output, r.output
    r = cli("review", cpu_batch, "--all")
    assert "approved by carol" in r.output and "rejected by dave" in r.output, r.output


def test_accepted_runs_show_their_numbers_and_approve_plainly(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a simulated GPU worker
    batch = batch_of(tmp_path, write_tasks(tmp_path / "tasks", {"fast": perf_program(0.95, 1.6)}),
                     "--verifier", "eval_fixtures:SimVerifier")
    run = batch / "fast/sample-0"
    r = cli("review", run)
    assert r.exit_code == 0, r.output
    assert "NOT ACCEPTED" not in r.output and "outcome: accepted" in r.output
    assert "vs plain GEMM: 0.95x the time" in r.output and "torch.compile speedup 1.6" in r.output
    assert "ran on: cpu-0 + gpu-0" in r.output
    r = cli("review", run, "--approve", "--who", "erin")
    assert r.exit_code == 0, r.output
    assert json.loads((run / "review.json").read_text())["cpu_only"] is False


def test_export_refuses_what_was_not_approved(cpu_batch, tmp_path):
    run = cpu_batch / "alpha/sample-0"
    r = cli("export", run, "--to", tmp_path / "out")
    assert r.exit_code == 2 and "not approved" in r.output, r.output
    r = cli("export", cpu_batch / "beta/sample-0", "--to", tmp_path / "out")
    assert r.exit_code == 2 and "nothing to export" in r.output, r.output
    cli("review", run, "--approve", "--allow-cpu-only", "--who", "x")
    r = cli("export", run, "--to", tmp_path / "out")
    assert r.exit_code == 2 and "exporting it needs --allow-cpu-only" in r.output, r.output
    (run / "best/program.py").write_text((run / "best/program.py").read_text() + "# edited after review\n")
    r = cli("export", run, "--to", tmp_path / "out", "--allow-cpu-only")
    # the attempt's report no longer backs it, before the approval's own sha256 is compared
    assert r.exit_code == 2 and "changed since its verdict" in r.output, r.output


def test_exported_function_trains_like_the_reference(tmp_path):
    task_yaml = SUITE_DIR / "out_proj_residual.yaml"
    batch = batch_of(tmp_path, task_yaml, "--verifier", "eval_fixtures:reference_verifier")
    run = batch / "out_proj_residual/sample-0"
    assert cli("review", run, "--approve", "--allow-cpu-only", "--who", "t").exit_code == 0
    out = tmp_path / "exported"
    r = cli("export", run, "--to", out, "--allow-cpu-only")
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} == {"coda_out_proj_residual.py", "coda_out_proj_residual.report.md",
                                               "coda_out_proj_residual.report.json",
                                               "coda_out_proj_residual.review.json"}
    spec = importlib.util.spec_from_file_location("coda_out_proj_residual", out / "coda_out_proj_residual.py")
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    assert kernel.PROGRAM_SOURCE == (run / "best/program.py").read_text()
    assert issubclass(kernel.OutProjResidualFunction, torch.autograd.Function)
    reference = load_task(task_yaml).reference_fn

    class Block(torch.nn.Module):
        """A projection with a residual, then a small head: the kernel sits mid-model."""

        def __init__(self, op):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.Wo = torch.nn.Parameter((torch.randn(64, 64, generator=g) / 8).to(torch.bfloat16))
            self.head = torch.nn.Parameter(torch.randn(64, 4, generator=g).to(torch.bfloat16))
            self.op = op

        def forward(self, attn, residual):
            y = self.op(attn, self.Wo, residual)["y"]
            return (y.float() @ self.head.float()).square().mean()

    g = torch.Generator().manual_seed(1)
    attn0, res0 = (torch.randn(96, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    grads = {}
    for name, op in (("kernel", kernel.out_proj_residual), ("reference", reference)):
        model = Block(op)
        attn, res = attn0.clone().requires_grad_(True), res0.clone().requires_grad_(True)
        model(attn, res).backward()
        grads[name] = {"Wo": model.Wo.grad, "head": model.head.grad, "attn": attn.grad, "residual": res.grad}
    for k, want in grads["reference"].items():
        got = grads["kernel"][k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 2e-2, (k, rel.item())


def test_an_exported_function_takes_params_as_its_reference_does(tmp_path):
    """The plain call's params follow the inputs, positionally or by name, as in the reference
    (`rmsnorm(x, w, 1e-5)`), with the task's values as defaults."""
    from types import SimpleNamespace

    from coda_agent.eval.export import render_module

    spec_text = (SUITE_DIR / "residual_rmsnorm.yaml").read_text()
    program = (SUITE_DIR / "experts" / "residual_rmsnorm.py").read_text()
    kernel = Kernel.from_source(program, spec_text)
    c = SimpleNamespace(path=tmp_path, result={"best_attempt": 0}, report=lambda: {"outcome": "cpu_passed"},
                        cpu_only=True, program=program)
    text = render_module(kernel, c, {"who": "t", "when": "now"}, "coda_residual_rmsnorm", spec_text)
    namespace: dict = {}
    exec(compile(text, "coda_residual_rmsnorm.py", "exec"), namespace)  # noqa: S102 - the module just rendered
    params = inspect.signature(namespace["residual_rmsnorm"]).parameters
    assert list(params) == [*kernel.inputs, "eps"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())
    assert params["eps"].default == kernel.params["eps"]
