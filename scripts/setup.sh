# Sourced by the README's commands: a venv in .venv with the pinned stack,
# created once (a second run only checks it, in about a second).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stamp_src="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.coda-stamp 2>/dev/null)" != "$stamp_src" ]; then
  echo "setting up .venv (first run: about a minute) ..." >&2
  python3 -m venv .venv
  log=.venv/setup.log
  {
    .venv/bin/python -m pip install --upgrade pip
    # CPU torch first, so the pinned quack/cutlass do not pull a multi-GB CUDA build.
    .venv/bin/python -m pip install "torch==2.13.0"
    .venv/bin/python -m pip install -e ".[test]"
    # The [ray] extra: tests/test_eval_ray.py runs `eval --ray auto` on a local cluster.
    .venv/bin/python -m pip install -e ".[ray]"
  } > "$log" 2>&1 || { tail -40 "$log" >&2; echo "setup failed; full log: $log" >&2; exit 1; }
  .venv/bin/python -c "import coda_agent.primitives" >/dev/null
  echo "$stamp_src" > .venv/.coda-stamp
fi
export PATH="$root/.venv/bin:$PATH"
