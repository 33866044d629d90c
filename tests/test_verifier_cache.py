"""The verdict cache: a hit only for the same program, task, reference, catalogue, code and
libraries; a miss when any changes; a forged or altered entry never served; no key, no cache."""

from __future__ import annotations

import json

import pytest
from verifier_helpers import CORPUS, EXPERT_PATH, TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import harness
from coda_agent.verifier.report import Report, StageResult

CPU_STAGES = ["static", "reference"]


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


def test_cache_hit_and_misses(task, monkeypatch):
    source = EXPERT_PATH.read_text()
    v = Verifier(stages=["static"], cache=True)
    first = v.check(task, source)
    assert not first.cached and first.cache_key
    again = v.check(task, source)
    assert again.cached and again.outcome == first.outcome
    assert not v.check(task, source + "\n# changed\n").cached
    version = verdict_cache.catalogue_version
    monkeypatch.setattr(verdict_cache, "catalogue_version", lambda: "different")
    assert not v.check(task, source).cached
    monkeypatch.setattr(verdict_cache, "catalogue_version", version)
    assert v.check(task, source).cached
    monkeypatch.setattr(verdict_cache, "code_digest", lambda: "other verifier code")
    assert not v.check(task, source).cached


def test_the_caches_code_digest_reads_every_module_a_verdict_may_depend_on():
    """The rules and the contract live outside verifier/: the program's builtins and the static
    allow-list (program_rules.py), the calls into the program (kernels/contract.py), the parser
    (syntax.py).  A change to any of them must miss the cache; the agent loop, batch evaluation,
    benchmarks and tests must not, nor anything in a hidden folder (the virtualenv)."""
    root, files = verdict_cache.code_files()
    names = {str(p.relative_to(root)) for p in files}
    assert {"program_rules.py", "syntax.py", "kernels/contract.py", "primitives/program.py", "verifier/static.py",
            "tasks/spec.py", "tasks/llama3/references.py"} <= names
    assert not any(n.split("/")[0] in ("agent", "eval", "bench", "tests", "runs", "scripts") or n.startswith(".")
                   for n in names), names


def test_cache_fails_closed(task, monkeypatch):
    def broken():
        raise verdict_cache.CacheKeyError("no version")

    monkeypatch.setattr(verdict_cache, "library_versions", broken)
    v = Verifier(stages=["static"], cache=True)
    r1 = v.check(task, EXPERT_PATH.read_text())
    r2 = v.check(task, EXPERT_PATH.read_text())
    assert r1.cache_key is None and not r2.cached


def test_a_forged_verdict_is_not_served(task):
    """A file a program managed to write under its own key (an unsandboxed runner could): without
    the harness's signature it is a miss, and so is a signed entry altered afterwards."""
    source = (CORPUS / "wrong" / "returns_zeros.py").read_text()
    v = Verifier(stages=["static"], cache=True)
    key = v.check(task, source).cache_key
    path = verdict_cache.cache_dir() / f"{key}.json"
    forged = Report(task=task.name, program_sha256="x", outcome="accepted", cache_key=key,
                    stages=[StageResult(name=s, status="passed") for s in harness.STAGES])
    path.write_text(json.dumps({"report": forged.model_dump_json(), "mac": "0" * 64}))
    assert not v.check(task, source).accepted
    entry = json.loads(path.read_text())
    entry["report"] = entry["report"].replace('"passed"', '"failed"', 1)
    path.write_text(json.dumps(entry))
    assert verdict_cache.get(key) is None


REFERENCE = '''
def scale_add_ref(x, w, r, alpha):
    return {"D": alpha * (x @ w) + r}
'''
SCALE_ADD = '''
from coda_agent.primitives import Scalar, Tile, epilogue, gemm


@epilogue()
def scale_add(acc, r: Tile, alpha: Scalar):
    return {"D": acc * alpha + r}


def forward(x, w, r, alpha):
    return {"D": gemm(x, w, scale_add, r=r, alpha=alpha)["D"]}
'''


def test_an_edited_reference_misses_the_cache(tmp_path, monkeypatch):
    from agent_fixtures import write_task

    folder = tmp_path / "tasks"
    path = write_task(folder)
    (folder / "edited_ref.py").write_text(REFERENCE)
    path.write_text(path.read_text().replace("agent_fixtures:scale_add_ref", "edited_ref:scale_add_ref"))
    monkeypatch.syspath_prepend(str(folder))
    with Verifier(stages=CPU_STAGES, cache=True, timeout_s=60) as v:
        first = v.check(load_task(path), SCALE_ADD)
        assert first.outcome == "cpu_passed" and not first.cached, first.model_dump_json(indent=1)
        assert v.check(load_task(path), SCALE_ADD).cached
        (folder / "edited_ref.py").write_text(REFERENCE.replace("alpha * (x @ w) + r", "alpha * (x @ w) - 1.0 * r"))
        edited = v.check(load_task(path), SCALE_ADD)
    assert not edited.cached and edited.outcome == "rejected", edited.model_dump_json(indent=1)
    assert "differs from the reference" in edited.failed_stage.message
