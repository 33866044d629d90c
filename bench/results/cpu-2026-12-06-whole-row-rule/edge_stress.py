"""Every suite expert on edge draws (reference lowering): does the whole-row rule fail any?"""
import sys, time
sys.path.insert(0, "tests")
import torch
from suite_checks import load_expert, run_program
from coda_agent.primitives import lowering
from coda_agent.tasks import SUITES, load_suite
from coda_agent.verifier.calls import draw_case, verdict
from coda_agent.verifier.compare import compare
part, parts = int(sys.argv[1]), int(sys.argv[2])
seeds = int(sys.argv[3])
from coda_agent.tasks import suite_dir
tasks = [t for s in ("llama3", "gpt2", "llama3_fp8") for t in load_suite(suite_dir(s) if s in SUITES else "tasks/" + s)]
bad = 0
for i, t in enumerate(tasks):
    if i % parts != part:
        continue
    t0 = time.time()
    mod = load_expert(t)
    sets = [s for s in ("small", "ragged") if s in t.spec.shapes] + list(t.spec.cpu_shape_sets)
    worst = 0.0
    for s in sets:
        for seed in range(seeds):
            case = draw_case(t, t.spec, s, 31337 + 101 * seed, "cpu", "edge")
            with lowering("reference"):
                got = run_program(t, mod, {k: v.clone() for k, v in case.inputs.items()}, case.grads)
            got = {k: got[k] for k in case.hi}
            ms = verdict(t.spec, case, got)
            if ms:
                bad += 1
                print("FAIL", t.spec.name, s, seed, [(m.tensor, m.pattern[:160]) for m in ms], flush=True)
    print("ok" if not bad else "..", t.spec.name, f"{time.time() - t0:.0f}s", flush=True)
print("failures", bad)
