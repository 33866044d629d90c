#!/usr/bin/env bash
# The main job on its embedded default: solve a suite task with the built-in
# expert author (no model endpoint). CPU stages here; every stage on a GPU.
# Usage: bash scripts/demo.sh [TASK.yaml] [more solve flags]
source "$(dirname "$0")/setup.sh"
task="${1:-tasks/llama3/swiglu_fwd.yaml}"
shift || true
exec coda-agent solve "$task" --author expert "$@"
