"""What the catalogue itself costs the host per program call, on any machine.

A program over small shapes, or one with many thin launches, is host-bound in
eager mode: the GPU idles while Python enqueues the next kernel (run 9 on the
H200: rope_bwd's kernels took 0.27 ms, a call 0.99 ms of host time).  The
host's part of a launch is the catalogue's (checks, buffers, the tile config,
the dispatch to a lowering) and quack's (its plan cache and the launch).  This
measures the catalogue's part without a GPU: each expert's call, forward and
backward, runs through the cute lowering with quack's launch (and those of the
pass kernel and of the cross-entropy gradient's Triton kernel) replaced by a no-op and the tensors on
the CPU presented as CUDA tensors to the checks that ask. The aux kernels
compute for real on the CPU at the task's ``small`` shapes (a few microseconds
each). Medians of ``--rounds`` rounds of ``--calls`` calls, after a warm-up.

Usage: ``python3 bench/host_path.py [--suite llama3] [--tasks a,b] [--out OUT.json]``.
On the H200 the whole host time of a call is what ``enqueue_ms`` reports in
bench/run.py and the verifier's performance details (``host_ms``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from coda_agent.kernels.contract import run
from coda_agent.primitives import launch_ledger, load_program, lowering
from coda_agent.storage import write_atomic
from coda_agent.tasks import load_suite, suite_dir
from coda_agent.verifier.inputs import make_grads, make_inputs

_gemm = importlib.import_module("coda_agent.primitives.gemm")
_cute = importlib.import_module("coda_agent.primitives.cute")
_xent_triton = importlib.import_module("coda_agent.primitives.xent_triton")
_pass_kernel = importlib.import_module("coda_agent.primitives.pass_kernel")


def host_ms(task: Any, rounds: int = 7, calls: int = 50) -> dict[str, Any]:
    """Median host ms of one call of the task's expert, and its launches."""
    spec = task.spec
    prog = load_program(task.expert_path.read_text(), task.name)
    inputs = make_inputs(spec, "small", seed=1, device="cpu")
    grads = make_grads(spec, "small", seed=2, device="cpu") if spec.has_backward else None

    def call() -> Any:
        return run(prog, inputs, spec.params_at("small"), grads, spec.outputs, spec.gradients)

    with mock.patch.object(torch.Tensor, "is_cuda", property(lambda t: True)), \
            mock.patch.object(_gemm, "_sm_count", lambda A: 132), \
            mock.patch.object(_cute, "run", lambda *args, **kwargs: None), \
            mock.patch.object(_pass_kernel, "run", lambda *args, **kwargs: None), \
            mock.patch.object(_xent_triton, "xent_grad_triton", lambda *args, **kwargs: None), lowering("cute"):
        with launch_ledger() as ledger:
            call()
        for _ in range(10):
            call()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - t0) / calls * 1e3)
    return {"task": task.name, "launches": len(ledger), "host_ms": round(statistics.median(times), 4),
            "host_ms_min_max": [round(min(times), 4), round(max(times), 4)]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="llama3", help="a packaged suite (llama3, gpt2) or a folder of task YAMLs")
    ap.add_argument("--tasks", help="comma-separated task names (default: every task with an expert)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    folder = suite_dir(args.suite)
    tasks = [t for t in load_suite(folder) if t.expert_path is not None]
    if args.tasks:
        names = args.tasks.split(",")
        unknown = sorted(set(names) - {t.name for t in tasks})
        if unknown:
            ap.error(f"--tasks: no expert task {', '.join(unknown)} in {folder}")
        tasks = [t for t in tasks if t.name in names]
    torch.set_num_threads(1)
    rows = []
    for task in tasks:
        rows.append(host_ms(task, args.rounds, args.calls))
        print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:
        write_atomic(args.out, json.dumps({"suite": args.suite, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
