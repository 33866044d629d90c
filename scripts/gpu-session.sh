#!/usr/bin/env bash
# One device call's worth of recorded GPU work, run on the H200 after
# `source scripts/gpu-env.sh`.  Each argument is PART:SECONDS; the parts run in
# the order given, each under its own time limit (a part that overruns is
# stopped and the next one starts), and everything they write lands in
# $OUT/results.tgz (one file back, whatever happened), ready to unpack into
# bench/results/h200-<date>-<name>/.  Parts:
#   tier            the GPU test tier (pytest -m gpu) but the suite-wide verification; tier=I/N:
#                   the I-th of N shares of its test files (the whole tier outgrew one call)
#   verify-SUITE    `coda-agent eval tasks/SUITE --author expert`: every expert (verify-SUITE=A,B:
#                   those of tasks A and B) through the whole verifier on every shape set
#                   (the batch dir comes back; a batch left unfinished under
#                   /tmp/coda-runs/SUITE is resumed, whatever it was started with)
#   warm            cold and warm verification of the block experts (CODA_GPU_RESULTS)
#   check           CHECK_TASKS="SUITE/NAME ..." experts verified side by side with
#                   `coda-agent verify`, beside CHECK_PYTEST (a -k of the GPU tier)
#   tests           the GPU tests GPU_TESTS names (pytest arguments: files, node ids, -k), alone
#   passes          bench/passes.py (PASSES_ARGS: its experiments, by default bandwidth)
#   train           bench/train_step.py (the budget is the part's seconds less 20; TRAIN_ARGS);
#                   train=LABEL: another run in the same call (train-LABEL/, TRAIN_ARGS_LABEL)
#   bench-SUITE     bench/run.py --suite SUITE (BENCH_TASKS / BENCH_SETS narrow it)
#   fp8             bench/fp8.py (FP8_ARGS, e.g. --casts);   fp8loss   bench/fp8_loss.py
#   energy          bench/gemm_energy.py (ENERGY_ARGS, e.g. --shapes gate_up,down): the step's plain
#                   GEMMs back to back, quack's tiles against cuBLAS, with clock and power
# Usage: bash scripts/gpu-session.sh tier:150 verify-llama3:380
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:?set OUT to the folder that comes back}"
res="$out/r"
mkdir -p "$res"
cd "$root"
export PYTHONUNBUFFERED=1 CODA_CACHE_DIR="${CODA_CACHE_DIR:-/tmp/coda-cache}"

{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  python3 -c "import coda_agent.versions as v, json; print(json.dumps(v.environment((*v.KERNEL_LIBRARIES, \"triton\", \"liger-kernel\", \"torchao\", \"transformers\"))))"; } >"$res/machine.txt" 2>&1

part() {  # NAME SECONDS COMMAND...: run COMMAND under the limit, log to $res/NAME.log
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${secs}s): $*"
    timeout --signal=INT --kill-after=15 "$secs" "$@" >"$res/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc wall=$((SECONDS - t0))s" | tee -a "$res/parts.txt"
    tail -n 4 "$res/$name.log"
}

for item in "$@"; do
    name=${item%%:*} secs=${item##*:}
    case $name in
        tier|tier=*)
            shard=${name#tier} shard=${shard#=}
            files=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v "tests/test_suite_gpu.py" | sort)
            if [ -n "$shard" ]; then
                files=$(echo "$files" | awk -v i="${shard%/*}" -v n="${shard#*/}" '(NR - 1) % n == i - 1')
            fi
            echo "tier${shard:+ $shard}: $(echo $files)" >>"$res/parts.txt"
            part "tier${shard:+-${shard%/*}of${shard#*/}}" "$secs" python3 -m pytest -m gpu -q -p no:cacheprovider \
                -rfE --durations=25 -k "not every_config and not test_expert_on_gpu" $files ;;
        verify-*)  # the batch lives outside $OUT, so the next call on a warm machine resumes it
            spec=${name#verify-} suite=${name#verify-} only=
            suite=${suite%%=*}
            [ "$spec" != "$suite" ] && only=${spec#*=}
            runs=/tmp/coda-runs/$suite
            batch=$(ls -d "$runs"/batch-* 2>/dev/null | tail -n 1)
            if [ -n "$batch" ]; then
                part "verify-$suite" "$secs" python3 -m coda_agent.cli eval --resume "$batch" --workers 8
            else
                part "verify-$suite" "$secs" python3 -m coda_agent.cli eval "tasks/$suite" --author expert \
                    --workers 8 --runs-dir "$runs" ${only:+--only "$only"}
            fi
            [ -d "$runs" ] && cp -r "$runs" "$res/runs-$suite" ;;
        warm)
            mkdir -p "$res/warm"
            CODA_GPU_RESULTS="$res/warm" part warm "$secs" python3 -m pytest -q -p no:cacheprovider -rfE \
                tests/test_suite_gpu.py -k "${WARM_TASKS:-llama3/llama3_block or llama3/mlp_block}" ;;
        check)
            mkdir -p "$res/check"
            part check "$secs" bash scripts/gpu-check.sh "$res/check" ;;
        tests)
            part tests "$secs" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 \
                ${GPU_TESTS:?set GPU_TESTS to the tests to run} ;;
        passes)
            part passes "$secs" python3 bench/passes.py "$res/passes.json" ${PASSES_ARGS:-bandwidth} ;;
        train|train=*)  # train=LABEL: its own folder, train-LABEL, and arguments, TRAIN_ARGS_LABEL
            label=${name#train} label=${label#=} args_var=TRAIN_ARGS${label:+_$label}
            part "train${label:+-$label}" "$secs" python3 bench/train_step.py --out "$res/train${label:+-$label}" \
                --budget-s $((secs - 20)) ${!args_var:-} ;;
        bench-*)
            suite=${name#bench-}
            part "$name" "$secs" python3 bench/run.py --suite "$suite" --out "$res/bench-$suite" \
                ${BENCH_TASKS:+--tasks "$BENCH_TASKS"} ${BENCH_SETS:+--sets "$BENCH_SETS"} ${BENCH_ARGS:-} ;;
        fp8)
            part fp8 "$secs" python3 bench/fp8.py "$res/fp8" --budget-s $((secs - 60)) ${FP8_ARGS:-} ;;
        energy)
            part energy "$secs" python3 bench/gemm_energy.py "$res/energy.json" ${ENERGY_ARGS:-} ;;
        fp8loss)
            part fp8loss "$secs" python3 bench/fp8_loss.py "$res/fp8-loss" --budget-s $((secs - 20)) ;;
        *)
            echo "unknown part: $name" | tee -a "$res/parts.txt" ;;
    esac
done

# Run dirs hold compiled artifacts and caches that need not come back.
find "$res" -name "*.cubin" -o -name "*.so" -o -name "*.o" | xargs -r rm -f
tar -C "$out" -czf "$out/results.tgz" r && rm -rf "$res"
ls -la "$out"
