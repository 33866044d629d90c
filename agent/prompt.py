"""What the LLM reads and what we take back from it.

Messages come from ``templates/*.md`` rendered with :class:`string.Template`
``substitute`` (a missing variable raises: a prompt with a hole is a bug, not a
prompt).  The first two messages are the system prompt (the CODA idea, the
rules, the mainloop contract, the catalogue as ``coda_agent.primitives``
renders it) and the task (its YAML, the reference source, and expert programs
of *other* tasks as examples: never the task's own, that would be the answer).

Feedback turns carry the verifier's report as
``coda_agent.verifier.feedback.render_feedback`` writes it: the same text a
human sees.  The program is taken from the reply's fenced ```python blocks:
the largest one that defines ``forward`` (the last on a tie), so a reply that
quotes a fragment before the full module still works.  A reply without one is
a :class:`FormatError`; a program with a syntax error is *not*: the verifier's
static stage reports it with its line number, which is better feedback.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING

import yaml

from .protocols import CodaError, FormatError, Message

if TYPE_CHECKING:
    from coda_agent.tasks.spec import Task
    from coda_agent.verifier.report import Report

TEMPLATES = Path(__file__).parent / "templates"
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n")


def render(template: str, **values: object) -> str:
    text = (TEMPLATES / f"{template}.md").read_text()
    try:
        return Template(text).substitute(values)
    except KeyError as e:
        raise KeyError(f"template {template}.md needs ${e.args[0]}, which was not given") from None


def load_catalogue() -> str:
    try:
        from coda_agent.primitives import render_catalogue

        return render_catalogue()
    except Exception as e:  # noqa: BLE001 - without the catalogue there is no prompt worth sending
        raise CodaError(f"cannot render the catalogue ({type(e).__name__}: {e}); the prompt needs it: "
                        "check the coda-agent install") from None


def initial_messages(task: "Task", catalogue: str, max_examples: int = 3) -> list[Message]:
    from coda_agent.tasks.spec import PARAMETER_ROLES

    spec = task.spec
    # The same contract the verifier's static stage checks (verifier/static.py).
    grads_in = [f"d{o}" for o in spec.grad_outputs]
    saved = [o for o, t in spec.outputs.items() if t.role == "saved"]
    backward = (f"`backward(saved, {', '.join(grads_in)})` returns "
                f"a dict with {', '.join(repr('d' + g) for g in spec.gradients)}; `saved` holds the forward's "
                "inputs, params and returned dict."
                + (f" {', '.join(saved)} (role saved) receive no gradient." if saved else "")
                + (" A parameter `needs` added to backward receives the set of those names the caller "
                   f"reads (a frozen {frozen[0]} leaves out {'d' + frozen[0]!r}): skip what it leaves out."
                   if (frozen := [g for g in spec.gradients if spec.inputs[g].role in PARAMETER_ROLES]) else "")
                if spec.gradients else "This task has no backward.")
    examples = example_programs(task, max_examples)
    examples_text = "\n\n".join(f"### {name}\n\n```python\n{src.rstrip()}\n```" for name, src in examples) \
        or "(none available)"
    user = render("task", name=spec.name, summary=spec.summary.strip(),
                  spec_yaml=Path(task.path).read_text().rstrip(), reference_source=task.reference_source().rstrip(),
                  forward_args=", ".join([*spec.inputs, *spec.params]), outputs=", ".join(spec.outputs),
                  backward_note=backward, examples=examples_text)
    return [{"role": "system", "content": render("system", catalogue=catalogue.rstrip())},
            {"role": "user", "content": user}]


def example_programs(task: "Task", limit: int) -> list[tuple[str, str]]:
    """Expert programs of other tasks: the task's own folder first (its closest relatives),
    then the packaged suite; within each, those sharing the most catalogue families first.
    Never the task's own expert program."""
    from coda_agent.tasks import SUITE_DIR

    seen, found = {task.expert_path}, []
    for rank, folder in enumerate(dict.fromkeys([Path(task.path).parent.resolve(), SUITE_DIR.resolve()])):
        for path in sorted(folder.glob("*.yaml")):
            try:  # raw YAML, not load_task: an example must not import references
                raw = yaml.safe_load(path.read_text())
                expert = (path.parent / raw["expert"]).resolve()  # a task without one has no example
            except Exception:  # noqa: BLE001 - a broken neighbour just is not an example
                continue
            if raw.get("name") == task.name or expert in seen or not expert.is_file():
                continue
            seen.add(expert)
            overlap = len(set(raw.get("families") or []) & set(task.spec.families))
            found.append((rank, -overlap, raw["name"], expert.read_text()))
    return [(name, src) for _, _, name, src in sorted(found)[:limit]]


def extract_program(text: str) -> str:
    blocks = [b for b in _FENCE.findall(text) if re.search(r"^\s*def forward\s*\(", b, re.MULTILINE)]
    if blocks:
        return max(reversed(blocks), key=len).strip() + "\n"  # largest; the last one on a tie
    closed = sum(1 for _ in _FENCE.finditer(text))
    if len(_OPEN_FENCE.findall(text)) > closed:
        raise FormatError("the reply ends inside a ``` block (cut off, perhaps by max_tokens); "
                          "send a shorter reply with the whole program")
    if closed:
        raise FormatError("none of the ```python blocks defines `def forward(...)`")
    raise FormatError("there is no ```python fenced block")


def format_message(reason: str, count: int, limit: int) -> str:
    return render("format_error", reason=reason, count=count, limit=limit)


def feedback_message(report: "Report", program: str, attempt: int) -> str:
    return render("feedback", attempt=attempt, outcome=report.outcome,
                  feedback=render_report(report, program).rstrip())


def render_report(report: "Report", program: str) -> str:
    from coda_agent.verifier.feedback import render_feedback

    return render_feedback(report, program)
