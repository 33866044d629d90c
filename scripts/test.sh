#!/usr/bin/env bash
# The test suite (CPU tier; the GPU tier runs where CUDA is, see BENCHMARKS.md), on two
# pytest-xdist workers (CI has two cores); tests marked xdist_group share a worker, so a
# group's sm_90a compile is paid once (tests/conftest.py).  `-n 0` runs in one process.
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q -n 2 --dist loadgroup "$@"
