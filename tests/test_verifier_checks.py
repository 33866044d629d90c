"""The judge's own rules, each on its own: what it draws (edge rows, the beyond set, the sets
that fit), how it compares (the bias check), and how it decides on speed (timing's verdict)."""

from __future__ import annotations

import pytest
import torch
from verifier_helpers import TASK_PATH

from coda_agent.tasks import SUITE_DIR
from coda_agent.tasks.spec import Tolerance, load_task
from coda_agent.verifier import timing
from coda_agent.verifier.compare import compare, pattern_of
from coda_agent.verifier.feedback import render_feedback
from coda_agent.verifier.inputs import LARGE, TINY, aligned_grads, drawn_params, edge_inputs, make_inputs, result_dtypes
from coda_agent.verifier.report import Report, StageResult
from coda_agent.verifier.shape_sets import beyond_set, checked_sets, set_label, with_drawn_sets
from coda_agent.verifier.timed_program import seen_of


@pytest.fixture(scope="module")
def task():
    return load_task(TASK_PATH)


@pytest.fixture(scope="module")
def rms():
    return load_task(SUITE_DIR / "residual_rmsnorm.yaml")


def test_inputs_are_fresh_and_never_zero(task):
    a = make_inputs(task.spec, "small", 1)
    b = make_inputs(task.spec, "small", 2)
    assert all(v.abs().sum() > 0 for v in a.values())
    assert not torch.equal(a["x"], b["x"])
    assert a["w"].shape == (128, 96) and a["w"].dtype == torch.bfloat16


def test_float_params_are_varied_within_what_the_reference_takes():
    """Each float param the task does not fix moves by a factor of 2^(1/4) to 16, independently, per
    check; where the reference refuses the values (a label smoothing past 1), the factors shrink until
    it takes them, down to the task's own values."""
    import random

    spec = load_task(SUITE_DIR / "residual_rmsnorm.yaml").spec.model_copy(
        update={"params": {"eps": 1e-5, "smoothing": 0.5, "n": 3, "name": "x"}})
    seen = [drawn_params(spec, random.Random(seed)) for seed in range(200)]
    assert all(set(p) == {"eps", "smoothing"} for p in seen)
    factors = [p["eps"] / 1e-5 for p in seen]
    assert all(2 ** 0.25 - 1e-9 <= max(f, 1 / f) <= 16 + 1e-9 for f in factors)
    assert min(factors) < 1 / 4 and max(factors) > 4 and len({round(f, 6) for f in factors}) == 200
    capped = [drawn_params(spec, random.Random(seed), lambda p: p["smoothing"] <= 1.0) for seed in range(200)]
    assert all(p["smoothing"] <= 1.0 for p in capped) and any(p["smoothing"] < 0.25 for p in capped)
    assert drawn_params(spec, random.Random(1), lambda p: False) == {}
    fixed = spec.model_copy(update={"fixed_params": ["smoothing"]})
    assert set(drawn_params(fixed, random.Random(1))) == {"eps"}


def test_positions_are_drawn_as_packed_sequences():
    """RoPE's positions come as a batch holds them: runs of consecutive positions, half of them from
    0 and half from an offset, all below the bound; the same seed draws the same ones."""
    spec = load_task(SUITE_DIR / "rope_fwd.yaml").spec
    pos = make_inputs(spec, "ragged", 5)["pos"].long()
    assert pos.min() >= 0 and pos.max() < 131072 and torch.equal(pos, make_inputs(spec, "ragged", 5)["pos"].long())
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1  # where a new sequence begins
    firsts = pos[torch.cat([torch.zeros(1, dtype=torch.long), starts])]
    assert 4 <= len(firsts) < len(pos) // 4 and (firsts == 0).any() and (firsts > 0).any()
    assert not torch.equal(pos, make_inputs(spec, "ragged", 6)["pos"].long())


