"""The cheat of tests/bad_programs/extreme/centring_cancels.py and the gpt2/ln_qkv expert at each
centre distance 2**f of the scaled draw (argv: f values): judged margins over 8 draws."""
import random, statistics, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository
sys.path.insert(0, str(ROOT / "bench"))
import torch
from margins import margin
from coda_agent.verifier import inputs as I
from coda_agent.tasks.spec import load_task
from coda_agent.kernels.contract import run
from coda_agent.primitives import load_program, lowering
from coda_agent.verifier.calls import draw_case
task = load_task(ROOT / "tasks/gpt2/ln_qkv.yaml")
progs = {"cheat": load_program((ROOT / "tests/bad_programs/extreme/centring_cancels.py").read_text(), "c"),
         "expert": load_program(task.expert_path.read_text(), "e")}
rng = random.Random(5)
for f in [float(a) for a in sys.argv[1:]]:
    I.FARTHER = (f, f)
    res = {k: [] for k in progs}
    rel = []
    for i in range(8):
        u = I.drawn_magnitude(rng)
        case = draw_case(task, task.spec, "small", rng.randrange(1 << 31), "cpu", "scaled", magnitude=u)
        for k, p in progs.items():
            with lowering("reference"):
                got = run(p, case.inputs, case.params, case.grads, task.spec.outputs, task.spec.gradients)
            ms = {n: margin(n, "small", got[n], case.hi[n], case.lo[n], task.spec.tolerance_for(n), 8.0)[0] for n in ("qkv", "dx")}
            res[k].append(ms)
            if k == "cheat": print(f"  u={u:.2f} qkv margin {ms['qkv']:.3f}", flush=True)
        h, l = case.hi["qkv"].double(), case.lo["qkv"].double()
        rel.append(float((l - h).norm() / h.norm()))
    for k in progs:
        for n in ("qkv", "dx"):
            xs = [m[n] for m in res[k]]
            print(f"f={f} {k} {n}: min {min(xs):.3f} median {statistics.median(xs):.3f} max {max(xs):.3f}")
    print(f"f={f} lo-ref rel err median {statistics.median(rel):.2e}", flush=True)
