"""bench/train_step.py's plumbing on CPU (``--dry-run``: tiny config, reference
lowering, "compiled" contenders through AOTAutograd); the H200 run measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "train_step.py"
sys.path.insert(0, str(SCRIPT.parent))

import loss_curve  # noqa: E402
import step_profile  # noqa: E402
import train_models  # noqa: E402
import train_step  # noqa: E402


def test_dry_run_writes_every_row_the_curve_and_its_plot(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs", "1b",
                           "--contenders", "coda,coda_fp8,compile_torchao_fp8,curve", "--steps", "1", "--warmup",
                           "0", "--curve-steps", "4", "--band-seeds", "2", "--tune-steady", "0.1",
                           "--tune-pool", "wide", "--plain-gemms", "cublas",
                           "--compile-mode", "reduce-overhead"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "train_step.json").read_text())
    # torchao's float8 GEMMs need CUDA: the dry run has the two CODA rows
    assert [r["contender"] for r in result["rows"]] == ["coda", "coda_fp8"], result["rows"]
    assert all("error" not in r for r in result["rows"]), result["rows"]
    row = result["rows"][0]
    assert row["config"] == "1b"
    assert row["ms"] > 0 and row["tokens_per_s"] > 0 and set(row["split_ms"]) >= {"gemm", "attention", "other"}
    assert row["cap_ms"] == pytest.approx(row["ms"] - row["split_ms"]["other"], abs=0.02)
    # where the step went: the catalogue's launches by name (the CPU runs no device kernels)
    launches = row["where"]["coda_launches"]
    assert {"coda::gemm::norm_rope", "coda::aux::rms_prepare", "coda::pass::row_dot"} <= set(launches), launches
    assert launches["coda::aux::rms_prepare"]["calls"] == 2 * 2  # two layers, two norms each
    assert row["tuned"] == []  # asked for, but the reference lowering has no tiles to tune
    assert row["plain_gemms"] == "cublas" and row["xent_mib"] is None  # the CPU runs the reference either way
    # CUDA graphs are a device's: on the CPU the compiled rows record the mode and capture nothing
    assert row["compile_mode"] == "reduce-overhead" and row["cudagraph_skips"] is None
    assert result["curve"] == "loss_curve.json" and (tmp_path / "loss_curve.png").stat().st_size > 1000
    curve = json.loads((tmp_path / "loss_curve.json").read_text())
    assert curve["errors"] == {}
    assert set(curve["curves"]) == {"eager_fp32/0", "eager_bf16/0", "coda_bf16/0", "torchao_rowwise/0",
                                    "coda_fp8/0", "torchao_rowwise/1", "coda_fp8/1"}
    assert all(len(v) == 4 for v in curve["curves"].values())
    # CODA trains like eager in bf16: its gap to fp32 is of the order of bf16 eager's own.
    gaps = curve["mean_abs_gap_to_fp32"]
    assert gaps["coda_bf16/0"] <= 3 * gaps["eager_bf16/0"] + 0.02
    # the fp8 rows: torchao's two seeds make the band, and each CODA fp8 seed is placed against it
    assert curve["torchao_rowwise_band"][0] <= curve["torchao_rowwise_band"][1]
    assert set(curve["fp8_verdict_vs_band"]) == {"coda_fp8/0", "coda_fp8/1"}
    assert set(curve["fp8_verdict_vs_band"].values()) <= {"within", "better", "worse"}


def test_fp32_master_weights_step_every_family_under_autocast(tmp_path):
    """``--master-weights fp32``: the models and AdamW in fp32, each step under bf16 autocast; the
    patched models run it (as their bf16 copies) beside torch.compile's, in all three families."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs",
                           "1b,gpt2-xl,pythia-1.4b", "--contenders", "compile,coda", "--steps", "1", "--warmup", "0",
                           "--master-weights", "fp32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "train_step.json").read_text())["rows"]
    assert len(rows) == 6 and all("error" not in r and r["master_weights"] == "fp32" for r in rows), rows
    assert all(r["ms"] > 0 for r in rows)


