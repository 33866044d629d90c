"""coda-agent: LLM-written GEMM-epilogue programs, verified on Hopper.

The package is the repository's top level (see pyproject's ``package-dir``):

- ``coda_agent.primitives``: the epilogue catalogue (five CODA families) and its
  two lowerings, CuTeDSL/quack on Hopper and a PyTorch reference interpreter.
- ``coda_agent.tasks``: task specs (YAML + pydantic), PyTorch references and the
  human-written expert programs of the LLaMA-3 suite.
- ``coda_agent.verifier``: the staged judge that turns a program into a Report.
- ``coda_agent.agent``: the LLM loop, model clients, budgets, run directories.
- ``coda_agent.kernels``: accepted programs as PyTorch ops (``Kernel``,
  ``load_kernel``) and the Hugging Face drop-ins ``coda_agent.apply_to_llama``,
  ``coda_agent.apply_to_gpt2`` and ``coda_agent.apply_to_gpt_neox`` (whole layers), and
  ``coda_agent.apply_to_model`` (the MLPs and LM head of any other model).
- ``coda_agent.eval``: batch evaluation, reports, review and export.
- ``coda_agent.cli``: the ``coda-agent`` command.
- two leaf modules any folder may use (they import nothing from the package):
  ``coda_agent.errors`` (the user-facing error family and the CLI's one error
  handler) and ``coda_agent.program_rules`` (the rules of a program, which the
  catalogue text renders and the static stage enforces).

Importing the package imports nothing else: ``apply_to_llama``,
``apply_to_gpt2``, ``apply_to_gpt_neox`` and ``apply_to_model`` load the kernels (and transformers) on first use, and
``coda_agent.autotune`` (tile tuning for a patched model's GEMMs) the catalogue.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202
    if name == "apply_to_llama":
        from .kernels.llama import apply_to_llama

        return apply_to_llama
    if name == "apply_to_gpt2":
        from .kernels.gpt2 import apply_to_gpt2

        return apply_to_gpt2
    if name == "apply_to_gpt_neox":
        from .kernels.gpt_neox import apply_to_gpt_neox

        return apply_to_gpt_neox
    if name == "apply_to_model":
        from .kernels.modules import apply_to_model

        return apply_to_model
    if name == "autotune":
        from .primitives.tuning import autotune

        return autotune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
