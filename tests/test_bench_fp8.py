"""The fp8 benchmarks' plumbing on CPU: ``bench/fp8.py --dry-run`` runs every
contender of the anchor table (the fp8 and bf16 experts under the reference
lowering, torchao's float8 modules eagerly, the plain GEMMs), and
``bench/fp8_loss.py --dry-run`` trains every recipe a few steps and plots the
curves.  (Their numbers mean nothing on CPU; the H200 commands are in the
scripts' docstrings.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_anchor_table_runs_every_contender(tmp_path):
    compare = tmp_path / "before"  # another version of one block's program, timed beside the expert
    compare.mkdir()
    (compare / "mlp_block_fp8.py").write_text((ROOT / "tasks/llama3_fp8/experts/mlp_block_fp8.py").read_text())
    _run(str(ROOT / "bench" / "fp8.py"), str(tmp_path), "--dry-run", "--sets", "small", "--reps", "1", "--casts", "--profile",
         "--tune", "--compare", str(compare))
    results = json.loads((tmp_path / "fp8-anchors-dryrun.json").read_text())
    (casts,) = results["casts"]
    assert {"rows", "cols", "rows_and_cols", "both", "copy"} <= set(casts) and casts["both"]["gb_per_s"] > 0
    rows = results["rows"]
    assert {r["block"] for r in rows} == {"mlp_block", "llama3_block"}
    for r in rows:
        assert not [k for k in r if k.endswith("error")], r
        for key in ("coda_fp8", "coda_bf16", "torchao_rowwise", "torchao_tensorwise", "compile_bf16",
                    "gemm_fp8_fast", "gemm_fp8", "gemm_scaled_mm", "gemm_bf16"):
            assert r[key]["median_ms"] > 0 and "peak_gib" in r[key], (r["block"], key)
        assert set(r["targets_met"]) == {"vs_torchao_rowwise >= 1.2", "vs_fp8_gemms <= 1.05"}
        assert r["coda_fp8_tuned"] == [] and r["coda_bf16_tuned"] == []  # the reference lowering tunes nothing
        launches = r["coda_fp8_profile"]["launches"]  # the program's catalogue launches, by name
        assert "coda::aux::quantize_both" in launches and any(k.startswith("coda::gemm") for k in launches), launches
    mlp, llama = sorted(rows, key=lambda r: r["block"] != "mlp_block")
    assert mlp["coda_fp8_compare"]["median_ms"] > 0 and mlp["coda_fp8_speedup_vs_compare"] > 0
    assert "launches" in mlp["coda_fp8_compare_profile"]
    assert "coda_fp8_compare" not in llama  # no llama3_block_fp8.py in the folder
    # a folder holding no program of the blocks asked for is named back, not silently ignored
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8.py"), str(tmp_path), "--dry-run", "--blocks",
                           "llama3_block", "--compare", str(compare)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "none of llama3_block_fp8.py is there" in proc.stderr, proc.stderr[-500:]


def test_loss_curves_train_every_recipe_and_plot(tmp_path, bench_main):
    _run(str(ROOT / "bench" / "fp8_loss.py"), str(tmp_path), "--dry-run", "--steps", "2", "--band-seeds", "2")
    lines = [json.loads(x) for x in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert not [x for x in lines if "error" in x], lines
    runs = {(x["recipe"], x["seed"]) for x in lines if "loss" in x}
    assert runs == {(r, 0) for r in ("bf16", "torchao_rowwise", "torchao_tensorwise", "coda_delayed",
                                     "coda_rowscale", "coda_tileblock")} | {("torchao_rowwise", 1)}
    assert all(x["loss"] > 0 for x in lines if "loss" in x)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["band_seeds"] == 2 and set(summary["verdict_vs_band"]) == {f"{r}/{s}" for r, s in runs}
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # --plot alone re-renders from the recorded lines
    (tmp_path / "loss.png").unlink()
    assert bench_main("fp8_loss", tmp_path, "--plot") == 0
    assert (tmp_path / "loss.png").is_file()


def test_the_amax_geometry_sweep_times_every_geometry_in_the_interpreter():
    """``--casts``' sweep of the amax pass (CUDA only in the benchmark), run by Triton's CPU
    interpreter: every geometry runs, the shipped one is marked, fastest first."""
    code = (f"import sys, json, torch; sys.path.insert(0, {str(ROOT / 'bench')!r}); import fp8; "
            "rows = fp8.amax_geometries(torch.randn(64, 96).bfloat16(), 1, 'cpu'); print(json.dumps(rows))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 54 + 3 and sum(r["shipped"] for r in rows) == 1
    assert [r["median_ms"] for r in rows] == sorted(r["median_ms"] for r in rows)
