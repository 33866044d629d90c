import sys, glob
sys.path.insert(0, "tests")
from pathlib import Path
from suite_checks import load_expert, run_program
from coda_agent.primitives import lowering
from coda_agent.tasks import SUITES, load_suite, suite_dir
from coda_agent.tasks.spec import load_task
from coda_agent.verifier.calls import draw_case, verdict
part, parts, seeds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
items = [(t, None) for s in ("llama3", "gpt2") for t in load_suite(suite_dir(s))] + [(t, None) for t in load_suite("tasks/llama3_fp8")]
items += [(load_task(p), Path(p).with_name(Path(p).stem + "_program.py").read_text()) for p in sorted(glob.glob("tests/tasks/families/*/*.yaml"))]
bad = 0
for i, (t, src) in enumerate(items):
    if i % parts != part:
        continue
    mod = load_expert(t, src)
    for s in [s for s in ("small", "ragged") if s in t.spec.shapes]:
        for seed in range(seeds):
            case = draw_case(t, t.spec, s, 4242 + 977 * seed, "cpu", "edge")
            with lowering("reference"):
                got = run_program(t, mod, {k: v.clone() for k, v in case.inputs.items()}, case.grads)
            ms = verdict(t.spec, case, {k: got[k] for k in case.hi})
            if ms:
                bad += 1
                print("FAIL", t.spec.name, s, seed, [(m.tensor, m.pattern[:120]) for m in ms], flush=True)
    print("ok", t.spec.name, flush=True)
print("failures", bad)
