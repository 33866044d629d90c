"""`coda-agent eval --ray`: the same batch on a local Ray cluster as on this machine's threads.

The cluster test runs the CLI twice on the real verifier's CPU stages (static
and the reference lowering), once locally and once with ``--ray auto``
starting a local cluster, and compares the summaries.  The rest needs no
cluster: the errors that name their fix, and the Ray task itself
(:func:`coda_agent.eval.ray_pool.verify_phase`) called in this process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest
from agent_fixtures import GOOD
from eval_fixtures import buggy, write_tasks
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.eval.batch import sha256_file

# One xdist worker runs the module (scripts/test.sh: --dist loadfile): one local Ray cluster at a time.
pytestmark = pytest.mark.usefixtures("agent_env")
TESTS = Path(__file__).parent
SUITE = TESTS.parent / "tasks/llama3"
REFERENCE = ["--author", "expert", "--verifier", "eval_fixtures:reference_verifier"]
SIM_CFG = {"verifier": "eval_fixtures:SimVerifier", "shape_sets": None}


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


@pytest.fixture
def ray():
    try:
        import ray
    except ImportError:
        if os.environ.get("CI") or os.environ.get("CODA_CI"):
            pytest.fail("ray is missing in CI: scripts/setup.sh installs the [ray] extra")
        pytest.skip("ray is not installed (pip install 'coda-agent[ray]'); CI runs this test")
    return ray


def comparable(batch: Path) -> dict:
    """The summary without what says where and when it ran."""
    summary = json.loads((batch / "summary.json").read_text())
    for t in summary["tasks"]:
        for row in t["trajectories"]:
            del row["wall_s"], row["ran_on"]
    return {"suite": summary["suite"], "tasks": summary["tasks"]}


def real_tasks(folder: Path) -> Path:
    """A suite task with its expert, and its twin whose expert the static stage rejects (no judge
    starts for it: the test stays short)."""
    (folder / "experts").mkdir(parents=True)
    yaml = (SUITE / "out_proj_residual.yaml").read_text()
    expert = (SUITE / "experts/out_proj_residual.py").read_text()
    (folder / "out_proj_residual.yaml").write_text(yaml)
    (folder / "experts/out_proj_residual.py").write_text(expert)
    (folder / "out_proj_wrong.yaml").write_text(yaml.replace("name: out_proj_residual", "name: out_proj_wrong")
                                                .replace("experts/out_proj_residual.py", "experts/wrong.py"))
    (folder / "experts/wrong.py").write_text("import os\n" + expert)
    return folder


def test_the_same_batch_on_a_local_ray_cluster(tmp_path, monkeypatch, ray):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # auto must start a cluster, not join one
    # Ray's workers import the test's verifier factory and task reference from tests/, as the judges do.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    tasks = real_tasks(tmp_path / "tasks")
    local = cli("eval", tasks, *REFERENCE, "--runs-dir", tmp_path / "local")
    assert local.exit_code == 3, local.output
    on_ray = cli("eval", tasks, *REFERENCE, "--ray", "auto", "--runs-dir", tmp_path / "ray")
    assert on_ray.exit_code == 3, on_ray.output
    assert not ray.is_initialized()  # the cluster it started ended with the batch
    (local_batch,), (ray_batch,) = (tmp_path / "local").iterdir(), (tmp_path / "ray").iterdir()
    assert comparable(ray_batch) == comparable(local_batch)
    assert comparable(ray_batch)["suite"]["cpu_passed_trajectories"] == 1
    wrong = json.loads((ray_batch / "out_proj_wrong/sample-0/attempts/01/report.json").read_text())
    assert [(s["name"], s["status"]) for s in wrong["stages"]] == [("static", "failed")]
    assert json.loads((ray_batch / "batch.json").read_text())["workers"] == \
           {"ray": "auto", "cpus": os.cpu_count(), "gpus": 0}
    for report in ray_batch.glob("*/sample-0/attempts/01/report.json"):
        assert re.fullmatch(r"[\d.]+/cpu", json.loads(report.read_text())["versions"]["ran_on"]), report
    assert "Ray cluster (auto): " in on_ray.output and "no GPUs: GPU stages skipped" in on_ray.output


def test_an_address_where_nothing_answers_fails_within_seconds(tmp_path, ray):
    tasks = write_tasks(tmp_path / "tasks", {"alpha": GOOD})
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    r = cli("eval", tasks, *REFERENCE, "--ray", address, "--runs-dir", tmp_path / "runs")
    assert time.monotonic() - started < 10
    assert r.exit_code == 2 and f"--ray {address}: nothing answers at {address}" in r.output, r.output
    assert "ray start --head" in r.output and not (tmp_path / "runs").exists()
    r = cli("eval", tasks, *REFERENCE, "--ray", "127.0.0.1:port", "--runs-dir", tmp_path / "runs")
    assert r.exit_code == 2 and "is not host:port or ray://host:port" in r.output, r.output


def test_without_the_extra_the_error_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    tasks = write_tasks(tmp_path / "tasks", {"alpha": GOOD})
    r = cli("eval", tasks, *REFERENCE, "--ray", "auto", "--runs-dir", tmp_path / "runs")
    assert r.exit_code == 2 and "pip install 'coda-agent[ray]'" in r.output, r.output
    r = cli("eval", tasks, *REFERENCE, "--ray", "auto", "--workers", 2, "--runs-dir", tmp_path / "runs")
    assert r.exit_code == 2 and "give one of them" in r.output, r.output
    assert not (tmp_path / "runs").exists()


def test_the_ray_task_answers_a_crash_and_a_different_task_file_as_errors(agent_task, ray):
    from coda_agent.eval.ray_pool import verify_phase

    path, sha = str(agent_task.path), sha256_file(agent_task.path)
    report, where = verify_phase(SIM_CFG, "all", path, agent_task.name, sha, GOOD)
    assert report["outcome"] == "cpu_passed" and re.fullmatch(r"[\d.]+/cpu", where)
    report, _ = verify_phase(SIM_CFG, "all", path, agent_task.name, sha, buggy(GOOD, "cpu"))
    assert report["outcome"] == "error"
    assert report["stages"][0]["message"] == "the verifier raised RuntimeError: a simulated verifier bug on the cpu"
    report, _ = verify_phase(SIM_CFG, "all", path, agent_task.name, "0" * 64, GOOD)
    assert report["outcome"] == "error" and "missing or differs on this Ray node" in report["stages"][0]["message"]
