"""Batch evaluation, reports, human review and export of kernels.

Layer map (each concept in the module named after it):

- ``pool.py``: :class:`VerifierPool`, a ``Verifier`` whose ``check`` runs on
  a thread per visible GPU (its judges pinned to that GPU) plus CPU threads
  for the CPU stages, over the verifier's own process isolation.
  ``ray_pool.py``: the same phases as Ray tasks past one host (``--ray``,
  the optional ``[ray]`` extra).
- ``batch.py``: the batch directory ``runs/batch-<utc>/``, one agent run
  directory per (task, sample), made atomically.
- ``runner.py``: ``coda-agent eval``'s engine: a thread per trajectory
  (``agent.loop.solve``), the live progress display, resume.
- ``summary.py``: per-task results and suite metrics (pass@k, fast_p against
  the plain GEMM and torch.compile, geomean speedup, tokens, cost), always
  rebuilt from the run directories; ``summary.json`` and ``summary.md``.
- ``html.py``: ``report.html``, the summary with inline SVG plots, offline.
- ``review.py``: listing, showing and approving/rejecting kernels (``review.json``).
- ``export.py``: an approved kernel as a module with a ``torch.autograd.Function``.
- ``cli.py``: the ``eval``, ``report``, ``review`` and ``export`` commands.

Why this shape: the agent already owns trajectories, budgets, logging and
resume, and the verifier owns judging and its isolation (a sandboxed runner
behind a judge process per check); eval only schedules them (threads for the
I/O-bound LLM calls, a thread per GPU for verification, Ray tasks across
hosts) and reads back what the run directories say.

Tests: ``tests/test_eval*.py`` (the CLI end to end against the scripted
OpenAI server, kill and resume, the pool with a crashing verification, a
local Ray cluster, review, export's gradients, and the HTML page in headless
Chromium).
"""
