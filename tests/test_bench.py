"""The benchmark's plumbing, on CPU: ``bench/run.py --dry-run`` runs every suite
task's expert program, its plain GEMMs and its eager reference through the same
code path the H200 run takes, and ``bench/table.py`` renders what it wrote.
(The timings of a dry run mean nothing; the device run is recorded in
bench/results/ and BENCHMARKS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coda_agent.primitives import TileConfig

ROOT = Path(__file__).resolve().parent.parent


def dry_run(out: Path, *args: str) -> tuple[Path, dict]:
    """``bench/run.py --dry-run ARGS --out OUT`` as a script: the one results file it wrote, and
    its content."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--dry-run", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return written(out)


def written(out: Path) -> tuple[Path, dict]:
    """The one results file a dry run wrote in ``out``, and its content."""
    (path,) = out.glob("dryrun-*.json")
    return path, json.loads(path.read_text())


def test_dry_run_covers_the_suite_and_renders_a_table(tmp_path):
    path, results = dry_run(tmp_path, "--sets", "small", "--reps", "1")
    rows = results["rows"]
    assert {r["task"] for r in rows} >= {"swiglu_fwd", "lm_head_xent", "llama3_block", "mlp_block"}
    for r in rows:
        assert "error" not in r, r
        for key in ("fused", "gemm_cublas", "gemm_quack", "eager"):
            assert r[key]["median_ms"] > 0 and r[key]["host_ms"] > 0, (r["task"], key)
        assert r["configs"], r["task"]  # every row says which tile configs its GEMMs used
        assert r["fused_over_gemm"] > 0

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import table
    finally:
        sys.path.pop(0)
    text = table.render(results)
    assert all(f"| {r['task']} | {table._kind(r['task'])} | small |" in text for r in rows)
    assert "geomean fused / plain GEMM (target <= 1.05)" in text
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# prose kept\n{table.START}\nold table\n{table.END}\nmore prose\n")
    table.update([f"{path}=Dry run"], doc=doc)
    updated = doc.read_text()
    assert updated.startswith("# prose kept\n") and updated.endswith("more prose\n")
    assert "old table" not in updated and "#### Dry run" in updated
    lm = next(r for r in rows if r["task"] == "lm_head_xent")
    assert lm["fused_output_gib"] is None or lm["fused_output_gib"] >= 0