def test_edge_rows_are_scaled_on_activations_only_tiny_large_between_and_zero(rms):
    plain = make_inputs(rms.spec, "ragged", 7)
    edge = edge_inputs(rms.spec, "ragged", 7)
    for name in ("W0", "W1", "gamma"):  # weights and norm weights: untouched
        assert torch.equal(plain[name], edge[name])
    ratio_x = (edge["x"].float() / plain["x"].float()).median(dim=1).values
    ratio_z = (edge["z"].float() / plain["z"].float()).median(dim=1).values
    assert torch.allclose(ratio_x, ratio_z, rtol=2 ** -7)  # the same rows in every tensor of that many rows
    tiny, large, zero, plain_rows = ((ratio_x == v).float().mean() for v in (TINY, LARGE, 0.0, 1.0))  # exact
    assert 0.05 < tiny < 0.2 and 0.05 < large < 0.2 and 0.02 < zero < 0.12 and 0.5 < plain_rows < 0.85
    assert bool((edge["x"][ratio_x == 0] == 0).all())  # a padding token's row: exactly zero
    between = ratio_x[(ratio_x != TINY) & (ratio_x != LARGE) & (ratio_x != 1.0) & (ratio_x != 0.0)]
    assert len(between) >= 10 and bool(((between > TINY) & (between < LARGE)).all())
    octaves = between.log2().floor().unique()
    assert len(octaves) >= 6  # magnitudes spread over the range, not a few fixed ones


def test_aligned_gradient_rows_are_parallel_to_the_output():
    g = torch.randn(256, 32)
    y = torch.randn(256, 32)
    out = aligned_grads({"dy": g}, {"y": y}, seed=3)["dy"]
    cos = torch.nn.functional.cosine_similarity(out, y, dim=1)
    aligned, masked = cos > 0.999, (out == 0).all(dim=1)  # and a masked token's rows: exactly zero
    assert 10 < int(aligned.sum()) < 60 and 4 < int(masked.sum()) < 40
    assert torch.allclose(out[aligned].norm(dim=1), g[aligned].norm(dim=1), rtol=1e-4)
    assert torch.equal(out[~aligned & ~masked], g[~aligned & ~masked])


def test_the_beyond_set_crosses_the_last_256_multiple(task, rms):
    name, binding = beyond_set(rms.spec)
    assert name == "ragged+256"
    assert binding == {"T": 1256, "H": 456, "I": 584}
    name, binding = beyond_set(task.spec)
    assert binding == {"M": 456, "N": 392, "K": 64}  # K stays: below 128 it is a head or tile size
    # A head width keeps its value however large: ragged's D = 128 grown to 384 would be a
    # head no model has and no tile holds whole.
    heads = load_task(SUITE_DIR / "qk_norm_rope.yaml").spec
    name, binding = beyond_set(heads)
    assert heads.shapes["ragged"]["D"] == 128 and binding["D"] == 128
    assert binding["T"] == heads.shapes["ragged"]["T"] + 256 and binding["H"] == heads.shapes["ragged"]["H"] + 256


def test_the_judge_draws_the_beyond_sets_sizes(task):
    """A fixed beyond set is one more size a program can list; the judge's draw never gives it,
    keeps each size's alignment and equal sizes equal, and leaves structural sizes alone."""
    import random

    from coda_agent.tasks.spec import load_task as load

    fixed = beyond_set(task.spec)[1]
    seen = set()
    for seed in range(200):
        name, drawn = beyond_set(task.spec, random.Random(seed))
        assert name == "ragged+256" and drawn["K"] == 64
        for k in ("M", "N"):
            grown = drawn[k] - fixed[k]
            assert 0 < grown < 256 and grown % 8 == 0 and drawn[k] % 128, (k, drawn)
        seen.add((drawn["M"], drawn["N"]))
    assert len(seen) > 100
    out_proj = load(SUITE_DIR / "out_proj_residual.yaml").spec  # ragged H = K = 200
    for seed in range(20):
        drawn = beyond_set(out_proj, random.Random(seed))[1]
        assert drawn["H"] == drawn["K"] and drawn["T"] % 8 == 0
    heads = load(SUITE_DIR / "qk_norm_rope.yaml").spec
    assert beyond_set(heads, random.Random(1))[1]["D"] == heads.shapes["ragged"]["D"]
    spec = with_drawn_sets(task.spec, random.Random(3))
    assert set_label(spec, "ragged+256") == "ragged+256 ({})".format(
        ", ".join(f"{k}={v}" for k, v in spec.shapes["ragged+256"].items()))
    assert set_label(spec, "ragged") == "ragged"


