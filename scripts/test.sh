#!/usr/bin/env bash
# The test suite (CPU tier; the GPU tier runs where CUDA is, see BENCHMARKS.md).
source "$(dirname "$0")/setup.sh"
exec python -m pytest -q "$@"
