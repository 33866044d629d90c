"""The tuning cache: fail-closed keys, persistence, and a lookup cheap enough
to run on every gemm() call (its cost once starved the H200, see tuning.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from coda_agent.primitives import TileConfig, load_program, tuning
from coda_agent.primitives.timing import Steady

SRC = '''
from coda_agent.primitives import *
@epilogue(outputs={"h": "bf16"}, reductions={"sqsum": col_sum()})
def residual_rms(acc, residual: Tile, gamma: RowVec):
    h = acc + residual
    return {"D": h * gamma, "h": h, "sqsum": h * h}
'''


def test_put_get_roundtrip_and_corrupt_file_is_a_miss(tmp_path):
    cache = tuning.TuningCache(tmp_path)
    cfg = TileConfig(128, 128, 1, 1, True)
    cache.put("k1", cfg, {"128x128": 1.0})
    assert cache.get("k1") == cfg
    (tmp_path / "k2.json").write_text("{not json")
    assert cache.get("k2") is None


def test_key_changes_with_shape_and_program():
    epi = load_program(SRC).residual_rms
    other = load_program(SRC.replace("h * h", "h * h * 2.0")).residual_rms
    k = tuning.tuning_key(epi, 64, 96, 128, torch.bfloat16, "H200")
    assert k != tuning.tuning_key(epi, 64, 96, 256, torch.bfloat16, "H200")
    assert k != tuning.tuning_key(other, 64, 96, 128, torch.bfloat16, "H200")
    assert k == tuning.tuning_key(epi, 64, 96, 128, torch.bfloat16, "H200")


def test_lookup_computes_the_key_once_per_call_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_name", lambda index: "NVIDIA H200")
    tuning._forget_lookups()
    epi = load_program(SRC).residual_rms
    key = tuning.tuning_key(epi, 64, 96, 128, torch.bfloat16, "NVIDIA H200")
    tuning.TuningCache().put(key, TileConfig(128, 128, 1, 1, True), {})
    calls = []
    real = tuning.tuning_key
    monkeypatch.setattr(tuning, "tuning_key", lambda *a: calls.append(a) or real(*a))
    device = torch.device("cuda", 0)
    for _ in range(5):
        cfg = tuning.lookup(epi, 64, 96, 128, torch.bfloat16, device, {})
    assert cfg == TileConfig(128, 128, 1, 1, True)
    assert len(calls) == 1
    tuning._forget_lookups()


def test_misses_left_untuned_under_a_capture_warn_with_the_fix_on_leaving():
    import coda_agent

    assert coda_agent.autotune is tuning.autotune  # the public name a training script uses
    with pytest.warns(UserWarning, match=r"2 GEMM call\(s\) ran untuned .*\[16, 32, 64\].*force_eager"):
        with tuning.autotune() as record:
            record.untuned += [[16, 32, 64], [16, 64, 32]]  # what gemm notes for a captured miss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tuning.autotune():
            pass


def test_autotune_is_scoped():
    a = torch.ones(2, 2)
    assert not tuning.tunable_now(a, (2, 2, 2))
    with tuning.autotune() as record:
        assert tuning.tunable_now(a, (2, 2, 2)) and record == [] and record.untuned == []
        # a CUDA backward would run on autograd's device threads, outside the scope: not here
        assert not torch._C._is_multithreading_enabled()
    assert not tuning.tunable_now(a, (2, 2, 2)) and torch._C._is_multithreading_enabled()
    with pytest.raises(ValueError, match="a positive number; got 0"):
        with tuning.autotune(steady_s=0):
            pass


def test_steady_tuning_times_each_candidate_back_to_back(tmp_path, monkeypatch):
    """``autotune(steady_s=...)`` times the candidates the way a training step runs them (back
    to back, at the clock the power cap allows), keeps the fastest there, and records the regime
    in the record and the cache.  (The launches are stubbed: the CPU has no tiles to run.)"""
    from coda_agent.primitives.timing import Steady

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_name", lambda index: "NVIDIA H200")
    tuning._forget_lookups()
    epi = load_program(SRC).residual_rms
    launched = []
    monkeypatch.setattr(tuning.cute, "run", lambda e, A, B, ops, buffers, config, **kw: launched.append(config))
    # the steady time of a candidate: the one launched last before it is measured
    fake = {str(c): 1.0 + i for i, c in enumerate(tuning.CANDIDATES)}
    fake[str(tuning.CANDIDATES[3])] = 0.5
    steady_calls = []

    def steady(run, seconds):
        run()
        steady_calls.append(seconds)
        return Steady(fake[str(launched[-1])], 10, (0.0, 1.0))

    monkeypatch.setattr(tuning, "measure_steady", steady)
    monkeypatch.setattr(tuning, "measure_each", lambda *a, **k: pytest.fail("steady tuning times no single calls"))
    A, B = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(128, 96, dtype=torch.bfloat16)
    ops = {"residual": torch.randn(64, 96, dtype=torch.bfloat16), "gamma": torch.randn(96, dtype=torch.bfloat16)}
    with tuning.autotune(steady_s=0.25) as record:
        best, times = tuning.tune(epi, A, B, ops, torch.bfloat16)
    assert best == tuning.CANDIDATES[3] and steady_calls == [0.25] * len(tuning.CANDIDATES)
    assert record[0]["regime"] == "steady 0.25 s" and record[0]["best"] == str(best)
    stored = [json.loads(f.read_text()) for f in tmp_path.glob("tuning/*.json")]
    assert [(x["regime"], x["config"]) for x in stored] == [("steady 0.25 s", best.__dict__)]
    # and what was tuned, readable without the key's hash
    assert {k: stored[0][k] for k in ("epilogue", "MNK", "dtype", "gpu")} == {
        "epilogue": epi.name, "MNK": [64, 96, 128], "dtype": "torch.bfloat16", "gpu": "NVIDIA H200"}
    assert tuning.lookup(epi, 64, 96, 128, torch.bfloat16, torch.device("cuda", 0), ops) == best
    tuning._forget_lookups()


def test_the_wide_pool_adds_clustered_large_tiles_and_the_tuner_uses_it(tmp_path, monkeypatch):
    """``autotune(pool="wide")`` tunes over CANDIDATES and the large clustered tiles, says so in
    the regime, and an unknown pool is refused with the ones there are."""
    assert tuning.candidates_for(None, {}) == list(tuning.CANDIDATES)
    wide = tuning.candidates_for(None, {}, pool="wide")
    assert wide[:len(tuning.CANDIDATES)] == list(tuning.CANDIDATES) and len(wide) > len(tuning.CANDIDATES)
    assert TileConfig(128, 256, 2, 1, False) in wide and TileConfig(256, 128, 1, 2, False) in wide
    with pytest.raises(ValueError, match=r"pool 'huge' does not exist; pick one of \['default', 'wide'\]"):
        with tuning.autotune(pool="huge"):
            pass
    with pytest.raises(ValueError, match="does not exist"):
        tuning.candidates_for(None, {}, pool="huge")
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_name", lambda index: "NVIDIA H200")
    tuning._forget_lookups()
    launched = []
    monkeypatch.setattr(tuning.cute, "run", lambda e, A, B, ops, buffers, config, **kw: launched.append(config))
    last = tuning.WIDE_CANDIDATES[-1]

    def steady(run, seconds):
        run()
        return Steady(0.5 if launched[-1] == last else 1.0, 10, (0.0, 1.0))

    monkeypatch.setattr(tuning, "measure_steady", steady)
    A, B = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(128, 96, dtype=torch.bfloat16)
    with tuning.autotune(steady_s=0.1, pool="wide") as record:
        best, times = tuning.tune(None, A, B, {}, torch.bfloat16)
    assert best == last and len(times) == len(tuning.WIDE_CANDIDATES)
    assert record[0]["regime"] == "steady 0.1 s, wide pool"
    tuning._forget_lookups()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemm_tunes_a_cache_miss_only_inside_autotune(tmp_path, monkeypatch):
    """A miss is tuned once inside autotune() and then served from the cache; a call
    that accumulates into a buffer is never tuned (timing it would keep adding)."""
    from coda_agent.primitives import gemm

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    tuning._forget_lookups()
    A = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    gemm(A, B)
    assert not list(tmp_path.glob("tuning/*.json"))
    with tuning.autotune() as record:
        gemm(A, B, accumulate_into=torch.zeros(512, 384, device="cuda", dtype=torch.bfloat16))
        assert record == []
        gemm(A, B)
        gemm(A, B)
    assert len(record) == 1 and record[0]["MNK"] == [512, 384, 256]
    assert len(list(tmp_path.glob("tuning/*.json"))) == 1
    # back to back, as a training step runs it: another shape, tuned in that regime
    with tuning.autotune(steady_s=0.05) as record:
        gemm(A[:256], B)
    assert len(record) == 1 and record[0]["regime"] == "steady 0.05 s"
    assert all(t > 0 for t in record[0]["times_ms"].values())
    tuning._forget_lookups()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_miss_inside_a_cuda_graph_capture_runs_untuned(tmp_path, monkeypatch):
    """Timing candidates synchronises, which would invalidate a capture (torch.compile's
    reduce-overhead records a backward on its first run): the captured miss runs the untuned
    config, is noted, and the graph replays it correctly."""
    from coda_agent.primitives import gemm

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    tuning._forget_lookups()
    A = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    gemm(A, B)  # compiled before the capture
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.warns(UserWarning, match="force_eager"), tuning.autotune() as record, torch.cuda.stream(side), \
            torch.cuda.graph(graph, stream=side):
        D = gemm(A, B)["D"]
    assert record == [] and record.untuned == [[512, 384, 256]]
    A.copy_(torch.randn_like(A))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(D.float(), A.float() @ B.float(), rtol=2e-2, atol=2e-2)
    assert not list(tmp_path.glob("tuning/*.json"))
    tuning._forget_lookups()


def test_lookup_memo_belongs_to_its_epilogue(tmp_path, monkeypatch):
    """A memo keyed by id() could hand a later program an earlier program's config
    (ids are reused once an object dies); the memo lives on the epilogue instead."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_device_name", lambda index: "NVIDIA H200")
    tuning._forget_lookups()
    device = torch.device("cuda", 0)
    first = load_program(SRC).residual_rms
    key = tuning.tuning_key(first, 64, 96, 128, torch.bfloat16, "NVIDIA H200")
    tuning.TuningCache().put(key, TileConfig(256, 128, 2, 1, False), {})
    assert tuning.lookup(first, 64, 96, 128, torch.bfloat16, device, {}) == TileConfig(256, 128, 2, 1, False)
    del first
    other = load_program(SRC.replace("h * h", "h * h * 2.0")).residual_rms
    assert tuning.lookup(other, 64, 96, 128, torch.bfloat16, device, {}) is None
    tuning._forget_lookups()


