"""coda-agent: LLM-written GEMM-epilogue programs, verified on Hopper.

The package is the repository's top level (see pyproject's ``package-dir``):

- ``coda_agent.primitives``: the epilogue catalogue (five CODA families) and its
  two lowerings, CuTeDSL/quack on Hopper and a PyTorch reference interpreter.
- ``coda_agent.tasks``: task specs (YAML + pydantic), PyTorch references and the
  human-written expert programs of the LLaMA-3 suite.
- ``coda_agent.verifier``: the staged judge that turns a program into a Report.
- ``coda_agent.agent``: the LLM loop, model clients, budgets, run directories.
- ``coda_agent.cli``: the ``coda-agent`` command.
"""

__version__ = "0.1.0"
