"""One verifier (the reference stage) checking one program N times: python3 check.py SUITE/TASK PROGRAM N."""
import sys, time
from coda_agent.tasks.spec import load_task
from coda_agent.verifier import Verifier
task = load_task(f"tasks/{sys.argv[1]}.yaml")  # run from the repository root
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
res = []
with Verifier(stages=["reference"], cache=False, timeout_s=300) as v:
    for i in range(n):
        t = time.time()
        r = v.check(task, open(sys.argv[2]).read())
        res.append(r.outcome)
        print(i, r.outcome, round(time.time()-t), [(s.name, s.status, s.message[:600]) for s in r.stages if s.status != "passed"], flush=True)
print("SUMMARY", sys.argv[1], sys.argv[2], res.count("cpu_passed"), "/", n)
