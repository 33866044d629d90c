"""The reference stage's draws of the Apertus family, judged one at a time (session 19): how often
the program's results fail the judge's comparison, and on which result, draw and params.

    python3 bench/results/cpu-2026-12-07-margins-families/apertus_draws.py SEED COUNT
    DRAWS=seed,outliers,scaled python3 ... SEED COUNT

Each draw picks a set (small, ragged), a draw kind, the judge's varied params and magnitude, as a
check draws them, with one CPU thread as the judge runs."""
import os
import random
import sys
from pathlib import Path

import torch

from coda_agent.kernels import contract
from coda_agent.primitives import lowering
from coda_agent.primitives.program import load_program
from coda_agent.tasks.spec import load_task
from coda_agent.verifier.calls import draw_case, verdict
from coda_agent.verifier.inputs import drawn_magnitude, drawn_params

torch.set_num_threads(1)
TASK = Path(__file__).resolve().parents[3] / "tests" / "tasks" / "families" / "apertus" / "xielu_mlp.yaml"
task = load_task(TASK)
spec = task.spec
mod = load_program(TASK.with_name("xielu_mlp_program.py").read_text(), name="apertus")
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
kinds = os.environ.get("DRAWS", "scaled,scaled,outliers,seed,edge").split(",")
fails = 0
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 20):
    shape_set, draw = rng.choice(["small", "ragged"]), rng.choice(kinds)
    u, varied = drawn_magnitude(rng), drawn_params(spec, rng)
    case = draw_case(task, spec, shape_set, rng.getrandbits(62), "cpu", draw, varied=varied, magnitude=u)
    with lowering("reference"):
        got = contract.run(mod, case.inputs, case.params, case.grads, spec.outputs, spec.gradients)
    mismatches = verdict(spec, case, got)
    if mismatches:
        fails += 1
        print(shape_set, draw, f"u={u:.2f}", {k: f"{v:.3g}" for k, v in case.params.items()},
              "alpha_p", case.inputs["alpha_p"].item(), "alpha_n", case.inputs["alpha_n"].item())
        for m in mismatches:
            print("   ", m.tensor, m.pattern[:80], m.max_abs_err, m.allowed, m.rel_norm_err)
print("fails", fails)