def test_the_sets_checked_on_a_cpu_and_on_a_gpu(rms):
    spec = with_drawn_sets(rms.spec)
    cpu, skipped = checked_sets(spec, None, None)
    assert cpu == ["small", "ragged", "ragged+256", "small+odd", "small+short"] and "llama3-70b" in skipped
    forced = spec.model_copy(update={"cpu_shape_sets": ["llama3-8b-4k"]})
    assert "llama3-8b-4k" in checked_sets(forced, None, None)[0]
    h200, skipped = checked_sets(spec, None, 141 << 30)  # the small sets too: a device tell gains nothing
    assert skipped == [] and set(h200) == set(spec.shapes) and h200[-3:] == ["llama3-70b", "small+odd", "small+short"]
    small_gpu, skipped = checked_sets(spec, None, 24 << 30)
    assert "llama3-70b" in skipped and "llama3-1b" in small_gpu
    named, _ = checked_sets(spec, ["small"], 141 << 30)
    assert named == ["small", "ragged+256", "small+odd", "small+short"]  # the drawn sets are never left out


def test_the_performance_stage_times_named_sets_never_the_small_ones(rms, monkeypatch):
    """The correctness stage checks the drawn small sets on the GPU too; the timing takes the named
    sets that fit, largest first, and where none fits the largest drawn one (the beyond set)."""
    from types import SimpleNamespace

    spec = with_drawn_sets(rms.spec)
    check = SimpleNamespace(spec=spec, shape_sets=None, task=rms)
    for total, want in ((141 << 30, ["llama3-70b", "llama3-8b", "llama3-1b", "llama3-8b-4k", "ragged", "small"]),
                        (1 << 20, None)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _, t=total: SimpleNamespace(total_memory=t))
        got = timing._timing_sets(check)
        assert got == (want or ["ragged+256"]), got
        assert checked_sets(spec, None, total)[0][-2:] == ["small+odd", "small+short"]


def test_gradients_may_come_in_fp32(task):
    assert result_dtypes(task.spec) == {"y": ["bf16"], "dx": ["bf16", "fp32"], "dw": ["bf16", "fp32"],
                                        "dr": ["bf16", "fp32"]}


# --------------------------------------------------------------------------- compare