def test_default_config_rules():
    """The untuned heuristic, rule by rule (each rule's H200 evidence is in
    default_config's docstring)."""
    from coda_agent.primitives.catalogue import sample_epilogues
    from coda_agent.primitives.tile_config import default_config

    samples = sample_epilogues()
    prog = load_program(SRC + '''
@epilogue(pairs="acc")
def rot(acc, cs: Tile):
    e, o = unpack(acc)
    return {"D": pack(e * cs, o * cs)}
''')
    assert default_config(None, {}) == TileConfig(128, 192, 2, 1, True)
    assert default_config(prog.residual_rms, {}, n=4096) == TileConfig(128, 192, 2, 1, True)
    assert default_config(samples["paired"][0], {}, n=8192) == TileConfig(128, 128, 1, 2, True)
    assert default_config(samples["partials"][0], {}, n=4096).tile_n == 128  # partial layout is contract
    assert default_config(prog.rot, {}, n=128).tile_n == 128
    assert default_config(prog.rot, {}, n=64).tile_n == 64
    assert default_config(prog.rot, {}, n=4096).tile_n == 192
    # reductions in both directions (a column total and a row total in one epilogue) run 128x128
    assert default_config(samples["both"][0], {}, n=16384, m=16384) == TileConfig(128, 128, 2, 1, True)
    # a tile pass (no mainloop) runs its epilogue on both warpgroups of a cooperative tile, whatever
    # it folds; exposed partials keep their 128-wide contract there too
    pass_cfg = TileConfig(256, 128, 2, 1, False)
    for epi in (samples["pass"][0], samples["both"][0], prog.residual_rms):
        assert default_config(epi, {}, n=16384, m=16384, tile_pass=True) == pass_cfg
    assert default_config(samples["partials"][0], {}, n=4096, tile_pass=True) == TileConfig(128, 128, 1, 1, True)


