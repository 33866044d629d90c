#!/usr/bin/env bash
# Session 18's device calls after staging.  PERF=1: the performance stage's new defences and an expert
# through it (results-perf.tgz); then the families FAMS names on the GPU (correctness and launch audit,
# as test_other_families' GPU test runs them; results.tgz).
set -u
source scripts/gpu-env.sh
F=tests/tasks/families
if [ "${PERF:-0}" = 1 ]; then
    GPU_TESTS="tests/test_verifier_gpu.py tests/test_verifier_corpus.py tests/test_primitives_gpu.py -k(test_verifier_gpu)or(memo_by_content)or(slows_the_baselines)or(subnormals_and_nan)" \
    CHECK_TASKS="llama3/mlp_block" bash scripts/gpu-session.sh tests:150 check:200
    mv "$OUT/results.tgz" "$OUT/results-perf.tgz"
fi
fam=""
for t in $FAMS; do
    fam="$fam $F/$t.yaml=$F/${t}_program.py"
done
CHECK_JOBS=4 CHECK_ARGS="--stages static,reference,compile,correctness,launch_audit" CHECK_TASKS="$fam" \
    bash scripts/gpu-session.sh check:${FAM_S:-170}
