"""Prompt templates, examples, program extraction, feedback rendering."""

from __future__ import annotations

import pytest
from agent_fixtures import GOOD, SYNTAX_ERROR, RuleVerifier, fenced

from coda_agent.agent.prompt import extract_program, feedback_message, initial_messages, render
from coda_agent.verifier.feedback import report_markdown
from coda_agent.agent.protocols import FormatError


def test_templates_fail_on_a_missing_variable():
    with pytest.raises(KeyError, match=r"template feedback.md needs \$"):
        render("feedback", attempt=1)


def test_initial_messages_hold_rules_catalogue_task_and_other_examples(agent_task):
    system, user = initial_messages(agent_task, "THE CATALOGUE $ with a dollar")
    assert system["role"] == "system" and "THE CATALOGUE $ with a dollar" in system["content"]
    assert "imports only from `coda_agent.primitives`" in system["content"]
    assert "alpha * (x @ w) + r" in user["content"] and "(x, w, r, alpha)" in user["content"]
    assert "### other_task" in user["content"] and "# the other task's expert program" in user["content"]
    assert "### scale_add\n" not in user["content"]
    _, user = initial_messages(agent_task, "C", max_examples=0)
    assert "(none available)" in user["content"]


def test_extract_takes_the_largest_block_defining_forward():
    fragment = "def forward(x):\n    ...\n"
    text = fenced(fragment) + fenced(GOOD, "The whole module:") + "```python\nprint(1)\n```"
    assert extract_program(text) == GOOD
    assert extract_program(f"```py\n{GOOD}```") == GOOD


@pytest.mark.parametrize("text,match", [
    ("no code at all", "no ```python fenced block"),
    ("```python\nx = 1\n```", "none of the ```python blocks defines `def forward"),
    ("```python\n" + GOOD, "cut off"),
])
def test_extract_format_errors(text, match):
    with pytest.raises(FormatError, match=match):
        extract_program(text)


def test_feedback_shows_the_stage_and_the_line(agent_task):
    report = RuleVerifier().check(agent_task, SYNTAX_ERROR)
    text = feedback_message(report, SYNTAX_ERROR, 3)
    assert text.startswith("Attempt 3 was rejected")
    assert "static" in text and "line 7" in text
    md = report_markdown(report, SYNTAX_ERROR)
    assert md.startswith("# scale_add: rejected")
    assert "| static | failed |" in md


def test_backward_contract_is_spelled_out_when_the_task_has_gradients(tmp_path):
    from agent_fixtures import write_task

    from coda_agent.tasks import load_task

    path = write_task(tmp_path)
    path.write_text(path.read_text() + "gradients: [x, r]\n")
    _, user = initial_messages(load_task(path), "C")
    assert "`backward(saved, dD)` returns a dict with 'dx', 'dr'" in user["content"]
    assert "needs" not in user["content"].split("backward(saved")[1][:400]  # x and r are no parameters


def test_a_task_with_parameter_gradients_offers_needs():
    from coda_agent.tasks import SUITES, load_task

    _, user = initial_messages(load_task(SUITES["llama3"] / "mlp_block.yaml"), "C")
    assert "A parameter `needs` added to backward receives the set of those names the caller reads " \
           "(a frozen gamma leaves out 'dgamma')" in user["content"]
