"""Task specs, PyTorch references and expert programs.

- ``spec.py``: the YAML schema (pydantic), loading a task or a folder of them;
  ``expr.py``: the shape and init expressions it holds; ``messages.py``: how a
  task file's problems are worded (the field, the problem, the fix).
- ``dryrun.py``: the reference called once as a task loads, to check it takes
  the spec's inputs and params and returns its declared outputs.
- ``sources.py``: importing a reference (a file beside the YAML or a module) and
  the source of its dependency closure, which the prompt shows.
- ``skeleton.py``: ``coda-agent tasks new``, a task file written from its reference.
- ``cli.py``: ``coda-agent tasks [list|new|check]``.
- ``llama3/``: the packaged LLaMA-3 suite (RMSNorm, SwiGLU, RoPE, QK-norm), its
  references and expert programs.
- ``gpt2/``: the packaged pre-LN GPT-2 suite (LayerNorm with bias, biased
  projections, an exact-GELU MLP, a tied LM head), likewise.
"""

from pathlib import Path

from .spec import Task, TaskSpec, TaskSpecError, load_suite, load_task, scan_suite

SUITES = {name: Path(__file__).parent / name for name in ("llama3", "gpt2")}
SUITE_DIR = SUITES["llama3"]
# The shape sets each packaged suite is measured on (its others are the CPU sets).
BENCH_SETS = {"llama3": ("llama3-1b", "llama3-8b", "llama3-70b"), "gpt2": ("gpt2-small", "gpt2-xl", "gpt2-7b")}


def suite_dir(suite: str | Path) -> Path:
    """A packaged suite by name (``llama3``, ``gpt2``) or any folder of task YAMLs."""
    if str(suite) in SUITES:
        return SUITES[str(suite)]
    path = Path(suite)
    if not path.is_dir():
        raise TaskSpecError(f"{suite}: neither a packaged suite ({', '.join(SUITES)}) nor a folder of "
                            "task YAMLs; give one of those")
    return path


__all__ = ["BENCH_SETS", "SUITES", "SUITE_DIR", "Task", "TaskSpec", "TaskSpecError", "load_suite", "load_task",
           "scan_suite", "suite_dir"]
