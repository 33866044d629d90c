"""The agent: an LLM writes an epilogue program, the verifier judges it, the report goes back.

Layer map (each concept in the module named after it):

- ``protocols.py``: the seams, ``Model.complete(messages) -> Reply`` and
  ``Verifier.check(task, program_source) -> Report``, and the error types
  (``ModelError``, a ``CodaError`` for the user; ``FormatError``/``LimitsExceeded``
  for control flow).
- ``models.py``: authors: any OpenAI-compatible endpoint, ``expert``, ``replay``.
- ``config.py``: one pydantic config, merged from file, environment and flags; prices.
- ``prompt.py`` + ``templates/``: what the model reads; extracting the program back.
- ``loop.py``: the trajectory loop, budgets and stop reasons, parallel samples.
- ``rundir.py``: the run directory layout, atomic writes, resume; ``verdict.py``:
  ``coda-agent verify``'s verdict in the same layout.
- ``display.py``: each turn as it happens, on a terminal or in a log.
- ``cli.py``: ``coda-agent solve``.

Tests: ``tests/test_agent_*.py`` drive the real ``openai`` client against a
scripted local server (``tests/openai_server.py``) and judge programs with a
small rule-based verifier (``tests/agent_fixtures.py``); nothing in the loop is mocked.
"""

from .config import AgentConfig, Budget, LLMConfig, load_config
from .loop import Trajectory, TrajectoryResult, TurnEvent, solve
from .models import ExpertModel, OpenAIModel, ReplayModel, make_model
from .protocols import CodaError, FormatError, LimitsExceeded, Model, ModelError, Reply, Usage, Verifier
from .rundir import RunDir, TrajectoryDir

__all__ = ["AgentConfig", "Budget", "CodaError", "ExpertModel", "FormatError", "LLMConfig", "LimitsExceeded",
           "Model", "ModelError", "OpenAIModel", "Reply", "ReplayModel", "RunDir", "Trajectory",
           "TrajectoryDir", "TrajectoryResult", "TurnEvent", "Usage", "Verifier", "load_config", "make_model", "solve"]
