"""Every packaged suite (coda_agent.tasks.SUITES): each task's spec loads with its
expert program, every benchmark shape set is there with positive sizes and FLOPs and
its ragged set is ragged (tests/suite_checks.py), and the expert passes the
verifier's static stage.  What each expert computes is checked per suite
(tests/test_suite_a.py, test_suite_b.py, test_gpt2_suite.py)."""

from __future__ import annotations

import pytest
from suite_checks import check_spec, static_violations

from coda_agent.tasks import BENCH_SETS, SUITES, load_suite

CASES = [(suite, t.name) for suite in SUITES for t in load_suite(SUITES[suite])]


def test_every_suite_is_here():
    assert {suite for suite, _ in CASES} == set(BENCH_SETS) == {"llama3", "gpt2"}
    assert len(CASES) == 35


@pytest.mark.parametrize("suite,name", CASES)
def test_spec_loads(suite, name):
    check_spec(name, suite, ("small", "ragged", *BENCH_SETS[suite]))


@pytest.mark.parametrize("suite,name", CASES)
def test_expert_is_static_clean(suite, name):
    assert not static_violations(name, suite)