def test_a_lora_fine_tune_step_of_every_family(tmp_path):
    """``--lora 8``: a peft LoRA fine-tune of each family (the base frozen), compiled and patched,
    LLaMA's fp8 MLP blocks too; a contender outside eager, compile and CODA is refused with the
    list."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs",
                           "1b,gpt2-xl,pythia-1.4b", "--contenders", "compile,coda,coda_fp8,liger", "--steps", "1",
                           "--warmup", "0", "--lora", "8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "train_step.json").read_text())
    rows = [r for r in result["rows"] if "error" not in r]
    assert len(rows) == 7 and all(r["lora_rank"] == 8 and r["ms"] > 0 for r in rows), result
    assert {(r["config"], r["contender"]) for r in rows} >= {("1b", "coda_fp8")}
    skipped = {s["run"]: s["why"] for s in result["skipped"]}
    assert skipped["1b:liger"] == "--lora runs eager, compile, coda, coda_eager, coda_fp8"


def test_a_spent_budget_skips_and_says_so(tmp_path, bench_main):
    """The driver itself, in this process (it starts no measurement: the budget is spent)."""
    assert bench_main("train_step", "--dry-run", "--out", tmp_path, "--budget-s", "5") == 0
    result = json.loads((tmp_path / "train_step.json").read_text())
    assert result["rows"] == [] and {s["run"] for s in result["skipped"]} >= {"1b:eager", "8b:coda", "curve"}
    assert all("budget of 5.0 s spent" in s["why"] for s in result["skipped"])


def test_kernel_classes():
    assert step_profile.classify("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert step_profile.classify("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert step_profile.classify("kernel_cutlass_kernel_quackgemm_sm90GemmSm90_object_at__tensor") == "gemm"
    assert step_profile.classify("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"
    assert step_profile.classify("kernel_cutlass_kernel_coda_agentprimitivespass_kernel_dslPassKernel_object_at_") == "other"
    assert step_profile.classify("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "other"


def test_the_step_split_counts_each_kernel_once_and_no_range():
    """A catalogue range on the device timeline (a user annotation) and a kernel the profiler
    reports twice count nothing extra: what remains is each kernel once."""
    from torch.autograd.profiler_util import FunctionEvent

    cuda = torch.autograd.DeviceType.CUDA

    def event(i, name, start, end, device=cuda, annotation=False):
        return FunctionEvent(i, name, 0, start, end, device_type=device, is_user_annotation=annotation)

    events = [event(0, "coda::gemm:swiglu", 0, 100, torch.autograd.DeviceType.CPU),
              event(1, "coda::gemm:swiglu", 10, 90, annotation=True),
              event(2, "kernel_cutlass_kernel_quackgemm_sm90", 10, 50),
              event(3, "kernel_cutlass_kernel_quackgemm_sm90", 10, 50),
              event(4, "triton_poi_fused_add_0", 60, 70),
              event(5, "coda::aux:quantize_rows", 70, 90)]
    kept = step_profile.device_kernels(events)
    assert [(e.name, e.time_range.elapsed_us()) for e in kept] == [
        ("kernel_cutlass_kernel_quackgemm_sm90", 40), ("triton_poi_fused_add_0", 10)]


def test_the_curves_data_is_fixed_text():
    a = loss_curve.byte_batches(2, 16, 3, "cpu")
    assert a.shape == (3, 2, 16) and a.equal(loss_curve.byte_batches(2, 16, 3, "cpu"))
    assert 0 <= int(a.min()) and int(a.max()) < 256  # bytes: any config's vocabulary holds them
    text = bytes(a.flatten().tolist()).decode("utf-8", errors="replace")
    assert sum(ch.isascii() for ch in text) > 0.9 * len(text)  # Python source, not noise


@pytest.mark.parametrize("config", ["tiny", "gpt2-tiny"])
def test_compiled_contenders_reach_sdpa_without_a_mask(monkeypatch, config):
    """Under torch.compile, transformers' "sdpa" passes an explicit causal mask (which rules
    out the flash kernel); the benchmark's attention passes none and asks for is_causal,
    with the same logits, in both families."""
    import torch
    import torch.nn.functional as F

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    model, _, _ = train_models.build(config, "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    eager = model(input_ids=ids).logits
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    compiled = torch.compile(model, backend="aot_eager")(input_ids=ids).logits
    assert seen and all(s == (True, True) for s in seen), seen
    torch.testing.assert_close(compiled, eager)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(train_models, "register_causal_sdpa", lambda: "sdpa")
    masked = train_models.build(config, "cpu", torch.float32)[0]  # the same seed: the same weights
    assert masked.config._attn_implementation == "sdpa"
    torch.testing.assert_close(masked(input_ids=ids).logits, eager)


def test_idle_gaps_are_what_no_kernel_covers():
    """Overlapping kernels (two streams) cover each other; the idle time is the gaps between the
    covered spans, and the longest gaps name the kernels around them."""
    kernels = [(0, 100, "a"), (50, 300, "b"), (400, 500, "c"), (505, 600, "d"), (1600, 1700, "e")]
    idle = step_profile.idle_gaps(kernels, top=1)
    assert idle["ms"] == 1.105 and idle["gaps"] == 2 and idle["ms_in_gaps"] == 1.1
    assert idle["longest"] == [{"us": 1000.0, "after": "d", "before": "e"}]
    assert step_profile.idle_gaps([])["ms"] == 0.0


# --------------------------------------------------------------------------- GPT-2 and GPT-NeoX


GPT2_REFUSED = {"liger", "compile_liger", "coda_fp8", "compile_torchao_fp8"}
FLAGS = {"layer_norm": True, "mlp": True, "fused_linear_cross_entropy": True}


def _stack(model):
    return getattr(model, "transformer", None) or model.gpt_neox


@pytest.mark.parametrize("config, widths, tokens, gelu", [
    ("gpt2-xl", (1600, 6400, 25, 6), 16384, "tanh"), ("gpt2-7b", (4096, 16384, 32, 2), 16384, "tanh"),
    ("pythia-1.4b", (2048, 8192, 16, 6), 16384, "exact"), ("pythia-6.9b", (4096, 16384, 32, 2), 16384, "exact")])
def test_the_layernorm_configs_build_and_coda_patches_them(config, widths, tokens, gelu):
    """Each GPT-2 and GPT-NeoX config builds its widths (on the meta device: no memory, no init)
    as a model its drop-in takes: the CODA contender patches it, with the MLP kernel of the model's
    GELU, and the compile contender leaves it HF's."""
    from transformers import GPT2LMHeadModel, GPTNeoXForCausalLM

    with torch.device("meta"):
        model, batch, seq = train_models.build(config, "meta", torch.bfloat16)
    cfg = model.config
    assert batch * seq == tokens and seq <= cfg.max_position_embeddings and cfg._attn_implementation == "sdpa_causal"
    assert (cfg.hidden_size, cfg.intermediate_size if config.startswith("pythia") else cfg.n_inner,
            cfg.num_attention_heads, cfg.num_hidden_layers, cfg.vocab_size) == (*widths, 50304)
    if config.startswith("gpt2"):
        assert type(model) is GPT2LMHeadModel and (cfg.activation_function, cfg.resid_pdrop) == ("gelu_new", 0.0)
        assert model.lm_head.weight is model.transformer.wte.weight
    else:  # Pythia's layer: the parallel residual, RoPE on a quarter of each head, an untied head
        assert type(model) is GPTNeoXForCausalLM and cfg.use_parallel_residual and cfg.hidden_dropout == 0.0
        assert model.gpt_neox.rotary_emb.inv_freq.shape[0] * 2 == cfg.hidden_size // cfg.num_attention_heads // 4
        assert model.lm_head.weight is not model.gpt_neox.embed_in.weight
    compiled = train_step.prepare(model, config, "compile", "cpu")
    assert not hasattr(_stack(compiled._orig_mod), "coda_flags")
    with torch.device("meta"):
        model = train_models.build(config, "meta", torch.bfloat16)[0]
    patched = train_step.prepare(model, config, "coda", "cpu")
    assert _stack(patched._orig_mod).coda_flags == {**FLAGS, "gelu": gelu}
    refused = GPT2_REFUSED  # the same four on both families, each for its own reason
    for contender in train_step.CONTENDERS:
        assert (train_models.refusal(config, contender) is None) == (contender not in refused), contender
        assert train_models.refusal("8b", contender) is None


