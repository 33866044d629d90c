"""The batch directory: one run directory per trajectory, plus the batch's own files.

Layout (format 1)::

    runs/batch-<utc>/
      batch.json            format, created, the tasks (name, path, sha256 of the YAML), samples,
                            the merged AgentConfig (never the API key), turns_given, workers
      <task>/sample-<i>/    one run directory per (task, sample), agent/rundir.py's layout
                            with samples=1 (so ``coda-agent solve --resume`` works on it too)
      summary.json          per task and suite metrics (:mod:`.summary`), rebuilt from the runs
      summary.md            the same as Markdown
      report.html           ``coda-agent report``: one self-contained page with inline SVG plots

Run directories are made by ``RunDir.create`` in ``.staging/`` and renamed
into place, so ``<task>/sample-<i>/`` either does not exist or is a complete
run directory (task.yaml, config.json, versions.json): a kill between the two
cannot leave a half-made run that resume would mistake for one, or create the
same trajectory twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda_agent.agent.protocols import CodaError
from coda_agent.agent.rundir import RunDir, new_dir, read_record, utc_now, utc_stamp
from coda_agent.storage import write_json

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task

BATCH_FORMAT = 1


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def newest_batch(runs_dir: Path) -> Path:
    """The most recent batch directory under ``runs_dir`` (names sort by their UTC stamp)."""
    batches = sorted((p for p in runs_dir.glob("batch-*") if (p / "batch.json").is_file()),
                     key=lambda p: json.loads((p / "batch.json").read_text()).get("created_utc", ""))
    if not batches:
        raise CodaError(f"no batch directory under {runs_dir}/; run `coda-agent eval` first, or give BATCH "
                        "(or --runs-dir where the batches are)")
    return batches[-1]


class BatchDir:
    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path, self.meta = path, meta

    @classmethod
    def create(cls, runs_dir: Path, tasks: list["Task"], samples: int, config: dict[str, Any],
               turns_given: bool, workers: dict[str, Any]) -> "BatchDir":
        path = new_dir(runs_dir / f"batch-{utc_stamp()}")
        meta = {"format": BATCH_FORMAT, "created_utc": utc_now(), "samples": samples,
                "tasks": [{"name": t.name, "path": str(Path(t.path).resolve()), "sha256": sha256_file(t.path)}
                          for t in tasks],
                # turns_given: --max-turns was set; else the offline authors get their natural end
                "config": config, "turns_given": turns_given, "workers": workers}
        write_json(path / "batch.json", meta)
        return cls(path, meta)

    @classmethod
    def open(cls, path: Path) -> "BatchDir":
        meta = read_record(path / "batch.json", BATCH_FORMAT, "batch", str(path),
                           "; give a runs/batch-<utc>/ folder")
        return cls(path, meta)

    @property
    def samples(self) -> int:
        return self.meta["samples"]

    def task_names(self) -> list[str]:
        return [t["name"] for t in self.meta["tasks"]]

    def load_tasks(self) -> list["Task"]:
        """The batch's tasks, refusing any whose YAML changed since the batch started."""
        from coda_agent.tasks import load_task

        tasks = []
        for t in self.meta["tasks"]:
            if not Path(t["path"]).is_file() or sha256_file(Path(t["path"])) != t["sha256"]:
                raise CodaError(f"{t['path']} changed or vanished since the batch started; resuming would "
                                "mix two specs (restore it or start a new batch)")
            tasks.append(load_task(t["path"]))
        return tasks

    def run_path(self, task_name: str, sample: int) -> Path:
        return self.path / task_name / f"sample-{sample}"

    def result(self, task_name: str, sample: int) -> dict[str, Any] | None:
        """The trajectory's result.json, None before it has one.  Read directly: a TrajectoryDir
        would create the directory, racing ``run`` (which must find it absent or complete)."""
        f = self.run_path(task_name, sample) / "result.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def run(self, task: "Task", sample: int, author: str, config: dict[str, Any]) -> RunDir:
        """The trajectory's run directory: opened if it exists, else made whole and renamed into place."""
        final = self.run_path(task.name, sample)
        if final.is_dir():
            return RunDir.open(final)
        staging = self.path / ".staging"
        made = RunDir.create(staging, task, f"{author}-s{sample}", config)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(made.path, final)
        return RunDir(final, made.samples)

    def clean_staging(self) -> None:
        """Run directories a kill left half-made in ``.staging/``: never renamed, so never used."""
        shutil.rmtree(self.path / ".staging", ignore_errors=True)
