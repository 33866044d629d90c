"""How many scaled draws (argv[1], small and ragged by turns) the centring_cancels cheat passes
whole (every output, with the second look), at the old and the new centre distances."""
import random, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository
sys.path.insert(0, str(ROOT / "bench"))
from margins import margin
from coda_agent.verifier import inputs as I
from coda_agent.tasks.spec import load_task
from coda_agent.kernels.contract import run
from coda_agent.primitives import load_program, lowering
from coda_agent.verifier.calls import draw_case
from coda_agent.verifier.compare import compare
task = load_task(ROOT / "tasks/gpt2/ln_qkv.yaml")
p = load_program((ROOT / "tests/bad_programs/extreme/centring_cancels.py").read_text(), "c")
rng = random.Random(11)
for rng_f in [(2.0, 6.0), (4.0, 6.0)]:
    I.FARTHER = rng_f
    passed = 0; n = int(sys.argv[1])
    for i in range(n):
        s = "small" if i % 2 else "ragged"
        u = I.drawn_magnitude(rng)
        varied = I.drawn_params(task.spec, rng, lambda q: I.reference_takes(task, task.spec, q))
        case = draw_case(task, task.spec, s, rng.randrange(1 << 31), "cpu", "scaled", varied=varied, magnitude=u)
        with lowering("reference"):
            got = run(p, case.inputs, case.params, case.grads, task.spec.outputs, task.spec.gradients)
        bad = [n_ for n_ in case.hi if case.hi[n_].is_floating_point() and compare(n_, s, got[n_], case.hi[n_], case.lo[n_], task.spec.tolerance_for(n_)) is not None]
        thin = bad and case.noise_of(bad)
        bad = [n_ for n_ in bad if compare(n_, s, got[n_], case.hi[n_], case.lo[n_], task.spec.tolerance_for(n_), noise=thin[n_]) is not None]
        passed += not bad
    print(rng_f, f"scaled draws the cheat passes: {passed}/{n}", flush=True)