def test_a_tile_pass_launches_with_the_pass_tile():
    """What tile_pass records in the launch ledger is the pass rule's tile, and a GEMM with the
    same epilogue kinds keeps its own."""
    from coda_agent.primitives import Tile, epilogue, gemm, launch_ledger, lowering, row_sum, tile_pass
    from coda_agent.primitives.tile_config import default_config

    @epilogue(reductions={"db": row_sum()})
    def dbias(dy: Tile):
        return {"D": dy, "db": dy}

    @epilogue(reductions={"db": row_sum()})
    def dbias_gemm(acc, dy: Tile):
        return {"D": acc + dy, "db": acc}

    dy = torch.randn(300, 200).bfloat16()
    with lowering("reference"), launch_ledger() as ledger:
        out = tile_pass(dbias, dy=dy)
        gemm(torch.randn(300, 64).bfloat16(), torch.randn(64, 200).bfloat16(), dbias_gemm, dy=dy)
    torch.testing.assert_close(out["db"], dy.float().sum(0), rtol=1e-5, atol=1e-4)
    gemm_tile = str(default_config(dbias_gemm, {}, n=200, m=300))
    assert gemm_tile != "256x128 c2x1 cooperative"
    assert [(e.kind, e.config) for e in ledger] == [("pass", "256x128 c2x1 cooperative"), ("gemm", gemm_tile)]