def test_dry_run_of_the_gpt2_suite(tmp_path, bench_main):
    """--suite picks the packaged GPT-2 suite; its file is named after the suite."""
    assert bench_main("run", "--dry-run", "--suite", "gpt2", "--sets", "small", "--reps", "1", "--out", tmp_path) == 0
    path, results = written(tmp_path)
    assert path.name.endswith("-gpt2.json")
    assert results["suite"] == "gpt2"
    rows = {r["task"]: r for r in results["rows"]}
    assert set(rows) == {"gelu_bwd", "gelu_fwd", "gelu_mlp", "gelu_tanh_mlp", "gpt2_block", "layernorm_bwd",
                         "linear_gelu", "linear_gelu_tanh", "linear_relu", "lm_head_xent", "ln_qkv", "mlp_block",
                         "mlp_block_tanh", "out_proj_residual", "relu_mlp", "relu2_mlp", "residual_layernorm"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["fused"]["median_ms"] > 0 and r["fused_over_gemm"] > 0


def test_bench_refuses_an_unknown_suite_and_task(tmp_path, bench_main, capsys):
    """The command line is checked before any work."""
    for args, error in ((["--suite", str(tmp_path)], "is not a packaged suite, so name its shape sets"),
                        (["--suite", "gpt2", "--tasks", "swiglu_fwd"], "['swiglu_fwd'] are not in suite gpt2")):
        with pytest.raises(SystemExit) as exit_:
            bench_main("run", "--dry-run", "--out", tmp_path, *args)
        assert exit_.value.code == 2 and error in capsys.readouterr().err


def test_passes_bench_dry_run_writes_every_case(tmp_path):
    out = tmp_path / "passes.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "passes.py"), str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["bandwidth"]
    assert set(rows) == {f"{case} T={t} N={n}" for case in ("dgelu", "row_stats", "normalize_rows")
                         for t, n in ((256, 128), (1000, 200))}
    for row in rows.values():
        assert row["pass"]["median_ms"] > 0 and row["copy"]["gb_per_s"] > 0
    rms = json.loads(out.read_text())["rms_prepare"]
    assert set(rms) == {"rms_prepare T=256 N=128", "rms_prepare T=1000 N=200"}
    assert all(set(row) == {"copy", "pytorch body", "pass"} for row in rms.values())


def test_targets_say_what_plain_gemm_speed_would_score():
    """The speedup-over-compile lines carry the ceiling a kernel at exactly the
    plain GEMMs' speed would reach: the part of a miss no epilogue can win."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import table
    finally:
        sys.path.pop(0)

    def row(task, fused, gemm, compile_ms):
        return {"task": task, "fused_over_gemm": fused / gemm, "speedup_vs_compile": compile_ms / fused,
                "fused": {"median_ms": fused}, "gemm_cublas": {"median_ms": gemm},
                "gemm_quack": {"median_ms": gemm * 1.1}, "compile": {"median_ms": compile_ms}}

    lines = table.targets([row("rmsnorm_bwd", 3.0, 2.9, 3.19), row("swiglu_bwd", 1.1, 0.7, 1.2)])
    (bwd,) = [line for line in lines if "backward tasks" in line]
    ceiling = (3.19 / 2.9 * 1.2 / 0.7) ** 0.5
    assert f"(at plain-GEMM speed: {ceiling:.3f})" in bwd and "missed" in bwd


def test_tile_config_maps_to_one_quack_object():
    """quack's eager fast path keys a pinned config by identity: equal configs
    must hand it the same object, or every call takes the cold path."""
    a, b = TileConfig(128, 128, 1, 1, True), TileConfig(128, 128, 1, 1, True)
    assert a.to_quack() is b.to_quack()
    assert a.to_quack() is not TileConfig(128, 192, 2, 1, True).to_quack()
    assert a.to_quack().tile_n == 128 and not a.to_quack().is_dynamic_persistent


def _bench_module(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    """An executable standing in for nvidia-smi: the sampler runs it as it would the real one."""
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return str(path)


def _sample_for(sampler, seconds: float) -> tuple[float, float]:
    t0 = time.time()
    with sampler:
        deadline = time.time() + 20
        while len(sampler.samples) < 3 and sampler.error is None and time.time() < deadline:
            time.sleep(seconds)
    return t0, time.time()


def test_clock_sampler_summarizes_what_the_gpu_ran_at(tmp_path):
    """Clock, power, temperature and the driver's reasons for holding the clock
    down (its power cap here; "idle" between reps is not a reason worth reporting)."""
    clocks = _bench_module("clocks")
    fake = _fake_nvidia_smi(tmp_path, 'case "$*" in *"-i 3 "*) ;; *) echo "wrong GPU: $*" >&2; exit 6;; esac\n'
                                      'echo "1755, 1980, 689.50, 61, 0x0000000000000005"\n')
    sampler = clocks.ClockSampler(gpu=3, period_s=0.01, command=fake)
    t0, t1 = _sample_for(sampler, 0.05)
    assert sampler.error is None and len(sampler.samples) >= 3
    got = sampler.summary(t0, t1)
    assert got["sm_mhz_median"] == 1755 and got["sm_mhz_min"] == 1755 and got["sm_mhz_max_rated"] == 1980
    assert got["power_w_median"] == 689.5 and got["temp_c_max"] == 61
    assert got["reasons"] == ["power cap"]
    assert sampler.summary(t1 + 1, t1 + 2) is None  # no samples in a window: no claim


def test_clock_sampler_keeps_sampling_without_the_reasons_field(tmp_path):
    """An older driver rejects clocks_event_reasons.active: the sampler drops that
    field and keeps the rest, instead of stopping."""
    clocks = _bench_module("clocks")
    fake = _fake_nvidia_smi(tmp_path, 'case "$*" in *clocks_event_reasons*) '
                                      'echo "Field is not a valid field to query." >&2; exit 2;; esac\n'
                                      'echo "1410, 1980, 700.00, 70"\n')
    sampler = clocks.ClockSampler(period_s=0.01, command=fake)
    t0, t1 = _sample_for(sampler, 0.05)
    assert sampler.error is None
    got = sampler.summary(t0, t1)
    assert got["sm_mhz_median"] == 1410 and got["reasons"] == []


def test_clock_sampler_stops_and_says_why_when_the_gpu_cannot_be_queried(tmp_path):
    clocks = _bench_module("clocks")
    fake = _fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate" >&2; exit 9\n')
    sampler = clocks.ClockSampler(period_s=0.01, command=fake)
    t0, t1 = _sample_for(sampler, 0.05)
    assert "could not communicate" in sampler.error and sampler.summary(t0, t1) is None
    assert "not found" in clocks.ClockSampler(command="no-such-nvidia-smi").error


def test_table_shows_the_clock_each_row_ran_at():
    table = _bench_module("table")

    def row(task, mhz, reasons):
        return {"task": task, "shape_set": "llama3-8b", "fused_over_gemm": 1.0, "speedup_vs_compile": 1.1,
                "speedup_vs_eager": 1.2, "tflops": 700.0, "fused": {"median_ms": 1.0, "p10_ms": 1.0,
                                                                     "p90_ms": 1.0, "host_ms": 0.1},
                "clock": {"samples": 5, "sm_mhz_median": mhz, "sm_mhz_min": mhz - 100,
                          "sm_mhz_max_rated": 1980, "power_w_median": 690, "temp_c_max": 60,
                          "reasons": reasons}}

    results = {"date": "2026-11-29", "reps": 20, "method": "m",
               "versions": {"gpu": "NVIDIA H200", "torch": "t", "cuda": "c", "quack-kernels": "q",
                            "nvidia-cutlass-dsl": "d", "liger-kernel": "l", "catalogue": "x"},
               "rows": [row("swiglu_fwd", 1755, ["power cap"]), row("rope_fwd", 1980, [])]}
    text = table.render(results)
    assert "| 1755 (1655) |" in text and "| 1980 (1880) |" in text
    assert ("SM clock while timed (median per row): 1755-1980 MHz, rated 1980; reasons the driver "
            "held it down: power cap in 1 of 2 rows") in text


def test_steady_regime_times_each_contender_back_to_back_in_two_passes(tmp_path, bench_main):
    """``--steady SECONDS``: the training-step regime.  The dry run takes the
    same path on wall-clock time: two passes per contender, their range kept,
    its own file, and a table that says how it was timed and which contenders
    the host (not the GPU) set the pace of."""
    assert bench_main("run", "--dry-run", "--sets", "small", "--tasks", "swiglu_fwd", "--steady", "0.05",
                      "--out", tmp_path) == 0
    path, results = written(tmp_path)
    assert path.name.endswith("-steady.json")
    assert results["regime"] == "steady" and results["steady_s"] == 0.05
    (row,) = results["rows"]
    for key in ("fused", "gemm_cublas", "gemm_quack", "eager"):
        got = row[key]
        assert len(got["passes_ms"]) == 2 and got["reps"] >= 2, key
        assert got["p10_ms"] == min(got["passes_ms"]) and got["p90_ms"] == max(got["passes_ms"])
        assert got["median_ms"] == sum(got["passes_ms"]) / 2
    # On the host's clock every contender is "host-bound": the flag's rule at work.
    assert set(row["host_bound"]) == {"fused", "gemm_cublas", "gemm_quack", "eager"}
    text = _bench_module("table").render(results)
    assert "Times in ms per call: mean (range of the passes)" in text and " reps." not in text
    assert "host-bound back to back" in text and "swiglu_fwd small: fused, " in text


def test_clock_summary_over_several_windows_keeps_only_their_samples():
    """A steady-state row times each contender in two separate windows; its
    clock is what the GPU ran at inside those, not between them."""
    clocks = _bench_module("clocks")
    sampler = clocks.ClockSampler(command="no-such-nvidia-smi")
    sampler.samples = [clocks.Sample(t, mhz, 1980, 690, 60, 0x4 if mhz < 1500 else 0)
                       for t, mhz in ((1.0, 1400), (2.0, 1900), (3.0, 1410), (4.0, 1980))]
    got = sampler.summary_over([(0.5, 1.5), (2.5, 3.5)])
    assert got["samples"] == 2 and got["sm_mhz_median"] == 1405 and got["reasons"] == ["power cap"]
    assert sampler.summary(1.5, 4.5)["samples"] == 3


def test_host_path_measures_each_expert_call_without_a_gpu(tmp_path):
    """bench/host_path.py: the catalogue's host cost of an expert call (quack's launch stubbed
    out), one row per task with the launches the call made."""
    host_path = _bench_module("host_path")
    out = tmp_path / "host.json"
    assert host_path.main(["--tasks", "rope_bwd,mlp_block", "--rounds", "2", "--calls", "3", "--out", str(out)]) == 0
    rows = {r["task"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["mlp_block", "rope_bwd"]
    assert rows["rope_bwd"]["launches"] == 3 and rows["mlp_block"]["launches"] > 3
    assert all(0 < r["host_ms_min_max"][0] <= r["host_ms"] <= r["host_ms_min_max"][1] for r in rows.values())
    with pytest.raises(SystemExit):
        host_path.main(["--tasks", "no_such_task"])


def test_margins_measure_each_output_with_the_judges_own_comparison(tmp_path, monkeypatch):
    """bench/margins.py: every output of an expert gets a margin over 1 (the expert passes) and
    the rule its grown error breaks, per draw kind too, with ``--beyond`` on the drawn set as well;
    an error that already fails gets the factor below 1 it would have to shrink by, 0 past the cap;
    ``--program`` measures a cheat (its task by path), which stands below 1 only in the draws that
    catch it."""
    import torch

    from coda_agent.tasks.spec import Tolerance

    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "margins.py"), str(out), "--suites", "llama3",
                           "--tasks", "swiglu_fwd", "--draws", "1", "--seed", "0", "--beyond"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["output"] for r in rows} == {"y", "pre"}
    # four draws on each of small, ragged and the drawn set past them
    assert all(1.0 < r["min_margin"] <= r["median_margin"] and r["samples"] == 12 for r in rows), rows
    assert all(r["rule"] for r in rows if r["min_margin"] < 8.0), rows
    assert all(r["min_judged"] >= r["min_margin"] for r in rows), rows  # the second look only adds
    assert all(set(r["judged_by_draw"]) == {"seed", "outliers", "edge", "scaled"} for r in rows), rows
    cheat = tmp_path / "c.json"
    flushes = ROOT / "tests" / "bad_programs" / "extreme" / "flushes_small_values.py"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "margins.py"), str(cheat), "--tasks",
                           str(ROOT / "tasks" / "llama3" / "swiglu_fwd.yaml"), "--program", str(flushes), "--draws",
                           "2", "--seed", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_draw = {r["output"]: r["judged_by_draw"] for r in json.loads(cheat.read_text())["rows"]}
    # the small magnitudes catch it, and the edge draw's tiny rows by the whole-row rule; rows at one
    # scale near 1 keep their values
    assert max(by_draw["y"][d]["min"] for d in ("scaled", "edge")) < 1.0 <= min(
        by_draw["y"][d]["min"] for d in ("seed", "outliers"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import margins

    hi = torch.randn(64, 64, dtype=torch.float64)
    lo = hi.to(torch.bfloat16)
    assert margins.margin("y", "s", (hi + 1.0).float(), hi, lo, Tolerance(), 8.0)[0] == 0.0
    err = torch.randn(64, 64, dtype=torch.float64) * 1e-3
    passing = margins.margin("y", "s", (hi + err).float(), hi, lo, Tolerance(), 8.0)[0]
    assert 1.0 < passing < 8.0
    twice = margins.margin("y", "s", (hi + 2 * passing * err).float(), hi, lo, Tolerance(), 8.0)[0]
    assert 0.4 < twice < 0.6  # twice the error it may have: it must shrink by half


def test_gemm_energy_dry_run_times_cublas_and_every_tile_of_the_pool(tmp_path):
    """``bench/gemm_energy.py --dry-run``: each shape's rows (cuBLAS, then quack at each tile of
    the wide pool) in the JSON, the markdown table beside it; an unknown shape is refused by name."""
    from coda_agent.primitives.tuning import WIDE_CANDIDATES

    out = tmp_path / "energy.json"
    script = str(ROOT / "bench" / "gemm_energy.py")
    proc = subprocess.run([sys.executable, script, str(out), "--dry-run", "--seconds", "0.02",
                           "--shapes", "gate_up,dw_down"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    want = ["cublas", *(f"quack {c}" for c in WIDE_CANDIDATES)]
    assert [r["contender"] for r in rows if r["shape"] == "gate_up"] == want
    assert {r["shape"] for r in rows} == {"gate_up", "dw_down"}
    dw = next(r for r in rows if r["shape"] == "dw_down")
    assert dw["MNK"] == [64, 8192 // 64, 16384 // 64] and dw["layouts"] == "mn"  # at least 64 a side
    assert all(r["ms"] > 0 and r["calls"] >= 1 for r in rows)
    assert out.with_suffix(".md").read_text().count("| gate_up") == len(want)
    bad = subprocess.run([sys.executable, script, str(out), "--dry-run", "--shapes", "gate_up,qkvo"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown shapes ['qkvo']" in bad.stderr


def test_dropin_coverage_patches_or_refuses_each_model_it_builds(tmp_path):
    """bench/dropin_coverage.py on real transformers models: each drop-in patches its own family
    (to HF's loss; GPT-2 rebuilt with the config value
    its refusal names, Phi-3 with its padding id moved into the small vocabulary, Mellum, whose
    rotary embedding keeps no frequency table, DeepSeek-V3 built at small latent-attention widths
    with its MoE in the second layer, Gemma-4 with a layer of each of its two kinds) and refuses
    the others with a KernelError; an unknown model type is refused."""
    pytest.importorskip("transformers")
    coverage = _bench_module("dropin_coverage")
    out = tmp_path / "coverage.json"
    models = "llama,gpt_neox,phi,gemma,gpt2,phi3,mellum,olmo2,deepseek_v3,gemma4_text"
    assert coverage.main([str(out), "--models", models]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["patched"] == ["deepseek_v3:apply_to_model",  # MLA: its MLPs, experts and head
                                            "gemma4_text:apply_to_model",  # sliding and full layers, its head
                                            "gemma:apply_to_llama",  # its GeGLU MLP alone, as geglu_mlp
                                            "gpt2:apply_to_gpt2(resid_pdrop=0.0)",  # the config value it named
                                            "gpt_neox:apply_to_gpt_neox", "llama:apply_to_llama",
                                            "mellum:apply_to_llama(swiglu=False)",  # a rotary without inv_freq
                                            "olmo2:apply_to_model",  # no layer drop-in: its MLPs and LM head
                                            "phi3:apply_to_llama",
                                            # Phi-2's MLPs, ungated; its LM head has a bias (the refusal
                                            # names the flag that keeps it HF's)
                                            "phi:apply_to_model(fused_linear_cross_entropy=False)"]
    assert report["summary"]["error"] == []
    rows = {r["model_type"]: r for r in report["rows"]}
    llama = rows["llama"]["apply_to_llama"]
    assert abs(llama["loss"] - llama["hf_loss"]) < 0.02 * llama["hf_loss"]
    assert "train it unpatched" in rows["phi"]["apply_to_llama"]["message"]
    assert "apply_to_model" not in rows["llama"]  # tried only where no drop-in of whole layers patches
    assert rows["olmo2"]["apply_to_model"]["parts"] == {"swiglu_mlp": 2, "geglu_mlp": 0, "swiglu_clamp_mlp": 0,
                                                           "gelu_mlp": 0,
                                                           "gelu_tanh_mlp": 0, "relu_mlp": 0, "relu2_mlp": 0, "linear_gelu": 0,
                                                           "linear_gelu_tanh": 0, "linear_relu": 0,
                                                           "fused_linear_cross_entropy": True}
    # layer 0's dense MLP, layer 1's routed experts and its shared experts
    assert rows["deepseek_v3"]["apply_to_model"]["parts"]["swiglu_mlp"] == 3
    gemma4 = rows["gemma4_text"]
    assert gemma4["layered"] and gemma4["apply_to_model"]["parts"]["geglu_mlp"] == 2
    assert gemma4["apply_to_model"]["parts"]["fused_linear_cross_entropy"]
    phi = rows["phi"]["apply_to_model"]
    assert phi["flags"] == {"fused_linear_cross_entropy": False} and phi["result"] == "patched"
    assert phi["parts"]["gelu_tanh_mlp"] == 2 and abs(phi["loss"] - phi["hf_loss"]) < 0.01
    with pytest.raises(SystemExit):
        coverage.main([str(out), "--models", "no_such_model"])


@pytest.mark.parametrize("name,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA GH200 480GB", "gh200"), ("Some GPU", "gpu")])
def test_a_results_file_is_named_after_the_gpu_that_wrote_it(name, tag):
    """An H100's numbers land in h100-<date>-<suite>.json, not under the H200's name."""
    assert _bench_module("run").gpu_tag(name) == tag
