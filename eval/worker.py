"""A verification worker process: ``python -m coda_agent.eval.worker MODULE:FACTORY STAGE_SPLIT OPTIONS``.

Reads one JSON job per line on stdin (``task_path``, ``source``, ``phase``)
and answers each with one line on stdout: the Report as JSON.  ``phase`` is
``all`` (the whole check: a machine without CUDA) or ``cpu`` / ``gpu``, whose
stages STAGE_SPLIT (JSON) lists; the verifier for a phase is
``factory(stages=..., **OPTIONS)`` (OPTIONS: JSON keyword arguments, e.g. the
shape sets of ``--sets``).  Anything the verifier prints goes to stderr: stdout
carries only the protocol.  The process lives as long as its pool
(:mod:`.pool`); if it dies, the pool restarts it and retries the job.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def main(target: str, stage_split: dict[str, list[str]], options: dict) -> int:
    # The protocol gets its own copy of stdout; fd 1 now points at stderr so that stray
    # prints (a verifier, a compiler) cannot corrupt a reply.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from coda_agent.tasks.spec import load_task

    module, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    verifiers = {}
    proto.write("ready\n")  # the pool sends jobs only after this
    proto.flush()
    for line in sys.stdin:
        job = json.loads(line)
        phase = job["phase"]
        if phase not in verifiers:
            stages = {} if phase == "all" else {"stages": stage_split[phase]}
            verifiers[phase] = factory(**stages, **options)
        report = verifiers[phase].check(load_task(job["task_path"]), job["source"])
        proto.write(report.model_dump_json() + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])))
