"""The judge and the card's memory (verifier/shape_sets.py, verifier/check.py): which sets fit a
card beside the judge's references, the runner's poisoned block, and how an out-of-memory, the
judge's or the runner's, is weighed between the program and the judge."""

from __future__ import annotations

import os

import pytest
import torch

from coda_agent.tasks import SUITE_DIR
from coda_agent.tasks.spec import load_task
from coda_agent.verifier.shape_sets import checked_sets, with_drawn_sets

# The judge's draws, references and cache: 63.1 GiB in use and 7 GiB more asked for, for a llama3-70b set
# of 7.25 GiB in fp32 on an H100 (run 30).
JUDGE_SHARE = 10


def test_the_judge_counts_the_widest_gemm_output_its_reference_holds():
    """An LM head's fp32 reference holds its (T, V) logits several times over, far more than the
    set's own tensors: run 31's H100 judge held 75 GiB for lm_head_xent_softcap's gemma2-2b (logits
    15.6 GiB, tensors 5 GiB) and the runner ran out beside it.  An 80 GiB card now skips that set;
    an H200 keeps it, and the sets of the other tasks stay as they were."""
    from coda_agent.verifier.shape_sets import GPU_MEMORY_FACTOR, judge_bytes, set_bytes

    spec = with_drawn_sets(load_task(SUITE_DIR / "lm_head_xent_softcap.yaml").spec)
    assert judge_bytes(spec, "gemma2-2b") > 5 * 16384 * 256000 * 4
    h100, skipped = checked_sets(spec, None, int(79.18 * 2**30))
    assert "gemma2-2b" in skipped and "gemma2-2b" not in h100 and "llama3-8b" in h100
    assert "gemma2-2b" in checked_sets(spec, None, int(139.8 * 2**30))[0]
    mlp = with_drawn_sets(load_task(SUITE_DIR / "swiglu_mlp.yaml").spec)
    assert judge_bytes(mlp, "llama3-8b") == GPU_MEMORY_FACTOR * set_bytes(mlp, "llama3-8b", itemsize=4)


@pytest.mark.parametrize("gib", [79.18, 139.8])  # an H100's and an H200's total, as torch reports them
def test_the_runner_s_poison_leaves_the_judge_its_share_of_every_set_that_fits(gib):
    """The runner's NaN-poisoned block is sized to the call, not to the free memory: beside the
    judge's share, the runner's buffers and block fit every set the judge admits on an H100 or
    an H200 (60% of the free memory held 28 GiB beside the judge's 50 and ran out on llama3-70b)."""
    from coda_agent.tasks import load_suite
    from coda_agent.verifier.shape_sets import GPU_MEMORY_FACTOR, set_bytes
    from coda_agent.verifier.program import POISON_MIN, call_bytes, poison_bytes

    total = int(gib * 2**30)
    admitted = 0
    for suite in ("llama3", "gpt2", "llama3_fp8"):
        for t in load_suite(SUITE_DIR.parent / suite):
            spec = with_drawn_sets(t.spec)
            for s in checked_sets(spec, None, total)[0]:
                fp32 = set_bytes(spec, s, itemsize=4)  # at least the call's bytes (results at fp32 too)
                # the runner poisons while the judge may hold no more than the set's tensors
                runner = set_bytes(spec, s) + poison_bytes(fp32, total - fp32)
                assert JUDGE_SHARE * fp32 + runner <= total, (t.name, s)
                admitted += fp32 * GPU_MEMORY_FACTOR > total / 2
    assert admitted  # some set uses more than half the device: the bound is tested where it binds
    assert poison_bytes(1 << 20, total) == POISON_MIN  # a small call still poisons a useful block
    assert poison_bytes(7 << 30, total) == 14 << 30 and poison_bytes(7 << 30, 10 << 30) == 6 << 30
    x = torch.zeros(1024, 1024, dtype=torch.bfloat16)
    assert call_bytes([x, x], {"y": [1024, 2048]}) == 2 * (2 << 20) + (8 << 20)


def test_an_out_of_memory_is_the_program_s_only_when_its_process_holds_more_than_a_call_needs():
    """Run 30's H100: the judge held 63.1 GiB and the runner 9.9 GiB for a llama3-70b set of 7.25 GiB
    in fp32. That is the judge's error (the card is too small for its checks), not a rejection of an
    honest program; a runner holding 40 GiB beside it is the program keeping memory between calls."""
    from coda_agent.verifier.check import memory_verdict

    gib = 2**30
    args = ("correctness", int(63.14 * gib))
    card, llama3_70b = int(79.18 * gib), ("llama3-70b", int(7.25 * gib), "CUDA out of memory")
    judges = memory_verdict(*args, int(9.86 * gib), card, *llama3_70b)
    assert judges.status == "error"
    assert "too small for the judge's checks of shape set llama3-70b" in judges.message
    assert "--sets" in judges.message and "not the program's fault" in judges.message
    programs = memory_verdict(*args, 40 * gib, card, *llama3_70b)
    assert programs.status == "failed"
    assert "the program's process held 40.0 GiB" in programs.message and "between calls" in programs.message


