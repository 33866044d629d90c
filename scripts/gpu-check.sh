#!/usr/bin/env bash
# gpu-session.sh's `check` part: OUT_DIR gets one report per program of $CHECK_TASKS
# ("SUITE/NAME ..." for a suite's expert, "TASK.yaml=PROGRAM.py" for any task and program; each
# through `coda-agent verify` on every shape set) and the log of the GPU tests $CHECK_PYTEST selects (a pytest -k expression), all started at once: the
# CPU stages run side by side and the judges' GPU lock orders the GPU stages
# (verifier/gpu_lock.py), so what finishes within the part's limit comes back.
# CHECK_ARGS: more `coda-agent verify` flags (e.g. --sets, --stages).
set -u
out=$1
pids=()
for t in ${CHECK_TASKS:-}; do
    if [[ $t == *.yaml=* ]]; then  # TASK.yaml=PROGRAM.py: a task outside the suites, with its program
        task=${t%%=*} program=${t#*=} label=$(basename "$(dirname "$task")")-$(basename "$task" .yaml)
    else
        suite=${t%%/*} name=${t#*/}
        task=tasks/$suite/$name.yaml program=tasks/$suite/experts/$name.py label=$suite-$name
    fi
    python3 -m coda_agent.cli verify "$task" "$program" --json \
        --runs-dir "$out/runs" ${CHECK_ARGS:-} >"$out/$label.json" 2>"$out/$label.log" &
    pids+=($!)
done
if [ -n "${CHECK_PYTEST:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -k "$CHECK_PYTEST" >"$out/pytest.log" 2>&1 &
    pids+=($!)
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
