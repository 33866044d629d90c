"""GPU tier: the judge's side of CUDA IPC (coda_agent.verifier.cuda_ipc) against a real second
process that owns the memory, as a runner does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from coda_agent.verifier.cuda_ipc import Imports
from coda_agent.verifier.wire import WireError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OWNER = textwrap.dedent("""
    import json, sys, torch
    from coda_agent.verifier.cuda_ipc import export
    a = torch.arange(1000, device="cuda", dtype=torch.float32).to(torch.bfloat16).view(10, 100)
    b = torch.full((7,), 3.0, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"a": export(a), "b": export(b)}), flush=True)
    sys.stdin.readline()  # keep the memory alive until the judge is done
""")


@pytest.fixture
def owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    descs = json.loads(proc.stdout.readline())
    yield descs
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=60)


def test_the_judge_reads_the_runners_memory_and_copies_it(owner):
    with Imports() as imports:
        a = imports.tensor(owner["a"], "bf16", [10, 100]).clone()
        b = imports.tensor(owner["b"], "fp32", [7]).clone()
    assert torch.equal(a, torch.arange(1000, device="cuda", dtype=torch.float32).to(torch.bfloat16).view(10, 100))
    assert torch.equal(b, torch.full((7,), 3.0, device="cuda"))


def test_a_descriptor_past_its_allocation_is_refused(owner):
    with Imports() as imports:
        imports.tensor(owner["b"], "fp32", [7])  # opens the allocation
        with pytest.raises(WireError, match="allocation"):
            imports.tensor({**owner["b"], "offset": owner["b"]["offset"] + (1 << 40)}, "fp32", [7])
        with pytest.raises(WireError, match="allocation"):
            imports.tensor(owner["b"], "fp32", [1 << 40])
        with pytest.raises(WireError, match="offset"):
            imports.tensor({**owner["b"], "offset": owner["b"]["offset"] + 1}, "fp32", [7])


def test_a_forged_handle_does_not_open():
    with Imports() as imports, pytest.raises(WireError, match="does not open"):
        imports.tensor({"handle": "ab" * 64, "offset": 0}, "fp32", [4])


def test_the_poison_reaches_the_next_outputs_and_holds_no_more_than_its_block():
    """The runner's poison (verifier/program.py): the outputs a call allocates next read NaN even
    where an earlier call's results were freed, and the cache holds the poisoned block, sized
    to the call, not to the card."""
    from coda_agent.verifier.program import call_bytes, poison_allocator, poison_bytes

    torch.cuda.empty_cache()
    earlier = torch.ones(4096, 4096, device="cuda", dtype=torch.bfloat16)  # a result held, then freed
    del earlier
    need = call_bytes([torch.empty(4096, 4096, dtype=torch.bfloat16)], {"y": [4096, 4096]})
    free = torch.cuda.mem_get_info()[0]
    poison_allocator(need)
    reserved = torch.cuda.memory_reserved()
    assert reserved <= poison_bytes(need, free) + (256 << 20) < free / 2
    out = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert bool(out.isnan().all())
    torch.cuda.empty_cache()


HOG = textwrap.dedent("""
    import sys, torch
    held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("held", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("other_gib,status", [(1, "error"), (12, "failed")])
def test_an_out_of_memory_is_weighed_by_what_the_other_process_holds(other_gib, status):
    """``check.out_of_memory`` on a real card: a second process holding little beside the judge
    makes the judge's error; one holding more than a runner's share for the largest set (ragged's
    few MiB: the allowance for the two processes' contexts, 3 GiB, and a little) fails the program."""
    from types import SimpleNamespace

    from coda_agent.tasks import SUITE_DIR, load_task
    from coda_agent.verifier.check import out_of_memory
    from coda_agent.verifier.shape_sets import with_drawn_sets

    spec = with_drawn_sets(load_task(SUITE_DIR / "swiglu_fwd.yaml").spec)
    proc = subprocess.Popen([sys.executable, "-c", HOG, str(other_gib << 30)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        res = out_of_memory("correctness", SimpleNamespace(spec=spec, shape_sets=["small", "ragged"]), "CUDA oom")
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    assert res.status == status, res.message


def test_the_performance_stage_reports_what_the_runner_saw_of_each_block():
    """Each back-to-back block of the program comes with the runner's account of it (its host's share,
    its allocator's device calls) next to the judge's own clock, for the report."""
    from verifier_helpers import EXPERT_PATH, TASK_PATH

    from coda_agent.tasks.spec import load_task
    from coda_agent.verifier import Verifier, timing

    report = Verifier(cache=False).check(load_task(TASK_PATH), EXPERT_PATH.read_text())
    blocks = report.stage("performance").details["program_blocks"]
    assert len(blocks) == timing.BLOCK_ROUNDS, blocks
    assert all(0 < b["host_ms"] <= b["block_ms"] <= b["judge_wall_ms"] + 1 for b in blocks), blocks
    assert all(b["num_alloc_retries"] >= 0 for b in blocks)
