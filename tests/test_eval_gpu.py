"""GPU tier: eval's verification threads with the real verifier on a GPU host.

The CPU thread's judges see no GPU, the GPU thread's judges see its GPU alone,
and a suite expert goes through every stage with its report saying where.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.devices import visible_gpus
from coda_agent.tasks import load_task
from coda_agent.verifier import GPU_STAGES, STAGES, Verifier

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("agent_env"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TASK = Path(__file__).parent.parent / "tasks/llama3/out_proj_residual.yaml"


def test_a_verifier_without_a_device_skips_the_gpu_stages():
    task = load_task(TASK)
    report = Verifier(stages=["static", "reference", "correctness"], cache=False, device="").check(
        task, task.expert_path.read_text())
    assert [(s.name, s.status) for s in report.stages] == [("static", "passed"), ("reference", "passed"),
                                                           ("correctness", "skipped")]
    assert report.outcome == "cpu_passed" and report.versions["device"] == "cpu"


def test_eval_runs_the_gpu_stages_on_the_gpu_thread(tmp_path):
    r = CliRunner().invoke(app, ["eval", str(TASK), "--author", "expert", "--sets", "small",
                                 "--runs-dir", str(tmp_path / "runs")], catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output  # accepted, or correct but slow on the small set
    (batch,) = (tmp_path / "runs").iterdir()
    report = json.loads((batch / "out_proj_residual/sample-0/attempts/01/report.json").read_text())
    assert report["outcome"] in ("accepted", "correct_slow"), report
    assert [s["name"] for s in report["stages"]] == list(STAGES)
    assert all(s["status"] in ("passed", "slow") for s in report["stages"] if s["name"] in GPU_STAGES)
    assert report["versions"]["ran_on"] == f"cpu-0 + gpu-{visible_gpus()[0]}"
    assert report["versions"]["device"] == torch.cuda.get_device_name(0) + " sm_{}{}".format(
        *torch.cuda.get_device_capability(0))
