"""Run directory primitives: atomic writes, a transcript that survives a kill mid-line."""

from __future__ import annotations

import pytest

from coda_agent.agent import CodaError
from coda_agent.agent.rundir import Transcript, find_transcript, read_events
from coda_agent.storage import write_atomic


def test_write_atomic_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "a" / "result.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_half_written_last_line_is_dropped_and_cut_before_appending(tmp_path):
    path = tmp_path / "transcript.jsonl"
    Transcript(path).append({"event": "message", "content": "one"})
    with open(path, "a") as f:
        f.write('{"event": "message", "cont')  # killed mid-write
    assert [e["content"] for e in read_events(path)] == ["one"]
    Transcript(path).append({"event": "message", "content": "two"})
    assert [e["content"] for e in read_events(path)] == ["one", "two"]


def test_find_transcript(tmp_path):
    (tmp_path / "sample-0").mkdir()
    (tmp_path / "sample-0" / "transcript.jsonl").write_text("")
    assert find_transcript(tmp_path) == tmp_path / "sample-0" / "transcript.jsonl"
    with pytest.raises(CodaError, match="no transcript.jsonl there"):
        find_transcript(tmp_path / "nope")
