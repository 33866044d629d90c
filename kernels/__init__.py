"""The public kernel API: accepted programs as PyTorch ops, and the Hugging Face drop-in.

::

    from coda_agent.kernels import Kernel, load_kernel

    mlp = load_kernel("runs/20261201T120000Z-mlp_block-gpt-4.1")      # an accepted run
    mlp = Kernel.from_files("my_program.py", "tasks/llama3/mlp_block.yaml")
    y = mlp(h, gamma, w_gu, w_down)["y"]          # autograd: y.sum().backward() works
    layer = mlp.module(eps=1e-6)                   # the same as an nn.Module
    mlp.function.apply(h, gamma, w_gu, w_down, 1e-6)   # the autograd.Function itself

    import coda_agent
    coda_agent.apply_to_llama(model)   # a transformers LlamaForCausalLM, patched in place

Layer map:

- ``kernel.py``: :class:`Kernel` (a program bound to its task, the one place
  that runs a program forward and backward for autograd), its
  ``autograd.Function``, :class:`KernelModule`, input checks, the catalogue guard;
- ``source.py``: :func:`load_kernel` from a run directory (and the final-program
  rules ``eval/review.py`` shares);
- ``llama.py``: :func:`apply_to_llama`, the transformers drop-in (weight
  re-layout, state-dict hooks, the patched forwards); ``llama_ops.py``: its ops
  that no single task covers (the attention input, the fused cross-entropy).

The folder sits above ``tasks`` and below ``verifier`` in the import graph: it
needs the catalogue and task specs only, so everything above may use it.
Nothing here has an import-time side effect; transformers is imported only by
``llama.py`` (the ``hf`` extra).
"""

from .kernel import Kernel, KernelError, KernelModule
from .source import load_kernel


def __getattr__(name: str):  # noqa: ANN202 - the drop-in imports transformers on first use only
    if name == "apply_to_llama":
        from .llama import apply_to_llama

        return apply_to_llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Kernel", "KernelError", "KernelModule", "apply_to_llama", "load_kernel"]
