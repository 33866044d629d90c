import sys, torch
from coda_agent.tasks import SUITE_DIR
from coda_agent.tasks.spec import load_task
from coda_agent.verifier.calls import draw_case
from coda_agent.verifier.compare import compare
task = load_task(SUITE_DIR / "lm_head_xent.yaml")
spec = task.spec
miss = 0
FULL = len(sys.argv) < 3
N = int(sys.argv[1])
for seed in range(N):
    c = draw_case(task, spec, "small", seed * 7919 + 13, "cpu", draw="edge")
    x, w, t, dl = (c.inputs[k] for k in ("x", "w", "target", "dloss"))
    xd, wd = x.double(), w.double()
    lg = (x @ w.t()).float().double()  # program stores logits in bf16... approximate with hi
    lse = torch.logsumexp(lg, 1)
    tl = lg.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
    easy = FULL & ((lse - tl) < 0.6931) & ((lse - tl) > 0.001) & (t >= 0)
    dlm = torch.where(easy, 0.0, dl.double())
    p = torch.softmax(lg, 1)
    oh = torch.zeros_like(p); ok = t >= 0
    oh[ok.nonzero().squeeze(1), t[ok]] = 1
    g = (p - oh) * torch.where(ok, dlm, 0.0).unsqueeze(1)
    dx = (g @ wd).to(torch.bfloat16)
    dw = (g.t() @ xd).to(torch.bfloat16)
    caught = any(compare(n, "small", o, c.hi[n], c.lo[n], spec.tolerance_for(n), rows=True) for n, o in (("dx", dx), ("dw", dw)))
    miss += not caught
    if not caught and FULL:
        pe = p[easy].gather(1, t[easy].unsqueeze(1)).squeeze(1)
        print(seed, "easy rows", int(easy.sum()), "p", [round(float(v), 3) for v in pe], "dl", [f"{float(v):.2e}" for v in dl[easy]], "dlmax", f"{float(dl.abs().max()):.2e}")
print("missed", miss, "of", N)
