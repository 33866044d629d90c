#!/usr/bin/env bash
# gpu-session.sh's `check` part: OUT_DIR gets one report per program of $CHECK_TASKS
# ("SUITE/NAME ..." for a suite's expert, "TASK.yaml=PROGRAM.py" for any task and program; each
# through `coda-agent verify` on every shape set) and the log of the GPU tests $CHECK_PYTEST
# selects (a pytest -k expression).  The verifies run at most $CHECK_JOBS at a time (default 3), in
# the order given: their CPU stages run side by side and the judges' GPU lock orders the GPU stages
# (verifier/gpu_lock.py), so what finishes within the part's limit comes back (eight at once, each
# at a model's width, all ran out of a 220 s part together: BENCHMARKS run 23).
# CHECK_ARGS: more `coda-agent verify` flags (e.g. --sets, --stages).
set -u
out=$1
max=${CHECK_JOBS:-3}
rc=0
running=0
if [ -n "${CHECK_PYTEST:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -k "$CHECK_PYTEST" >"$out/pytest.log" 2>&1 &
    running=1 max=$((max + 1))
fi
for t in ${CHECK_TASKS:-}; do
    if [[ $t == *.yaml=* ]]; then  # TASK.yaml=PROGRAM.py: a task outside the suites, with its program
        task=${t%%=*} program=${t#*=} label=$(basename "$(dirname "$task")")-$(basename "$task" .yaml)
    else
        suite=${t%%/*} name=${t#*/}
        task=tasks/$suite/$name.yaml program=tasks/$suite/experts/$name.py label=$suite-$name
    fi
    if [ "$running" -ge "$max" ]; then
        wait -n || rc=1
        running=$((running - 1))
    fi
    python3 -m coda_agent.cli verify "$task" "$program" --json \
        --runs-dir "$out/runs" ${CHECK_ARGS:-} >"$out/$label.json" 2>"$out/$label.log" &
    running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
    wait -n || rc=1
    running=$((running - 1))
done
exit $rc
