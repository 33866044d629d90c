"""Every text of a report is printable and encodable: what the program raised or printed (the
message, the log) and what its runner reported (``details``: kernel names, configurations, a
block's diagnostics), which a program that answers for its runner writes."""

from __future__ import annotations

import json

from verifier_helpers import CORPUS, TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.report import Report, StageResult

FORGED = "k\ud800\x1b[2J\x1b]0;accepted\x07\r\u202e"


def _clean(text: str) -> bool:
    return not any(c in text for c in ("\ud800", "\x1b", "\x07", "\r", "\u202e"))


def test_a_surrogate_or_an_escape_anywhere_in_a_stage_is_written_as_its_escape():
    stage = StageResult(name="compile", status="failed", message=FORGED, log=FORGED,
                        details={"kernels": [{"epilogue": FORGED, "seconds": 1.5}], FORGED: [FORGED, 3]})
    report = Report(task="t", program_sha256="x", outcome="rejected", stages=[stage])
    text = report.model_dump_json()  # raised UnicodeEncodeError on the surrogate
    assert _clean(text) and _clean(json.dumps(json.loads(text), ensure_ascii=False))
    again = Report.model_validate_json(text)
    assert again.stages[0].details["kernels"][0]["seconds"] == 1.5
    assert _clean(render_feedback(again, ""))


def test_verify_writes_the_report_of_a_program_that_raises_a_surrogate(private_caches):
    source = (CORPUS / "wire" / "surrogate_in_an_error.py").read_text()
    with Verifier(stages=["static", "reference"], cache=True) as v:  # the verdict cache's put crashed
        report = v.check(load_task(TASK_PATH), source)
    assert report.outcome == "rejected" and "raised ValueError" in report.failed_stage.message
    assert _clean(report.model_dump_json())
