#!/usr/bin/env bash
# The test suite (CPU tier; the GPU tier runs where CUDA is, see BENCHMARKS.md), on two
# pytest-xdist workers (CI has two cores), each computing on one thread, and so every process
# it starts (OMP_NUM_THREADS: a second intra-op thread per process only oversubscribes the two
# cores, and its OpenMP threads spin while they wait).  Each test module runs whole on one
# worker (--dist loadfile): a module-scoped fixture (a judge, a Ray cluster, a model trained as
# the truth) starts once, and one process compiles every expert (tests/test_expert_compiles.py).
# xdist_group marks would do nothing: pytest-xdist 3.8's loadgroup renames a test's node id
# through an attribute pytest 9 no longer reads.  `-n 0` runs in one process.
source "$(dirname "$0")/setup.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q -n 2 --dist loadfile "$@"
