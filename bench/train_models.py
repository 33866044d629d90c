"""The models ``bench/train_step.py`` trains, by family: each config's widths, how a family's
model is built from them (transformers' own classes, from a config, no download) and patched by
CODA's drop-in, and which contenders a family cannot run, with the reason.

The step script times contenders; everything that depends on the architecture lives here, so a
LLaMA config and a GPT-2 config go through the same timing, profile, memory and budget code.

- **llama** (``LlamaForCausalLM``, ``apply_to_llama``): ``1b`` (LLaMA-3.2-1B widths: H 2048, I 8192,
  32/8 heads of 64, V 128256, 4 layers) and ``8b`` (LLaMA-3-8B widths: H 4096, I 14336, 32/8 heads
  of 128, 2 layers), 4 x 4096 tokens a step; ``curve``, ``mini`` and ``tiny`` for the loss curves
  and the dry run.
- **gpt2** (``GPT2LMHeadModel``, ``apply_to_gpt2``): ``gpt2-xl`` (GPT-2 XL widths: H 1600, I 6400,
  25 heads of 64, 6 of its 48 layers) and ``gpt2-7b`` (the GPT-2 suite's 7B-class width: H 4096,
  I 16384, 32 heads of 128, 2 layers), 16 x 1024 tokens a step (GPT-2's context; the suite's
  T = 16384); ``gpt2-tiny`` for the dry run.  The vocabulary is GPT-2's 50257 padded to 50304
  (nanoGPT's multiple of 64: the fused LM head needs a multiple of 8), the head tied to the
  embedding, the MLP's GELU the tanh form (``gelu_new``), no dropout (``resid_pdrop`` must be 0
  for the drop-in; the other two are 0 so that no contender times dropout's RNG kernels, as the
  LLaMA configs have none).

- **gpt_neox** (``GPTNeoXForCausalLM``, ``apply_to_gpt_neox``): ``pythia-1.4b`` (Pythia-1.4B widths:
  H 2048, I 8192, 16 heads of 128, 6 of its 24 layers) and ``pythia-6.9b`` (Pythia-6.9B widths: H
  4096, I 16384, 32 heads of 128, 2 layers), 8 x 2048 tokens a step (Pythia's context); the
  parallel residual, RoPE on a quarter of each head, the exact GELU and the untied head of 50304
  tokens, as Pythia's; ``pythia-tiny`` for the dry run.  pythia-6.9b has gpt2-7b's widths, so
  their rows compare the two block layouts (and the two GELUs) on the same kernels.
- **olmo2** (``Olmo2ForCausalLM``, ``apply_to_model``: no drop-in of whole layers takes OLMo-2's
  post-norm layers, so its SwiGLU MLPs and its LM head and loss run as kernels and the rest stays
  HF's): ``olmo2-1b`` (OLMo-2 1B widths: H 2048, I 8192, 16 heads of 128, V 100352, 4 of its 16
  layers) and ``olmo2-7b`` (OLMo-2 7B widths: H 4096, I 11008, 32 heads of 128, 2 layers), 4 x 4096
  tokens a step, as the LLaMA configs; ``olmo2-tiny`` for the dry run.  Liger patches it too
  (``apply_liger_kernel_to_olmo2``).

Layers: a few of each model's, so a compiled row's first step (inductor compiles every layer it
traces) and the whole run fit the budget.  The counts put most of a step's GEMM work in the layers,
where the fused kernels are: 6 layers of GPT-2 XL hold 70% of the GEMM FLOPs against the LM head's
30%, 2 at the 7B width 66%; the LLaMA configs' layers hold 45-48% (their vocabulary is 2.5x larger).
The 8b and gpt2-7b configs share a width, so their rows compare the two architectures' kernels.

Every config trains through :func:`register_causal_sdpa`'s attention (SDPA's flash kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CAUSAL_SDPA = "sdpa_causal"


@dataclass(frozen=True)
class Family:
    """How a family's configs become a model: ``build`` (``(widths, seq)``: the config's fields but
    family, batch and seq, and the sequence length; returns the causal LM on the CPU in fp32),
    ``patch`` (CODA's drop-in on that model: ``(model, fp8_mlp, kernels)``), ``tiny`` (the config
    the dry run trains instead of any of the family's), ``refused``: the contenders that do not
    run on the family, with the reason, and ``lora_targets``: the projections a LoRA fine-tune
    (``train_step --lora``) adapts, the attention's (the MLP block kernel runs its MLP whole);
    ``liger``: the Liger patch of the family (``liger_kernel.transformers``' function name)."""
    build: Callable[[dict[str, Any], int], Any]
    patch: Callable[[Any, bool, dict[str, Any] | None], None]
    tiny: str
    lora_targets: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)
    liger: str = "apply_liger_kernel_to_llama"


def register_causal_sdpa() -> str:
    """An attention implementation for unpadded causal training: transformers' SDPA
    attention with no mask, so SDPA's ``is_causal`` picks the flash kernel.  Under
    ``torch.compile`` transformers' own "sdpa" materializes the causal mask (it cannot
    prove, while tracing, that no token is padded), and with an explicit mask SDPA runs
    its memory-efficient kernel instead: a 1B step's attention took 34.7 ms compiled
    against 10.8 ms eager (bench/results/h200-2026-12-01/train).  Every contender of this
    benchmark uses it, so they differ only in what the comparison is about.  LLaMA and
    GPT-2 both build their mask through ``create_causal_mask`` and call the attention through
    the registry, so the one implementation serves both."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)
    return CAUSAL_SDPA


def _llama(widths: dict[str, Any], seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**widths, max_position_embeddings=max(seq, 8192), rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation=register_causal_sdpa())
    return LlamaForCausalLM(cfg)


def _patch_llama(model: Any, fp8_mlp: bool, kernels: dict[str, Any] | None) -> None:
    import coda_agent

    coda_agent.apply_to_llama(model, fp8_mlp=fp8_mlp, kernels=kernels)


def _gpt2(widths: dict[str, Any], seq: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    # bos/eos: GPT-2's 50256 lies outside the tiny config's vocabulary, and the step generates nothing.
    cfg = GPT2Config(**widths, n_positions=max(seq, 1024), activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=None,
                     eos_token_id=None, attn_implementation=register_causal_sdpa())
    model = GPT2LMHeadModel(cfg)
    # The loss HF falls back to for a class whose name holds no loss type; naming it skips the
    # fallback's logger call, a graph break that split the compile row's step at its loss.
    model.loss_type = "ForCausalLM"
    return model


def _patch_gpt2(model: Any, fp8_mlp: bool, kernels: dict[str, Any] | None) -> None:
    import coda_agent

    if fp8_mlp:  # train_step refuses the row first (refused); a direct call must not time bf16 as fp8 either
        raise SystemExit("apply_to_gpt2 has no fp8 MLP")
    coda_agent.apply_to_gpt2(model, kernels=kernels)


def _gpt_neox(widths: dict[str, Any], seq: int) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(**widths, max_position_embeddings=max(seq, 2048), hidden_act="gelu",
                        use_parallel_residual=True, partial_rotary_factor=0.25, hidden_dropout=0.0,
                        attention_dropout=0.0, layer_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                        eos_token_id=None, attn_implementation=register_causal_sdpa())
    model = GPTNeoXForCausalLM(cfg)
    model.loss_type = "ForCausalLM"  # as for GPT-2: no logger call (a graph break) at the loss
    return model


def _patch_gpt_neox(model: Any, fp8_mlp: bool, kernels: dict[str, Any] | None) -> None:
    import coda_agent

    if fp8_mlp:
        raise SystemExit("apply_to_gpt_neox has no fp8 MLP")
    coda_agent.apply_to_gpt_neox(model, kernels=kernels)


def _olmo2(widths: dict[str, Any], seq: int) -> Any:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    cfg = Olmo2Config(**widths, max_position_embeddings=max(seq, 4096), rope_theta=500000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                      attn_implementation=register_causal_sdpa())
    return Olmo2ForCausalLM(cfg)


def _patch_olmo2(model: Any, fp8_mlp: bool, kernels: dict[str, Any] | None) -> None:
    import coda_agent

    if fp8_mlp:
        raise SystemExit("apply_to_model has no fp8 MLP")
    coda_agent.apply_to_model(model, kernels=kernels)


_NO_LIGER = ("Liger has no GPT-NeoX patch (its apply_liger_kernel_to_* patch RMSNorm, RoPE and SwiGLU models): "
             "the row would time HF's GPT-NeoX, the {} row again")
_LIGER = ("Liger has no GPT-2 patch (its apply_liger_kernel_to_* patch RMSNorm, RoPE and SwiGLU models; GPT-2 "
          "has LayerNorm, learned positions and a GELU MLP): the row would time HF's GPT-2, the {} row again")
FAMILIES: dict[str, Family] = {
    "llama": Family(_llama, _patch_llama, tiny="tiny", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "gpt2": Family(_gpt2, _patch_gpt2, tiny="gpt2-tiny", lora_targets=("c_attn",), refused={
        "liger": _LIGER.format("eager"),
        "compile_liger": _LIGER.format("compile"),
        "coda_fp8": "apply_to_gpt2 has no fp8 MLP (fp8_mlp is apply_to_llama's)",
        "compile_torchao_fp8": "torchao's float8 training converts nn.Linear modules and GPT-2's projections are "
                               "Conv1D: it would convert none and time the bf16 step under an fp8 name"}),
    "gpt_neox": Family(_gpt_neox, _patch_gpt_neox, tiny="pythia-tiny", lora_targets=("query_key_value", "dense"),
                       refused={
        "liger": _NO_LIGER.format("eager"),
        "compile_liger": _NO_LIGER.format("compile"),
        "coda_fp8": "apply_to_gpt_neox has no fp8 MLP (fp8_mlp is apply_to_llama's)",
        "compile_torchao_fp8": "no CODA fp8 row to set it against (apply_to_gpt_neox has no fp8 MLP); the fp8 "
                               "comparison is the LLaMA configs'"}),
    "olmo2": Family(_olmo2, _patch_olmo2, tiny="olmo2-tiny", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                    liger="apply_liger_kernel_to_olmo2", refused={
        "coda_fp8": "apply_to_model has no fp8 MLP (fp8_mlp is apply_to_llama's)",
        "compile_torchao_fp8": "no CODA fp8 row to set it against (apply_to_model has no fp8 MLP); the fp8 "
                               "comparison is the LLaMA configs'"})}

CONFIGS: dict[str, dict[str, Any]] = {
    "1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, num_hidden_layers=4, batch=4, seq=4096),
    "8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, num_hidden_layers=2, batch=4, seq=4096),
    "curve": dict(family="llama", hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=256, num_hidden_layers=4, batch=8, seq=256),
    "mini": dict(family="llama", hidden_size=128, intermediate_size=384, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=256, num_hidden_layers=2, batch=8,
                 seq=128),  # a CPU's curve
    "tiny": dict(family="llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, num_hidden_layers=2, batch=2, seq=32),
    "gpt2-xl": dict(family="gpt2", n_embd=1600, n_inner=6400, n_head=25, n_layer=6, vocab_size=50304, batch=16,
                    seq=1024),
    "gpt2-7b": dict(family="gpt2", n_embd=4096, n_inner=16384, n_head=32, n_layer=2, vocab_size=50304, batch=16,
                    seq=1024),
    "pythia-1.4b": dict(family="gpt_neox", hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                        num_hidden_layers=6, vocab_size=50304, batch=8, seq=2048),
    "pythia-6.9b": dict(family="gpt_neox", hidden_size=4096, intermediate_size=16384, num_attention_heads=32,
                        num_hidden_layers=2, vocab_size=50304, batch=8, seq=2048),
    "pythia-tiny": dict(family="gpt_neox", hidden_size=128, intermediate_size=512, num_attention_heads=4,
                        num_hidden_layers=2, vocab_size=512, batch=2, seq=32),
    "gpt2-tiny": dict(family="gpt2", n_embd=128, n_inner=512, n_head=4, n_layer=2, vocab_size=512, batch=2, seq=32),
    "olmo2-1b": dict(family="olmo2", hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                     num_key_value_heads=16, vocab_size=100352, num_hidden_layers=4, batch=4, seq=4096),
    "olmo2-7b": dict(family="olmo2", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=100352, num_hidden_layers=2, batch=4, seq=4096),
    "olmo2-tiny": dict(family="olmo2", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=512, num_hidden_layers=2, batch=2, seq=32),
}


def family_of(config: str) -> Family:
    return FAMILIES[CONFIGS[config]["family"]]


def refusal(config: str, contender: str) -> str | None:
    """Why ``contender`` does not run at ``config`` (None: it does)."""
    why = family_of(config).refused.get(contender)
    return f"{contender} does not run at {config}: {why}" if why else None


def build(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, int, int]:
    """(config ``name``'s model on ``device`` in ``dtype``, initialised from ``seed``, batch, seq)."""
    widths = dict(CONFIGS[name])
    family, batch, seq = FAMILIES[widths.pop("family")], widths.pop("batch"), widths.pop("seq")
    torch.manual_seed(seed)
    return family.build(widths, seq).to(device=device, dtype=dtype), batch, seq
