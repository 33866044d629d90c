"""Task specs, PyTorch references and expert programs (see ``spec.py``)."""

from pathlib import Path

from .spec import Task, TaskSpec, TaskSpecError, load_suite, load_task

SUITE_DIR = Path(__file__).parent / "llama3"

__all__ = ["SUITE_DIR", "Task", "TaskSpec", "TaskSpecError", "load_suite", "load_task"]
