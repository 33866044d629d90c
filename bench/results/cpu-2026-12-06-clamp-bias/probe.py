"""swiglu_clamp_mlp's expert, and copies with dW_down's activation scaled by 1.003 to 1.05,
judged by the verifier's verdict (first and second look) on scaled draws (magnitudes 2^8-2^12)
at the bound one clean-clone CI run drew (limit 0.24652, alpha 2.34189, offset 3.08677).

    python3 bench/results/cpu-2026-12-06-clamp-bias/probe.py > OUT.log
"""
import random

from coda_agent.kernels.contract import run
from coda_agent.primitives import load_program, lowering
from coda_agent.tasks import SUITE_DIR, load_task
from coda_agent.verifier.calls import draw_case, verdict

task = load_task(SUITE_DIR / "swiglu_clamp_mlp.yaml")
source = task.expert_path.read_text()
VARIED = {"limit": 0.24652, "alpha": 2.34189, "offset": 3.08677}


def judged(factor: str, seed: int, magnitude: float) -> list[str]:
    text = source if factor == "1" else source.replace('"act": glu * up}', f'"act": glu * up * {factor}}}')
    prog = load_program(text, "act_times_" + factor.replace(".", "_"))
    case = draw_case(task, task.spec, "small", seed, "cpu", "scaled", varied=VARIED, magnitude=magnitude)
    with lowering("reference"):
        got = run(prog, case.inputs, case.params, case.grads, task.spec.outputs, task.spec.gradients)
    return [f"{m.tensor}: {m.pattern[:80]}" for m in verdict(task.spec, case, got)]


draws = []
for k in range(12):
    rng = random.Random(k)
    magnitude = 8 + 4 * rng.random()
    draws.append((rng.randrange(1 << 31), magnitude))
failed = 0
for seed, magnitude in draws:
    found = judged("1", seed, magnitude)
    failed += bool(found)
    print(f"expert seed={seed} magnitude={magnitude:.3f}: {found or 'passed'}", flush=True)
print(f"expert: {failed} of {len(draws)} draws rejected")
for factor in ("1.003", "1.01", "1.02", "1.03", "1.05"):
    for seed, magnitude in draws[1:4]:
        print(f"act x {factor} seed={seed}: {judged(factor, seed, magnitude) or 'passed'}", flush=True)
