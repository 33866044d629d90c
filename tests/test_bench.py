"""The benchmark's plumbing, on CPU: ``bench/run.py --dry-run`` runs every suite
task's expert program, its plain GEMMs and its eager reference through the same
code path the H200 run takes, and ``bench/table.py`` renders what it wrote.
(The timings of a dry run mean nothing; the device run is recorded in
bench/results/ and BENCHMARKS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from coda_agent.primitives import TileConfig

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_covers_the_suite_and_renders_a_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--dry-run", "--sets", "small",
                           "--reps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("dryrun-*.json")
    results = json.loads(path.read_text())
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