H100_RUNNER_OOM = (  # run 31: lm_head_xent_softcap's runner, while the judge held its gemma2 reference
    "forward raised OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total capacity "
    "of 79.18 GiB of which 998.56 MiB is free. Process 2029 has 75.02 GiB memory in use. Including non-PyTorch "
    "memory, this process has 3.17 GiB memory in use. Of the allocated memory 1.60 GiB is allocated by PyTorch")


def test_a_runner_s_out_of_memory_is_weighed_by_what_the_program_asked_for():
    """The runner's own out-of-memory (PyTorch's message, relayed as the program's exception): the
    judge's error where the program held and asked for less than a call of the largest set needs
    (run 31: 4.1 GiB beside a judge holding 75 GiB), the program's failure where it asked for more;
    any other exception stays the program's failure as it stands."""
    from types import SimpleNamespace

    from coda_agent.tasks import SUITE_DIR, load_task
    from coda_agent.verifier.check import runner_oom_bytes, runner_out_of_memory
    from coda_agent.verifier.shape_sets import with_drawn_sets

    gib, mib = 2**30, 2**20
    assert runner_oom_bytes(H100_RUNNER_OOM) == (1002 * mib, int(3.17 * gib), int(998.56 * mib), int(79.18 * gib))
    spec = with_drawn_sets(load_task(SUITE_DIR / "lm_head_xent_softcap.yaml").spec)
    check = SimpleNamespace(spec=spec, shape_sets=list(load_task(SUITE_DIR / "lm_head_xent_softcap.yaml").spec.shapes))
    judges = runner_out_of_memory("correctness", check, H100_RUNNER_OOM)
    assert judges.status == "error" and "not the program's fault" in judges.message, judges.message
    assert "the judge held 75.0 GiB and the program's process 4.1 GiB" in judges.message, judges.message
    greedy = runner_out_of_memory("correctness", check, H100_RUNNER_OOM.replace("1002.00 MiB", "600.00 GiB"))
    assert greedy.status == "failed" and "held and asked for 603.2 GiB" in greedy.message, greedy.message
    assert runner_out_of_memory("correctness", check, "forward raised ValueError: no") is None
    assert runner_out_of_memory("correctness", check, "forward raised OutOfMemoryError: my own words") is None


def test_the_judge_keeps_two_draws_of_a_set_alive_not_all_of_them():
    """Between the draws of a set the judge holds the first draw's case and the previous draw's
    case and results, whatever the number of draws: on the GPU each is the size of the set (run 30:
    the judge held 9.7x a llama3-70b set in fp32 while it kept every draw's)."""
    import weakref
    from types import SimpleNamespace

    from coda_agent.verifier import stages

    t = load_task(SUITE_DIR / "swiglu_mlp.yaml")
    check = SimpleNamespace(task=t, spec=with_drawn_sets(t.spec), params=None, magnitude=6.0, seed=lambda: 3,
                            source=t.expert_path.read_text())
    results: list[weakref.ref] = []
    cases: list[weakref.ref] = []
    alive: list[tuple[int, int]] = []

    def live(refs: list[weakref.ref]) -> int:  # distinct tensors: a needs call's case shares its draw's
        return len({id(t) for t in (r() for r in refs) if t is not None})

    def call(case):
        alive.append((live(results), live(cases)))
        cases.append(weakref.ref(case.hi[next(iter(case.hi))]))
        got = {k: v.clone() for k, v in case.lo.items()}  # the bf16 reference: within every bar
        results.append(weakref.ref(next(iter(got.values()))))
        return got

    assert stages._check_sets(check, ["small", "ragged"], "cpu", call, determinism=False, poisoned=False) is None
    assert len(alive) >= 10  # both sets' draws ran
    # at a call: the previous draw's results or this draw's (a needs call), and the first draw's case,
    # the previous one's and this one's
    assert max(r for r, _ in alive) <= 1 and max(c for _, c in alive) <= 3, alive


def test_the_judge_grows_its_allocator_s_segments_and_runners_keep_theirs_fixed(monkeypatch, tmp_path):
    from coda_agent.verifier import judge, sandbox

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # records the session's value, restored after
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    judge.allocator_settings()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    plan = sandbox.Plan(namespaces=False, scratch=str(tmp_path))
    # The runner exports its buffers over CUDA IPC, which an expandable segment cannot.
    assert sandbox.runner_env(plan, {})["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's choice stands
    judge.allocator_settings()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