@pytest.mark.parametrize("config, patch", [("gpt2-tiny", "apply_to_gpt2"), ("pythia-tiny", "apply_to_gpt_neox")])
def test_prepare_refuses_liger_and_fp8_by_name(config, patch):
    """A Liger row on GPT-2 or GPT-NeoX would time HF's model under Liger's name: prepare stops instead."""
    model, _, _ = train_models.build(config, "cpu", torch.bfloat16)
    with pytest.raises(SystemExit, match=f"compile_liger does not run at {config}: Liger has no GPT-"):
        train_step.prepare(model, config, "compile_liger", "cpu")
    with pytest.raises(SystemExit, match=f"{patch} has no fp8 MLP"):
        train_step.prepare(model, config, "coda_fp8", "cpu")
    assert not hasattr(_stack(model), "coda_flags")


@pytest.mark.parametrize("config, mlp_launch, fp8_why", [("gpt2-7b", "ln_fc_gelu", "Conv1D"),
                                                         ("pythia-6.9b", "ln_fc_gelu", "no CODA fp8 row")])
def test_the_dry_run_times_each_contender_and_says_what_it_refuses(tmp_path, config, mlp_launch, fp8_why):
    """One step of each contender at the family's tiny config, as the H200 runs them; the
    contenders the family cannot run are skipped with the reason, on the CPU too (where Liger's rows
    would otherwise drop out as CUDA-only without a word)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs", config,
                           "--contenders", ",".join(train_step.CONTENDERS), "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "train_step.json").read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert list(rows) == ["compile", "coda", "eager", "coda_eager"], result["rows"]
    assert all("error" not in r and r["config"] == config and r["ms"] > 0 for r in rows.values()), rows
    assert rows["compile"]["graph_breaks"] == 0 and rows["coda"]["graph_breaks"] == 0
    # the GPT-2 suite's kernels ran, once a layer (two layers), in both CODA rows and in no other
    for name in ("coda", "coda_eager"):
        launches = rows[name]["where"]["coda_launches"]
        assert launches[f"coda::gemm::{mlp_launch}"]["calls"] == 2 and launches["coda::gemm::ln_rank1"]["calls"] == 2
        assert launches["coda::gemm::logits_lse"]["calls"] >= 1, launches
    assert rows["compile"]["where"]["coda_launches"] == rows["eager"]["where"]["coda_launches"] == {}
    skipped = {s["run"]: s["why"] for s in result["skipped"]}
    assert set(skipped) == {f"{config}:{k}" for k in GPT2_REFUSED}, skipped
    assert "Liger has no GPT-" in skipped[f"{config}:compile_liger"]
    assert fp8_why in skipped[f"{config}:compile_torchao_fp8"]


def test_an_unknown_config_is_refused_by_name(bench_main, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main("train_step", "--dry-run", "--out", tmp_path, "--configs", "gpt2-xl,gpt2-8b")
    err = capsys.readouterr().err
    assert "--configs: no config gpt2-8b; the step measures 1b, 8b, gpt2-xl, gpt2-7b, pythia-1.4b, pythia-6.9b" in err, err


def test_the_olmo2_configs_train_through_apply_to_model(tmp_path):
    """OLMo-2, whose post-norm layers no drop-in of whole layers takes: its configs build at their
    widths (meta device), and the dry run's CODA rows run its MLPs and LM head as the swiglu_mlp
    and lm_head_xent kernels, compiled with no graph break; its fp8 rows are refused by name and
    Liger's rows (its OLMo-2 patch) need CUDA."""
    for config, widths in (("olmo2-1b", (2048, 8192, 16, 4)), ("olmo2-7b", (4096, 11008, 32, 2))):
        with torch.device("meta"):
            model, batch, seq = train_models.build(config, "meta", torch.bfloat16)
        cfg = model.config
        assert type(model).__name__ == "Olmo2ForCausalLM" and batch * seq == 16384 and cfg.vocab_size == 100352
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_hidden_layers) == widths
    assert train_models.family_of("olmo2-1b").liger == "apply_liger_kernel_to_olmo2"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs", "olmo2-7b",
                           "--contenders", ",".join(train_step.CONTENDERS), "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "train_step.json").read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert list(rows) == ["compile", "coda", "eager", "coda_eager"], result["rows"]
    assert rows["compile"]["graph_breaks"] == 0 and rows["coda"]["graph_breaks"] == 0
    for name in ("coda", "coda_eager"):
        launches = rows[name]["where"]["coda_launches"]
        assert launches["coda::gemm::swiglu"]["calls"] == launches["coda::gemm::dswiglu"]["calls"] == 2
        assert launches["coda::gemm::logits_lse"]["calls"] >= 1, launches
    assert {s["run"] for s in result["skipped"]} == {"olmo2-7b:coda_fp8", "olmo2-7b:compile_torchao_fp8"}
