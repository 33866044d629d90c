#!/usr/bin/env bash
# The test suite (CPU tier; the GPU tier runs where CUDA is, see BENCHMARKS.md), on two
# pytest-xdist workers (CI has two cores).  Each test module runs whole on one worker
# (--dist loadfile): a module-scoped fixture (a judge, a Ray cluster, a model trained as the
# truth) starts once, and one process compiles every expert (tests/test_expert_compiles.py).
# xdist_group marks would do nothing: pytest 9 ignores the node id pytest-xdist 3.8's
# loadgroup renames.  `-n 0` runs in one process.
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q -n 2 --dist loadfile "$@"