def test_default_config_fills_the_sms_when_output_tiles_are_few():
    from coda_agent.primitives.tile_config import TileConfig, _wave_cost, default_config

    # dx of a 1024-row LM-head chunk at LLaMA-3 1B: 88 wide tiles leave 44 of 132 SMs idle.
    assert _wave_cost(1024, 2048, 128, 192, 132) == 128 * 192
    assert default_config(None, {}, n=2048, m=1024) == TileConfig(128, 128, 2, 1, True)
    assert default_config(None, {}, n=4096, m=1024).tile_n == 128
    # Many waves: quantization is noise, the wide tile's throughput wins.
    assert default_config(None, {}, n=2048, m=16384).tile_n == 192
    assert default_config(None, {}, n=8192, m=16384).tile_n == 192
    # A GPU with fewer SMs changes the answer: 88 tiles fill 88 SMs exactly.
    assert default_config(None, {}, n=2048, m=1024, sms=88).tile_n == 192


def test_default_config_gives_a_padded_plain_n_the_256_cooperative_tile():
    """N = 1024 (a K/V projection): 6 tiles of 192 pad it by 12.5%, 4 of 256 by
    nothing.  Only for plain GEMMs, only where the padding is large, and only
    where the 256 tiles still fill the SMs."""
    from coda_agent.primitives.tile_config import default_config

    coop = TileConfig(128, 256, 1, 1, False)
    assert default_config(None, {}, n=1024, m=16384) == coop
    assert default_config(None, {}, n=512, m=16384) == coop
    assert default_config(None, {}, n=1024) == coop  # no M given: N decides alone
    assert default_config(None, {}, n=2048, m=16384).tile_n == 192  # 192 pads 3%
    assert default_config(None, {}, n=16384, m=2048).tile_n == 192
    assert default_config(None, {}, n=1024, m=1024) == TileConfig(128, 128, 2, 1, True)  # 32 tiles, 132 SMs
    prog = load_program(SRC)
    assert default_config(prog.residual_rms, {}, n=1024, m=16384).pingpong  # an epilogue stays pingpong


TUNE_DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")])]


@pytest.mark.parametrize("device", TUNE_DEVICES)
def test_the_readmes_tuning_step_tunes_a_patched_model(device, tmp_path, monkeypatch):
    """README.md's tuning snippet, run as written on a patched tiny LLaMA: on the GPU the step's
    GEMMs are tuned and cached, none left untuned, and a second run finds them all cached; on the
    CPU (reference lowering) it runs the step and tunes nothing."""
    pytest.importorskip("transformers")
    import re
    from pathlib import Path

    import coda_agent
    from test_llama import tiny_llama

    block = re.search(r"```python\n(with coda_agent\.autotune.*?)```", (Path(__file__).parents[1] / "README.md")
                      .read_text(), re.S)
    assert block, "README.md lost its tuning snippet"
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    tuning._forget_lookups()
    model = coda_agent.apply_to_llama(tiny_llama().bfloat16().to(device))
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    stored = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="autotune:")  # a GEMM left untuned
            exec(block.group(1), {"coda_agent": coda_agent, "torch": torch, "model": model, "ids": ids})
        assert all(p.grad is None for p in model.parameters())
        stored.append(sorted(json.loads(f.read_text())["created"] + f.name for f in tmp_path.glob("tuning/*.json")))
    if device == "cuda":
        entries = [json.loads(f.read_text()) for f in tmp_path.glob("tuning/*.json")]
        assert entries and all(e["gpu"] and len(e["MNK"]) == 3 and e["epilogue"] for e in entries)
        assert stored[1] == stored[0]  # the second step tuned nothing: every GEMM was cached
    else:
        assert stored == [[], []]
    tuning._forget_lookups()
