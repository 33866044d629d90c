import random, sys, torch
sys.path.insert(0, "/work")
from coda_agent.tasks import load_suite
from pathlib import Path
from coda_agent.primitives import load_program, lowering
from coda_agent.kernels.contract import run
from coda_agent.verifier.calls import draw_case, judged_by
from coda_agent.verifier.inputs import drawn_params, reference_takes
from coda_agent.verifier.compare import compare
sys.path.insert(0, "/work/main/bench")
from margins import margin
torch.set_num_threads(2)
task = [t for t in load_suite(Path("/work/main/tasks/llama3_fp8")) if t.name == "mlp_block_fp8"][0]
spec = task.spec.model_copy(update={"shapes": {**task.spec.shapes, "probe": {"T": 1504, "H": 688, "I": 1504}}})
task.spec = spec
prog = load_program(task.expert_path.read_text(), task.name)
rng = random.Random(int(sys.argv[1]))
for i in range(int(sys.argv[2])):
    varied = drawn_params(spec, rng, lambda p: reference_takes(task, spec, p))
    case = draw_case(task, spec, "probe", rng.randrange(1 << 31), "cpu", "edge", varied=varied)
    with lowering("reference"):
        got = run(prog, case.inputs, case.params, case.grads, spec.outputs, spec.gradients)
    for name in ["dw_gu", "dw_down", "dh", "dgamma", "y"]:
        rule = judged_by(spec, name, "edge")
        a, r = margin(name, "probe", got[name], case.hi[name], case.lo[name], rule[0], 8.0, rows=rule[1])
        err = (got[name].double() - case.hi[name]).abs()
        lerr = (case.lo[name].double() - case.hi[name]).abs()
        idx = divmod(int(err.argmax()), err.shape[-1]) if err.ndim == 2 else int(err.argmax())
        lidx = divmod(int(lerr.argmax()), lerr.shape[-1]) if lerr.ndim == 2 else int(lerr.argmax())
        print(i, name, f"margin {a:.2f} {r} eps {case.params['eps']:.2g} prog worst {idx} {float(err.max()):.3g}"
              f" lo worst {lidx} {float(lerr.max()):.3g}", flush=True)
        if name == "dw_gu" and err.ndim == 2:
            # error by band of rows: last 64 rows (ragged tile) vs the rest
            print("   rowband max err: last64", float(err[-64:].max()), "rest", float(err[:-64].max()),
                  "| lo last64", float(lerr[-64:].max()), "rest", float(lerr[:-64].max()),
                  "| even cols", float(err[:, 0::2].max()), "odd", float(err[:, 1::2].max()), flush=True)
