"""Run directories: everything a run sent, received and judged, written as it happens.

Layout (format 1)::

    runs/<utc>-<task>-<author>/         author: the model name, "expert", "replay" or "verify"
      task.yaml          the task spec as used (a byte copy of the YAML)
      reference/         copies of the files the task's reference reads (what the prompt showed)
      config.json        the merged AgentConfig (never the API key), the task's path, format
      versions.json      python, coda-agent, quack, cutlass, torch, triton, openai, CUDA, GPU name or "none"
      summary.json       all samples: their results, totals, how many accepted
      # the trajectory; with --samples k > 1 each one lives in sample-0 .. sample-(k-1)/
      transcript.jsonl   one JSON event per line, appended and fsynced as it happens
      attempts/NN/       program.py, report.json, compile.log (the compile stage's log, if any)
      accepted/          program.py, report.md: only for outcome "accepted"
      best/              program.py, report.md: the best attempt when none was accepted
                         (cpu_passed lands here: it is not an acceptance)
      result.json        stop reason, turns, attempts, tokens, cost, wall time, best attempt

Transcript events: ``{"event": "start"}``, ``{"event": "message", "role",
"content", "kind": system|task|assistant|feedback|format, "turn", "usage"?,
"finish_reason"?}``, ``{"event": "attempt", "attempt", "outcome"}``,
``{"event": "stop", "reason", "detail"}``; each carries ``time`` (UTC).

``coda-agent verify`` writes the same layout for its one verdict (author
``verify``; config.json holds the verifier's settings and the program's path;
one attempt, no transcript), so ``review`` and ``export`` take a hand-written
program exactly as they take an LLM's.

Resuming (``solve --resume RUN``): every file but the transcript is written
atomically (temp file + ``os.replace``), so a killed run leaves either the old
or the new version.  The transcript may end in a half-written line; it is
dropped on read and cut off before appending.  The conversation is rebuilt
from the transcript's messages; an attempt counts once its ``report.json``
exists, and a reply that was logged but not yet judged is judged on resume
(never asked for again), so no attempt is lost or repeated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from coda_agent.storage import write_atomic, write_json
from coda_agent.versions import environment

from .protocols import CodaError

RUN_FORMAT = 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def utc_stamp() -> str:
    """The UTC second, as run and batch directory names start or end with it."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def new_dir(base: Path) -> Path:
    """``base`` made here, or ``base-2``, ``base-3``, ... when two runs start in the same second."""
    path, i = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            i += 1
            path = base.with_name(f"{base.name}-{i}")


def read_record(file: Path, fmt: int, what: str, where: str, fix: str = "") -> dict[str, Any]:
    """The JSON record that makes a folder a ``what`` directory (a run, a batch), refused when it
    is absent (``fix`` says what to give instead) or in a format this coda-agent does not write;
    ``where`` starts each message."""
    if not file.is_file():
        raise CodaError(f"{where}: not a {what} directory (no {file.name}){fix}")
    record = json.loads(file.read_text())
    if record.get("format") != fmt:
        raise CodaError(f"{where}: {what} format {record.get('format')}, this coda-agent writes {fmt}; "
                        f"start a new {what}")
    return record


def read_events(path: Path) -> list[dict[str, Any]]:
    """The transcript's events; a half-written last line (a kill mid-write) is dropped."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def find_transcript(path: Path) -> Path:
    """A transcript.jsonl given itself, its trajectory directory or its run directory."""
    for candidate in (path, path / "transcript.jsonl", path / "sample-0" / "transcript.jsonl"):
        if candidate.is_file():
            return candidate
    raise CodaError(f"{path}: no transcript.jsonl there (give a run directory or its transcript.jsonl)")


class Transcript:
    """Append-only JSONL; each event is flushed and fsynced before the loop moves on."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():  # cut a half-written last line so the next append starts clean
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep != len(data):
                with open(path, "r+b") as f:
                    f.truncate(keep)

    def append(self, event: dict[str, Any]) -> None:
        event = {**event, "time": utc_now()}
        with open(self.path, "a") as f:
            f.write(json.dumps(event, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.path)


class TrajectoryDir:
    """One trajectory's files: transcript, attempts, accepted/ or best/, result.json."""

    def __init__(self, path: Path):
        self.path = path
        self.transcript = Transcript(path / "transcript.jsonl")

    def attempt_dir(self, n: int) -> Path:
        return self.path / "attempts" / f"{n:02d}"

    def write_attempt(self, n: int, program: str, report) -> None:
        d = self.attempt_dir(n)
        write_atomic(d / "program.py", program)
        compile_stage = report.stage("compile")
        if compile_stage is not None and compile_stage.log:
            write_atomic(d / "compile.log", compile_stage.log)
        # report.json last: its presence marks the attempt as complete (see resume).
        write_atomic(d / "report.json", report.model_dump_json(indent=2) + "\n")

    def judged_report(self, n: int, program: str):
        """The stored report of attempt n if that attempt judged exactly this program."""
        from coda_agent.verifier.report import Report

        d = self.attempt_dir(n)
        if (d / "report.json").is_file() and (d / "program.py").is_file() \
                and (d / "program.py").read_text() == program:
            return Report.model_validate_json((d / "report.json").read_text())
        return None

    def write_final(self, n: int):
        """Attempt n as the trajectory's result: ``accepted/`` if it was, else ``best/``;
        returns its Report."""
        from coda_agent.verifier.feedback import report_markdown
        from coda_agent.verifier.report import Report

        d = self.attempt_dir(n)
        program = (d / "program.py").read_text()
        report = Report.model_validate_json((d / "report.json").read_text())
        kind = "accepted" if report.accepted else "best"
        write_atomic(self.path / kind / "program.py", program)
        write_atomic(self.path / kind / "report.md", report_markdown(report, program))
        return report

    def write_result(self, result: dict[str, Any]) -> None:
        write_json(self.path / "result.json", result)

    def read_result(self) -> dict[str, Any] | None:
        p = self.path / "result.json"
        return json.loads(p.read_text()) if p.is_file() else None


class RunDir:
    def __init__(self, path: Path, samples: int):
        self.path, self.samples = path, samples

    @classmethod
    def create(cls, runs_dir: Path, task, author: str, config: dict[str, Any]) -> "RunDir":
        label = re.sub(r"[^A-Za-z0-9._-]+", "-", author).strip("-") or "author"
        path = new_dir(runs_dir / f"{utc_stamp()}-{task.name}-{label}")
        shutil.copyfile(task.path, path / "task.yaml")
        for f in task.reference_files():
            (path / "reference").mkdir(exist_ok=True)
            shutil.copyfile(f, path / "reference" / f.name)
        write_json(path / "config.json", {"format": RUN_FORMAT, "task_path": str(Path(task.path).resolve()),
                                          "created_utc": utc_now(), "config": config})
        write_json(path / "versions.json", environment())
        return cls(path, config["budget"]["samples"])

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        saved = read_record(path / "config.json", RUN_FORMAT, "run", f"--resume {path}")
        return cls(path, saved["config"]["budget"]["samples"])

    def saved(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def trajectory(self, sample: int) -> TrajectoryDir:
        return TrajectoryDir(self.path if self.samples == 1 else self.path / f"sample-{sample}")

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / "summary.json", summary)

