"""The launch audit's premise, on the CPU: every operation the catalogue runs for a program sits
inside a ``coda::`` profiler range.

On the GPU the verifier's launch audit (``verifier/program.py``, ``profile``) rejects a program
when the profiler sees a device launch outside every catalogue range: that is how PyTorch compute
of the program's own shows.  So the catalogue's own device work (a pass's zero operands, a
``select``'s pre-fill, the poisoning of a dead ``out``) must run inside a range, or an honest
expert fails the audit on the H200 (BENCHMARKS run 22: a tile pass's zero operands did).
This test runs every suite's expert (and the user-written blocks of ``tests/tasks/families``)
forward and backward on the CPU under the profiler and lists the ATen ops that ran outside every
``coda::`` range: only allocation, views and metadata, which launch nothing on a device, may.
"""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from pathlib import Path

from coda_agent.tasks import SUITES, load_task

from suite_checks import draw, load_expert, run_program

# Ops that launch no device work: allocation without a fill, views, metadata.
NO_LAUNCH = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::t", "aten::transpose", "aten::view",
    "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select", "aten::as_strided",
    "aten::alias", "aten::detach", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view",
})

FOLDERS = {**SUITES, "llama3_fp8": SUITES["llama3"].parent / "llama3_fp8"}
EXPERTS = [(suite, path.stem) for suite, folder in sorted(FOLDERS.items())
           for path in sorted(folder.glob("*.yaml"))]


def launches_outside_ranges(events) -> set[str]:
    """Top-level ATen ops (not called by another ATen op) that began outside every ``coda::``
    range."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("coda::")]
    out = set()
    for e in events:
        if not e.name.startswith("aten::") or e.name in NO_LAUNCH:
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue
        if not any(start <= e.time_range.start <= end for start, end in ranges):
            out.add(e.name)
    return out


# Blocks of other models, written as a user writes them (tests/test_other_families.py): programs
# that reach parts of the catalogue the experts do not (layernorm_stats, normalize_rows, select).
USER_TASKS = sorted((Path(__file__).parent / "tasks" / "families").glob("*/*.yaml"))


@pytest.mark.parametrize("task", [*(FOLDERS[s] / f"{n}.yaml" for s, n in EXPERTS), *USER_TASKS],
                         ids=[*(f"{s}/{n}" for s, n in EXPERTS), *(f"user/{t.stem}" for t in USER_TASKS)])
def test_program_runs_only_inside_catalogue_ranges(task):
    t = load_task(task)
    inputs, grads = draw(t, "small", seed=3)
    program = task.with_name(f"{task.stem}_program.py")
    mod = load_expert(t, program.read_text() if program.is_file() else None)
    run_program(t, mod, inputs, grads)  # once outside the profile: first-call set-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_program(t, mod, inputs, grads)
    assert launches_outside_ranges(list(prof.events())) == set()


def test_the_check_sees_work_outside_a_range():
    # The check itself can fail: a program's own zeros, between two catalogue calls.
    import torch

    from coda_agent.primitives import gemm

    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        d = gemm(a, b.t())["D"]
        torch.zeros_like(d)
    assert launches_outside_ranges(list(prof.events())) == {"aten::zeros_like"}
