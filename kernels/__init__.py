"""The public kernel API: accepted programs as PyTorch ops, and the Hugging Face drop-in.

::

    from coda_agent.kernels import Kernel, load_kernel

    mlp = load_kernel("runs/20261201T120000Z-mlp_block-gpt-4.1")      # an accepted run
    mlp = Kernel.from_files("my_program.py", "tasks/llama3/mlp_block.yaml")
    y = mlp(h, gamma, w_gu, w_down)["y"]          # autograd: y.sum().backward() works
    layer = mlp.module(eps=1e-6)                   # the same as an nn.Module
    mlp.function.apply(h, gamma, w_gu, w_down, 1e-6)   # the autograd.Function itself

    import coda_agent
    coda_agent.apply_to_llama(model)   # a transformers LlamaForCausalLM (or Mistral, Qwen3), patched in place
    coda_agent.apply_to_gpt2(model)    # a transformers GPT2LMHeadModel, patched in place
    coda_agent.apply_to_gpt_neox(model)   # a transformers GPTNeoXForCausalLM (Pythia), patched in place
    coda_agent.apply_to_model(model)   # any other model: its MLPs and LM head, module by module

Layer map:

- ``contract.py``: calling a program by its task's contract, forward and
  backward: the one implementation, which the Kernel, the verifier's runner and
  the benchmarks share (it imports only torch);
- ``kernel.py``: :class:`Kernel` (a program bound to its task, the one place
  that turns the contract into autograd), its ``autograd.Function``,
  :class:`KernelModule`, input checks, the catalogue guard;
- ``source.py``: :func:`load_kernel` from a run directory (and the final-program
  rules ``eval/review.py`` shares);
- ``dropin.py``: what the transformers drop-ins share (the patched forward's
  object, the suite's kernel per slot and the swap of an accepted one, the
  refusals every drop-in makes);
- ``llama.py``: :func:`apply_to_llama`, the transformers drop-in (weight
  re-layout, state-dict hooks, the patched forwards); ``llama_ops.py``: its ops
  that no single task covers (the attention input, the fused cross-entropy);
  which models it takes: ``families.py``;
- ``gpt2.py``: :func:`apply_to_gpt2`, the drop-in for GPT-2 (the GPT-2 suite's
  kernels over transposed views of its Conv1D weights; which models it takes);
- ``gpt_neox.py``: :func:`apply_to_gpt_neox`, the drop-in for GPT-NeoX (Pythia): the same
  kernels over its nn.Linear weights, with its parallel residual and partial RoPE;
- ``modules.py``: :func:`apply_to_model`, for models no drop-in of whole layers takes: the
  modules whose code is a kernel's (gated MLPs of LLaMA's or Phi-3's code; MLPs without a gate,
  ``plain_mlps.py``; the LM head and loss of LLaMA's or Gemma-2's causal LM code), one by one;
- ``like_hf.py``: the bar a patched model's results are held to against HF's own (the drop-in
  tests and ``bench/hf_sweep.py`` share it).

The folder sits above ``tasks`` and below ``verifier`` in the import graph: it
needs the catalogue and task specs only, so everything above may use it.
Nothing here has an import-time side effect, and importing the folder imports
none of its modules: each public name loads its own on first use, so the
runner's ``contract`` costs no catalogue import, and transformers is imported
only by the drop-ins (``llama.py``, ``gpt2.py``, ``gpt_neox.py``, ``modules.py``; the ``hf`` extra).
"""

_LAZY = {"Kernel": "kernel", "KernelError": "kernel", "KernelModule": "kernel", "load_kernel": "source",
         "apply_to_llama": "llama", "apply_to_gpt2": "gpt2", "apply_to_gpt_neox": "gpt_neox",
         "apply_to_model": "modules"}


def __getattr__(name: str):  # noqa: ANN202 - each name loads its module on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Kernel", "KernelError", "KernelModule", "apply_to_gpt2", "apply_to_gpt_neox", "apply_to_llama",
           "apply_to_model", "load_kernel"]
