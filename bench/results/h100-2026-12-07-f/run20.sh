#!/usr/bin/env bash
# Session 20's device calls after staging.  `tests`: the GPU tests sessions 18-19 left unrun and one
# expert through correctness (now with small+odd, small+short) and the launch audit.  `fams`: the
# families FAMS names, four verifies at a time, correctness and launch audit.
set -u
source scripts/gpu-env.sh
F=tests/tasks/families
case ${1:-tests} in
tests)
    GPU_TESTS="tests/test_verifier_gpu.py tests/test_verifier_corpus.py tests/test_primitives_gpu.py -k(test_verifier_gpu)or(memo_by_content)or(slows_the_baselines)or(subnormals_and_nan)or(expm1)" \
    CHECK_TASKS="llama3/swiglu_fwd" CHECK_ARGS="--stages static,reference,compile,correctness,launch_audit" \
        bash scripts/gpu-session.sh tests:${TESTS_S:-330} check:${CHECK_S:-140} ;;
fams)
    fam=""
    for t in ${FAMS:-apertus/xielu_mlp mamba/gated_norm_out minicpm/scaled_head_xent clip/clip_mlp rwkv/channel_mix qwen3_next/gated_o_proj opt/opt_mlp neox/parallel_block}; do
        fam="$fam $F/$t.yaml=$F/${t}_program.py"
    done
    CHECK_JOBS=4 CHECK_ARGS="--stages static,reference,compile,correctness,launch_audit" CHECK_TASKS="$fam" \
        bash scripts/gpu-session.sh check:${FAM_S:-540} ;;
one)  # a single work call: the tests that never ran, then the families side by side
    fam=""
    for t in ${FAMS:-apertus/xielu_mlp mamba/gated_norm_out clip/clip_mlp qwen3_next/gated_o_proj rwkv/channel_mix minicpm/scaled_head_xent}; do
        fam="$fam $F/$t.yaml=$F/${t}_program.py"
    done
    GPU_TESTS="tests/test_verifier_corpus.py tests/test_primitives_gpu.py -k(memo_by_content)or(slows_the_baselines)or(subnormals_and_nan)or(expm1)" \
    CHECK_JOBS=4 CHECK_ARGS="--stages static,reference,compile,correctness,launch_audit" CHECK_TASKS="$fam" \
        bash scripts/gpu-session.sh tests:${TESTS_S:-220} check:${CHECK_S:-280} ;;
esac
