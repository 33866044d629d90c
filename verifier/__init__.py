"""The verifier: a program and a task in, one :class:`Report` out.

Stages (each may stop the run): static (AST, in-process) -> reference (CPU,
PyTorch interpreter of the catalogue vs the task's reference) -> compile
(sm_90a, SASS gate) -> correctness, launch audit, performance (Hopper GPU).
Everything after static runs in a child process with a time limit
(:mod:`.harness`, :mod:`.worker`, :mod:`.stages`).  Verdicts are cached on a
fail-closed key (:mod:`.cache`), and so are passed compile-stage results
(:mod:`.compile_cache`); :mod:`.feedback` renders a report for the LLM
and :mod:`.cli` for people.  Tests: tests/test_verifier*.py and the corpus of
bad programs in tests/bad_programs/.
"""

from coda_agent.verifier.harness import Verifier
from coda_agent.verifier.report import GPU_STAGES, STAGES, Mismatch, Report, StageResult

__all__ = ["GPU_STAGES", "STAGES", "Mismatch", "Report", "StageResult", "Verifier"]
