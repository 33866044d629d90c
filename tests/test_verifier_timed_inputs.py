"""The performance stage's timed calls each run on inputs the runner has never seen: a runner that
answers a call on inputs it has seen from a memo of its results (keyed by their contents, which
costs one read of the inputs) does no work in any timed call, and every result it returns is
right, so no result check sees it.  Tested on the CPU with a runner that keeps such a memo."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from verifier_helpers import TASK_PATH

from coda_agent.tasks.spec import load_task
from coda_agent.verifier import timing
from coda_agent.verifier.timed_program import TimedProgram
from coda_agent.verifier.calls import draw_case


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _MemoRunner:
    """The judge's GpuCalls and the runner behind them, on the CPU: buffer sets by key, and a runner
    that counts the timed calls whose inputs (by content) it has answered before."""

    def __init__(self):
        self.ids: dict[int, int] = {}  # key -> set id
        self.contents: dict[int, str] = {}  # set id -> digest of what the judge last wrote
        self.seen: set[str] = set()
        self.hits = self.timed = 0
        self.next_slot = 0
        self.held: dict[int, str] = {}  # slot -> the digest of its call's inputs

    # -- GpuCalls
    def load(self, case, key: int = 0) -> int:
        sid = self.ids.setdefault(key, 100 + key)
        self.contents[sid] = _digest({**case.inputs, **(case.grads or {})})
        return sid

    def slot(self) -> int:
        self.next_slot += 1
        return self.next_slot

    def results(self, reply, case, slot, set_id):
        assert self.held.pop(slot) == _digest({**case.inputs, **(case.grads or {})}), \
            "a checked call's reference was drawn from other inputs than the call had"
        return {k: v.clone() for k, v in case.lo.items()}

    def run(self, case, set_id, poison=False):
        self.seen.add(self.contents[set_id])
        return {k: v.clone() for k, v in case.lo.items()}

    # -- the runner
    def answer(self, set_id: int, slot: int) -> dict:
        digest = self.contents[set_id]
        self.timed += 1
        self.hits += digest in self.seen
        self.seen.add(digest)
        self.held[slot] = digest
        return {"name": "y"}


class _Check:
    def __init__(self, task, runner: _MemoRunner):
        self.task, self.spec, self.runner = task, task.spec, runner
        self.rng = random.Random(7)

    def seed(self) -> int:
        return self.rng.randrange(1 << 31)

    def request(self, header, blobs=(), max_bytes=0):
        op = header["op"]
        if op == "time":
            return {"ms": 1.0, "results": [self.runner.answer(header["set"], header["slot"])]}
        if op == "block":
            return {"results": [[self.runner.answer(s, slot)] for s, slot in zip(header["sets"], header["slots"])]}
        if op == "release":
            for slot in header["slots"]:
                self.runner.held.pop(slot, None)
            return {}
        raise AssertionError(op)


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


def test_no_timed_call_runs_on_inputs_the_runner_has_seen(task):
    runner = _MemoRunner()
    check = _Check(task, runner)
    cases = [draw_case(task, task.spec, "small", check.seed(), "cpu") for _ in range(timing.INPUT_SETS)]
    sets = [runner.load(case, key=i) for i, case in enumerate(cases)]
    for case, sid in zip(cases, sets):  # the stage's warm-up: each set once, untimed
        runner.run(case, sid)
    program = TimedProgram(check, runner, cases, sets, "performance")
    for rep in range(12):
        program.timed(0.1, rep)
    for _ in range(3):
        program.ready = lambda: None
        program.block(6, 0.0)
    assert runner.timed == 12 + 18
    assert runner.hits == 0, f"{runner.hits} of {runner.timed} timed calls ran on inputs the runner had seen"


# --------------------------------------------------------------------------- the baselines alone

def test_a_runner_that_slows_the_baselines_while_idle_buys_only_the_slack():
    """A program at 1.25x its GEMMs whose runner keeps the GPU busy while the judge times the
    baselines (their kernels wait through its time slices) slows every baseline by as much, and
    was timed at 1.00x its GEMMs: accepted.  Timed again with the runner ended, the baselines show
    their own times, and in the verdict they are at most SOLO_SLACK over those."""
    from coda_agent.tasks import SUITE_DIR

    rms = load_task(SUITE_DIR / "residual_rmsnorm.yaml")
    beside = timing.Times({"program": 1.25, "gemm": 1.25, "compile": 1.70, "eager": 2.5},
                          {"program": 1.40, "gemm": 1.40, "compile": 1.90, "eager": 2.8})
    alone = timing.Times({"gemm": 1.00, "compile": 1.36, "eager": 2.0}, {"gemm": 1.12, "compile": 1.52, "eager": 2.24})

    class _Check:
        spec = rms.spec

        def request(self, header, blobs=(), max_bytes=0):
            raise AssertionError("the profile was taken before the runner ended")

    profile = {"kernel_ms": {"coda::gemm::x": 1.2}, "configs": []}
    fooled = timing._verdict(_Check(), "llama3-8b", beside, {}, None, None, profile)
    assert fooled.status == "passed", fooled.message  # what the verdict was without the solo times
    details: dict = {}
    times = timing.capped(beside, alone, details)
    assert times.per_call["program"] == 1.25 and times.back_to_back["program"] == 1.40
    assert times.per_call["gemm"] == pytest.approx(1.0 * (1 + timing.SOLO_SLACK))
    assert details["baselines_capped"] == ["compile", "eager", "gemm"]
    res = timing._verdict(_Check(), "llama3-8b", times, details, None, None, profile)
    assert res.status == "slow" and "baselines capped" in res.message, res.message


def test_baselines_within_the_slack_of_their_solo_times_stand():
    """The clock drifts between the two measurements: a baseline up to SOLO_SLACK slower beside the
    runner than alone is its own time, and no cap is named."""
    beside = timing.Times({"program": 1.0, "gemm": 1.05}, {"program": 1.2, "gemm": 1.25})
    alone = timing.Times({"gemm": 1.0}, {"gemm": 1.2})
    details: dict = {}
    assert timing.capped(beside, alone, details) == beside and "baselines_capped" not in details
