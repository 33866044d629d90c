# Source on the H200 device machine (no pip install there: no build backend offline).
# Makes the checkout importable as `coda_agent` and loads the staged wheels.
# Usage: source scripts/gpu-env.sh   (after ../shared/gpu/stage.sh installed /tmp/coda-gpu)
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p /tmp/coda-pkg && ln -sfn "$_root" /tmp/coda-pkg/coda_agent
source /tmp/coda-gpu/env.sh
# Only the package's parent goes on the path, not the checkout: the checkout's own folders
# (kernels/, tasks/) would shadow a user's packages of those names (the README's exported
# kernels/coda_geglu.py: a regular package later on the path beats a namespace folder in cwd).
export PYTHONPATH="/tmp/coda-pkg${PYTHONPATH:+:$PYTHONPATH}"
coda-agent() { python3 -m coda_agent.cli "$@"; }
