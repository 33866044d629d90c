"""Task specs, PyTorch references and expert programs.

- ``spec.py``: the YAML schema (pydantic), loading a task or a folder of them.
- ``sources.py``: importing a reference (a file beside the YAML or a module) and
  the source of its dependency closure, which the prompt shows.
- ``skeleton.py``: ``coda-agent tasks new``, a task file written from its reference.
- ``cli.py``: ``coda-agent tasks [list|new|check]``.
- ``llama3/``: the packaged LLaMA-3 suite, its references and expert programs.
"""

from pathlib import Path

from .spec import Task, TaskSpec, TaskSpecError, load_suite, load_task, scan_suite

SUITE_DIR = Path(__file__).parent / "llama3"

__all__ = ["SUITE_DIR", "Task", "TaskSpec", "TaskSpecError", "load_suite", "load_task", "scan_suite"]