@pytest.mark.parametrize("mutate,want", [
    (lambda o: o.__setitem__((slice(None), slice(1, None, 2)), 0), "odd columns"),
    (lambda o: o.__setitem__((slice(None), slice(0, None, 2)), 0), "even columns"),
    (lambda o: o.__setitem__((slice(128, None), slice(None)), 0), "last rows (ragged edge)"),
    (lambda o: o.__setitem__((slice(None), slice(128, None)), 0), "last columns (ragged edge)"),
    (lambda o: o.__setitem__((3, 5), float("nan")), "NaN"),
    (lambda o: o.zero_(), "all zeros"),
])
def test_mismatch_patterns(mutate, want):
    g = torch.Generator().manual_seed(0)
    hi = torch.randn(200, 136, generator=g, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    out = lo.clone()
    mutate(out)
    m = compare("y", "ragged", out, hi, lo, Tolerance())
    assert m is not None and want in m.pattern, m


def test_rounding_alone_passes_and_a_bias_under_the_max_rule_does_not():
    g = torch.Generator().manual_seed(1)
    hi = torch.randn(1000, 512, generator=g, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    assert compare("y", "s", lo.clone(), hi, lo, Tolerance()) is None
    err = float((lo.double() - hi).abs().max())
    offset = (hi + 0.5 * err).to(torch.bfloat16)  # every element within the max rule, all the same way
    m = compare("y", "s", offset, hi, lo, Tolerance())
    assert m is not None and m.pattern.startswith("systematic bias"), m
    assert compare("y", "s", offset, hi, lo, Tolerance(bias=1.0)) is None  # a task may allow more


def test_a_kink_s_flip_passes_a_widened_max_rule_while_the_norm_rule_keeps_its_factor():
    """A gradient through ReLU's kink: one element flipped (a whole term's error, 30x the bf16
    reference's largest) fails the default rule and passes the max rule widened alone
    (``norm_factor`` keeps the norm and bias rules at 2); an error over every element, 8% of the
    norm, is caught by that norm rule, which a factor of 1000 alone does not widen past 4."""
    g = torch.Generator().manual_seed(3)
    hi = torch.randn(256, 512, generator=g, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    err = float((lo.double() - hi).abs().max())
    flipped = lo.clone()
    flipped[7, 11] += 30 * err
    kink = Tolerance(factor=1000, norm_factor=2, rel_norm=0.06)
    assert compare("dx", "s", flipped, hi, lo, Tolerance()) is not None
    assert compare("dx", "s", flipped, hi, lo, kink) is None
    assert kink.dense_factor == 2 and Tolerance(factor=3).dense_factor == 3
    scaled = (hi * 1.08).to(torch.bfloat16)  # 8% off in norm, each element within 1000x the noise
    m = compare("dx", "s", scaled, hi, lo, kink)
    assert m is not None and "relative norm" in m.pattern, m
    alone = Tolerance(factor=1000, rel_norm=0.06)  # no norm_factor: the dense rules stay at 4 at most
    assert alone.dense_factor == 4 and alone.kinked
    m = compare("dx", "s", scaled, hi, lo, alone)
    assert m is not None and "relative norm" in m.pattern, m


def test_rounding_a_row_shares_passes_and_an_offset_of_its_size_does_not():
    """A weight gradient dW = dY^T X rounds each row of dY once, and every element of that row of
    dW carries the rounding: the mean of such errors averages over the rows, not the elements.
    A program whose rows round another way passes (counted per element, its mean would stand 3
    standard errors out); an offset every element shares, of one row's typical shift, does not."""
    g = torch.Generator().manual_seed(2)
    hi = torch.randn(128, 512, generator=g, dtype=torch.float64)
    step = 2e-3

    def rows_rounded():
        shift = step * torch.randn(128, 1, generator=g, dtype=torch.float64)
        return (hi + shift - shift.mean()).to(torch.float32)  # the reference's own rows cancel out

    lo, other = rows_rounded(), (hi + step * torch.randn(128, 1, generator=g, dtype=torch.float64)).float()
    tol = Tolerance(bias=0.0)  # the noise alone decides
    assert compare("dw", "s", other, hi, lo, tol) is None
    offset = (hi + step).to(torch.float32)
    m = compare("dw", "s", offset, hi, lo, tol)
    assert m is not None and m.pattern.startswith("systematic bias"), m


def test_poisoned_nan_is_called_unwritten():
    hi = torch.randn(64, 96, dtype=torch.float64)
    out = hi.to(torch.bfloat16)
    out[:, 64:] = float("nan")
    m = compare("y", "small", out, hi, hi.to(torch.bfloat16), Tolerance(), poisoned=True)
    assert m.unwritten_count == 64 * 32 and "unwritten (NaN poison survived)" in m.pattern
    # a NaN the program computed (not the poison): the message names the usual causes, `out=` first
    m = compare("y", "small", out, hi, hi.to(torch.bfloat16), Tolerance())
    assert m.nan_count == 64 * 32 and m.pattern.startswith("NaN: ") and "`out=`" in m.pattern


def test_patterns_small_helper():
    bad = torch.zeros(4, 6, dtype=torch.bool)
    bad[:, 1::2] = True
    assert pattern_of(bad, torch.zeros_like(bad), torch.zeros(4, 6), None, False).startswith("odd columns")
    per_row = torch.zeros(300, dtype=torch.bool)  # a vector (a per-token loss) is one value per row
    per_row[[58, 99]] = True
    assert pattern_of(per_row, torch.zeros_like(per_row), torch.zeros(300), None, False) == "rows [58, 99]"
    per_row[::8] = True
    assert pattern_of(per_row, torch.zeros_like(per_row), torch.zeros(300), None, False).startswith("scattered")


# --------------------------------------------------------------------------- speed in the verdict

class _Check:
    """What timing's verdict reads of a check: the spec, and a runner answering ``profile``."""

    def __init__(self, spec):
        self.spec = spec

    def request(self, header, blobs=(), max_bytes=0):
        assert header["op"] == "profile"
        return {"kernel_ms": {"coda::gemm::add_residual": 1.5, "coda::aux::rms_rstd": 0.2},
                "configs": ["add_residual: 128x192 c2x1 pingpong"]}


class _Calls:
    def load(self, case, key=0):
        return 1


class _Case:
    grads = None
    shape_set = "llama3-8b"
    params: dict = {}


def _both(ms):  # the same times in both regimes
    return timing.Times(dict(ms), dict(ms))


@pytest.mark.parametrize("times,status,words", [
    (_both({"program": 1.00, "gemm": 1.00, "compile": 1.30}), "passed", "1.00x the plain GEMMs"),
    (_both({"program": 1.40, "gemm": 1.00, "compile": 1.80}), "slow", "correct but slow (vs the plain GEMMs 1.40x"),
    (_both({"program": 1.04, "gemm": 1.00, "compile": 1.08}), "slow", "vs torch.compile 1.04x < 1.05"),
    (_both({"program": 0.50, "gemm": 1.00, "compile": 1.30}), "failed", "impossibly fast"),
    # Back to back every contender runs 20% slower (the power cap), the program 8% more than
    # its baselines: its events are believed, and per call it is as fast as its GEMMs.
    (timing.Times({"program": 1.00, "gemm": 1.00, "compile": 1.30}, {"program": 1.30, "gemm": 1.20, "compile": 1.56}),
     "passed", "1.00x the plain GEMMs"),
    # Work the events do not see (a side stream, a patched timer): per call it looks free,
    # the judge's wall clock sees all of it, and the back-to-back times decide.
    (timing.Times({"program": 1.00, "gemm": 1.00, "compile": 1.30}, {"program": 1.50, "gemm": 1.00, "compile": 1.30}),
     "slow", "judged back to back: its events saw 33% less"),
    (timing.Times({"program": 0.02, "gemm": 1.00, "compile": 1.30}, {"program": 3.00, "gemm": 1.00, "compile": 1.30}),
     "slow", "vs the plain GEMMs 3.00x"),
    (timing.Times({"program": 0.80, "gemm": 1.00, "compile": 1.30}, {"program": 0.80, "gemm": 1.00, "compile": 1.30}),
     "failed", "impossibly fast"),
    # torch.compile already at its GEMMs: the task's 1.05 is past what any program can reach,
    # and the verdict asks for the cap (less 2% of noise, and never below compile's speed).
    (_both({"program": 0.99, "gemm": 1.00, "compile": 1.01}), "passed", "is past the cap"),
    (_both({"program": 1.02, "gemm": 1.00, "compile": 1.01}), "slow", "vs torch.compile 0.99x < 1"),
])
def test_speed_decides_between_accepted_slow_and_impossible(rms, times, status, words):
    res = timing._verdict(_Check(rms.spec), "llama3-8b", times, {}, _Case(), _Calls())
    assert res.status == status and words in res.message, res.message
    if status == "slow":
        assert res.details["profile"]["gemm_launches_ms"] == 1.5
        report = Report(task="residual_rmsnorm", program_sha256="x", outcome="correct_slow", stages=[res])
        text = render_feedback(report, "")
        assert text.startswith("CORRECT BUT SLOW") and "over it" in text and "gemm::add_residual" in text


@pytest.mark.parametrize("blame,want", [("error", "passed"), ("failed", "failed")])
def test_a_set_too_large_for_the_judges_timing_gives_way_unless_the_program_holds_the_memory(monkeypatch, blame,
                                                                                             want):
    timed = []

    def perform(check, shape_set):
        timed.append(shape_set)
        if shape_set == "llama3-70b":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")
        return StageResult(name="performance", status="passed", message=f"1.00x on {shape_set}")

    monkeypatch.setattr(timing, "_timing_sets", lambda check: ["llama3-70b", "llama3-8b", "llama3-1b"])
    monkeypatch.setattr(timing, "_perform", perform)
    monkeypatch.setattr(timing, "out_of_memory", lambda stage, check, error: StageResult(
        name=stage, status=blame, message=f"weighed: {error}"))
    res = timing.performance(object())
    assert res.status == want, res.message
    if blame == "error":  # the judge's own baselines did not fit: the next set is timed, and the verdict says so
        assert timed == ["llama3-70b", "llama3-8b"]
        assert "timed at llama3-8b" in res.message and res.details["timing_sets_too_large"] == ["llama3-70b"]
    else:  # the program's process held the card: a rejection, never a smaller set
        assert timed == ["llama3-70b"] and "weighed" in res.message


def test_a_fallback_that_reaches_a_set_where_the_host_is_the_call_gives_no_speed_verdict(monkeypatch):
    """Below the set the judge could not time, a set whose call the host outlasts measures the host:
    the stage says so (the larger set's error, not blamed on the program), never "slow"."""
    def perform(check, shape_set):
        if shape_set == "llama3-1b":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")
        ms = {"ragged": 2.5, "small": 0.087}[shape_set]
        return StageResult(name="performance", status="slow", message=f"36.9x on {shape_set}",
                           details={"host_ms": 1.99, "ms": {"program": ms, "gemm": 0.0024}})

    monkeypatch.setattr(timing, "_perform", perform)
    monkeypatch.setattr(timing, "out_of_memory", lambda stage, check, error: StageResult(
        name=stage, status="error", message=f"weighed: {error}"))
    monkeypatch.setattr(timing, "_timing_sets", lambda check: ["llama3-1b", "small"])
    res = timing.performance(object())
    assert res.status == "error" and res.details["host_bound_at"] == "small", res.message
    assert "1.990 ms to enqueue a call of 0.087 ms" in res.message and "weighed" in res.message
    monkeypatch.setattr(timing, "_timing_sets", lambda check: ["llama3-1b", "ragged"])  # kernels outlast the host
    res = timing.performance(object())
    assert res.status == "slow" and "timed at ragged" in res.message


def test_blocks_grow_until_the_first_calls_enqueue_is_a_small_share():
    room, result = 32 << 30, 128 << 20
    assert timing.block_calls(141.0, 55.0, 0.5, room, result) == 4  # 200 ms of the slowest: the floor
    assert timing.block_calls(1.0, 1.0, 0.02, room, result) == 32  # many short calls: the ceiling
    n = timing.block_calls(141.0, 55.0, 40.0, room, result)  # a host-heavy program (the H100's LM head)
    assert 40.0 / (n * 55.0) <= timing.HOST_SHARE < 40.0 / ((n - 1) * 55.0)
    assert timing.block_calls(141.0, 55.0, 40.0, 6 * result, result) == 6  # never past the runner's room
    assert timing.block_calls(141.0, 55.0, 1e9, room, result) == 32  # a claimed host time buys no more than the cap


def test_what_the_runner_says_of_a_block_is_kept_only_when_well_formed():
    """A block's diagnostics are the runner's word: numbers under short names are kept for the
    report beside the judge's own wall clock; anything else (the program may answer for the
    runner) is dropped, never raised on and never read by the verdict."""
    good = {"host_ms": 334.6, "num_alloc_retries": 0}
    assert seen_of(good, 483.4) == {**good, "judge_wall_ms": 483.4}
    forged = {"host_ms": float("nan"), "x" * 50: 1, "num_device_alloc": "11", 3: 4, "block_ms": True,
              **{f"k{i}": i for i in range(20)}}
    kept = seen_of(forged, 12.0)
    assert kept["judge_wall_ms"] == 12.0 and len(kept) == 9 and all(k.startswith("k") for k in list(kept)[:8])
    assert seen_of(["not", "a", "dict"], 1.0) == {"judge_wall_ms": 1.0}


def test_correct_slow_is_its_own_outcome():
    passed = [StageResult(name=s, status="passed") for s in ("static", "reference", "compile", "correctness",
                                                               "launch_audit")]
    assert Report.outcome_of(passed + [StageResult(name="performance", status="slow")]) == "correct_slow"
    assert Report.outcome_of(passed + [StageResult(name="performance", status="passed")]) == "accepted"
    assert Report.outcome_of(passed[:3]) == "cpu_passed"


def test_a_ranges_device_time_is_its_kernels_not_its_span():
    """A range of three small launches with the host's gaps between them spans 300 us on the device
    timeline but keeps the GPU busy for 30; a GEMM's range is its kernel.  Kernels outside a range
    (or partly outside: a span is clipped) do not count toward it, and a name seen twice adds up."""
    from coda_agent.verifier.program import busy_ms

    spans = [("coda::aux::coeffs", 1000.0, 1300.0), ("coda::gemm::plain", 1300.0, 3300.0),
             ("coda::aux::coeffs", 4000.0, 4010.0)]
    kernels = [(1000.0, 1010.0), (1150.0, 1160.0), (1290.0, 1300.0), (1300.0, 3300.0), (3500.0, 3600.0),
               (3995.0, 4005.0)]
    got = busy_ms(spans, kernels)
    assert got == pytest.approx({"coda::aux::coeffs": 0.035, "coda::gemm::plain": 2.0})


# --------------------------------------------------------------------------- the SASS gate


def _kernel(epilogue: str, kind: str, hgmma: int, sm90a: bool = True) -> dict:
    sass = {"sm90a": sm90a, "hgmma": hgmma, "spill_stores": 0, "spill_loads": 0, "registers": 64,
            "local_bytes": 0, "instructions": 900, "calls": 0}
    return {"epilogue": epilogue, "config": "128x128", "seconds": 0.1, "log": "", "sass": sass, "kind": kind}


def test_the_runners_reports_are_checked_for_their_types_before_they_are_read():
    """A compile or profile reply is the runner's word: a field of the wrong JSON type is the
    program's failure (a CandidateError), never a TypeError in the judge (its own error)."""
    from coda_agent.verifier.program import CandidateError
    from coda_agent.verifier.stages import audit_result, kernel_reports

    good = _kernel("bias_gelu", "gemm", 16)
    assert kernel_reports({"kernels": [good, {**good, "sass": None}]})[0] is good
    for bad in (7, None, "kernels", [3], [{**good, "sass": [1]}],
                [{**good, "sass": {**good["sass"], "spill_stores": "none"}}],
                [{**good, "sass": {**good["sass"], "calls": -1}}], [{**good, "sass": {**good["sass"], "hgmma": 1.5}}]):
        with pytest.raises(CandidateError, match="reply to `compile`"):
            kernel_reports({"kernels": bad})
    for key in ("ledger", "kernels", "outside"):
        with pytest.raises(CandidateError, match=f"as `{key}`"):
            audit_result({key: 5})
    assert audit_result({"ledger": ["gemm:plain"], "kernels": ["k"], "outside": []}).status == "passed"


def test_the_sass_gate_wants_an_mma_in_every_gemm_and_none_in_a_streaming_pass():
    """A GEMM kernel without warpgroup MMAs lost its mainloop and fails the compile stage; a
    tile pass on its own streaming kernel has none by design and passes; any kernel not built
    for sm_90a fails."""
    from coda_agent.verifier.stages import compile_result

    ok = compile_result([_kernel("bias_gelu", "gemm", 16), _kernel("dgelu", "pass", 0)], "small")
    assert ok.status == "passed", ok.message
    assert [k["kind"] for k in ok.details["kernels"]] == ["gemm", "pass"]
    lost = compile_result([_kernel("bias_gelu", "gemm", 0), _kernel("dgelu", "pass", 0)], "small")
    assert lost.status == "failed" and lost.message == "bias_gelu: no HGMMA instructions (the mainloop lost its "\
        "warpgroup MMA)", lost.message
    unmarked = compile_result([{k: v for k, v in _kernel("plain", "gemm", 0).items() if k != "kind"}], "small")
    assert unmarked.status == "failed" and "plain: no HGMMA" in unmarked.message  # no kind: a GEMM
    wrong_arch = compile_result([_kernel("dgelu", "pass", 0, sm90a=False)], "small")
    assert wrong_arch.status == "failed" and "not compiled for sm_90a" in wrong_arch.message
