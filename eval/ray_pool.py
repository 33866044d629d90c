"""Verification past one host: every phase of a check is a Ray task (``coda-agent eval --ray``).

:class:`RayPool` is the ``Verifier`` protocol of :class:`.pool.VerifierPool`
with Ray in place of the threads: the same phases (:func:`.pool.check_in_phases`),
the same verifier built the same way inside the task (:func:`.pool.build_verifier`),
the same reports, so the run directories, the summary and ``--resume`` are
those of a local batch.  Ray places the tasks by their resources:

- a cluster with GPUs splits the stages as a GPU host does: the CPU stages
  are a task with ``num_cpus=1, num_gpus=0`` (its judges see no GPU), the GPU
  stages one with ``num_gpus=1`` (Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPU
  it gives the task, and the judges start with that);
- a cluster without GPUs runs the whole check as a ``num_cpus=1`` task
  (``cpu_passed`` at best, as on a machine without CUDA).

Isolation is still the verifier's (a sandboxed runner behind a judge per
check); a task that raises, or a Ray worker that dies past Ray's own retries,
is an ``error`` report for that candidate.  A worker process keeps one
verifier session per (phase, GPU) for its life, so its judges are reused by
the next tasks and end with the worker.  ``report.versions["ran_on"]`` names
the node: ``"10.0.0.5/cpu + 10.0.0.7/gpu-2"``.

Every node needs coda-agent installed (``pip install 'coda-agent[ray]'``) and
the task files at the paths the driver gives (a shared filesystem or the same
checkout): a task sees its YAML's sha256 and refuses a different file.

``ray`` is imported only here, and this module only with ``--ray``.
``--ray auto`` joins the cluster Ray finds (``RAY_ADDRESS``, or one that
``ray start`` runs on this machine), else starts a local one for the batch;
``--ray ADDRESS`` joins that one and fails within seconds when nothing answers
there (Ray itself would keep retrying for minutes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda_agent.agent.protocols import CodaError
from coda_agent.verifier.report import Report

from .batch import sha256_file
from .pool import build_verifier, check_in_phases, error_report

if TYPE_CHECKING:
    from coda_agent.agent.config import AgentConfig
    from coda_agent.tasks.spec import Task

CONNECT_TIMEOUT_S = 5.0
_SESSIONS: dict[tuple[str, str, str | None], Any] = {}  # in a Ray worker: (config, phase, GPU) -> verifier


def verify_phase(verifier_cfg: dict[str, Any], phase: str, task_path: str, task_name: str, task_sha256: str,
                 source: str) -> tuple[dict[str, Any], str]:
    """The Ray task: one phase of one check on this node; the report as JSON and where it ran."""
    import ray

    from coda_agent.agent.config import AgentConfig
    from coda_agent.tasks import load_task

    device = "" if phase == "cpu" else os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"{ray.util.get_node_ip_address()}/" + (f"gpu-{device}" if phase == "gpu" else "cpu")
    path = Path(task_path)
    if not path.is_file() or sha256_file(path) != task_sha256:
        why = (f"{task_path} is missing or differs on this Ray node ({where}); every node needs the task files "
               "at the driver's paths (a shared filesystem or the same checkout)")
        return error_report(task_name, phase, why).model_dump(mode="json"), where
    key = (json.dumps(verifier_cfg, sort_keys=True), phase, device)
    if key not in _SESSIONS:
        verifier = build_verifier(AgentConfig(**verifier_cfg), phase, device)
        verifier.__enter__()  # for the worker's life: its judges end when the worker process does
        _SESSIONS[key] = verifier
    try:
        report = _SESSIONS[key].check(load_task(path), source)
    except Exception as e:  # noqa: BLE001 - the candidate must be answered, and the batch go on
        report = error_report(task_name, phase, f"the verifier raised {type(e).__name__}: {e}",
                              traceback.format_exc())
    return report.model_dump(mode="json"), where


class RayPool:
    """A ``Verifier`` whose ``check`` runs as Ray tasks (module docstring)."""

    def __init__(self, cfg: "AgentConfig", address: str):
        self.address = address
        self.ray = connect(address)
        try:
            resources = self.ray.cluster_resources()
            self.cpus, self.gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
            self.split = self.gpus > 0
            for phase in ("cpu", "gpu") if self.split else ("all",):
                build_verifier(cfg, phase, "")  # a verifier that cannot be made fails here, not in every task
        except BaseException:
            self.ray.shutdown()
            raise
        self._cfg = cfg.model_dump(mode="json", include={"verifier", "shape_sets"})
        self._task = self.ray.remote(verify_phase)
        self._sha256: dict[str, str] = {}
        self.closed = False

    def describe(self) -> str:
        return f"Ray cluster ({self.address}): {self.cpus} CPUs, " + (
            f"{self.gpus} GPUs" if self.gpus else "no GPUs: GPU stages skipped")

    def meta(self) -> dict[str, Any]:
        """Where the batch is verified, for batch.json."""
        return {"ray": self.address, "cpus": self.cpus, "gpus": self.gpus}

    def check(self, task: "Task", program_source: str) -> Report:
        if self.closed:
            raise RuntimeError("the verifier pool is closed")
        path = str(Path(task.path).resolve())
        sha = self._sha256.setdefault(path, sha256_file(Path(path)))

        def run(phase: str) -> tuple[Report, str]:
            resources = {"num_gpus": 1} if phase == "gpu" else {"num_cpus": 1, "num_gpus": 0}
            ref = self._task.options(**resources).remote(self._cfg, phase, path, task.name, sha, program_source)
            try:
                report, where = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                return error_report(task.name, phase, f"the Ray task failed: {e}"), "ray"
            return Report.model_validate(report), where

        return check_in_phases(run, self.split)

    def close(self, wait: bool = True) -> None:
        """Leave the cluster (one ``--ray auto`` started ends with it; its tasks too, so ``wait``
        changes nothing)."""
        if not self.closed:
            self.closed = True
            self.ray.shutdown()

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str) -> Any:
    """The ``ray`` module, connected to ``address`` (module docstring: auto or ADDRESS)."""
    try:
        import ray
    except ImportError:
        raise CodaError("--ray needs Ray, an optional extra: pip install 'coda-agent[ray]'") from None
    given = os.environ.get("RAY_ADDRESS") if address == "auto" else address
    if given and given != "local":
        _reachable(address if address != "auto" else "auto (RAY_ADDRESS)", given)
    quiet = {"logging_level": logging.WARNING}
    try:
        if address != "auto":
            ray.init(address=address, **quiet)
            return ray
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster to join: a local one, for this batch
            ray.init(include_dashboard=False, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CodaError(f"--ray {address}: Ray could not connect ({type(e).__name__}: {e}); check the address "
                        "(`ray status` on the head node prints it) or use --ray auto") from None
    return ray


def _reachable(flag: str, address: str) -> None:
    """Fail fast when nothing listens at a Ray address (``host:port`` or ``ray://host:port``)."""
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").partition(":")
    try:
        with socket.create_connection((host, int(port or (10001 if client else 6379))), CONNECT_TIMEOUT_S):
            pass
    except ValueError:
        raise CodaError(f"--ray {flag}: {address!r} is not host:port or ray://host:port") from None
    except OSError as e:
        raise CodaError(f"--ray {flag}: nothing answers at {address} ({e}); start the cluster there "
                        "(`ray start --head` on that machine), give the address `ray status` prints, "
                        "or use --ray auto for a local cluster") from None
