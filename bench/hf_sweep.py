"""Every transformers causal LM, tiny, through every drop-in, held to the drop-in tests' bar.

``bench/dropin_coverage.py`` asks whether each drop-in patches or refuses a model and sets one bf16
loss beside HF's.  This sweep holds each patched model to ``tests/test_llama.py``'s bar instead:
the training loss, the eval logits and every parameter's gradient (read in HF's layout through the
state dict) against the unpatched model in fp32, within twice HF's own bf16 error plus 1/256 of the
tensor's largest value, and the relative norm error within 1.5x HF's plus 1e-3.  Each model type of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from its config at small widths (2 layers, hidden 64,
vocabulary 256; ``dropin_coverage.build``, with its latent-attention and per-layer-kind retries and
the encoder-decoder families' layer counts below), its norm weights moved off one and its biases
drawn at the weights' scale (so a dropped one shows), its dropouts as the config sets them (every
training forward seeded alike: the kernels draw no random numbers, so a dropout they skip shows).
Then ``apply_to_llama``, ``apply_to_gpt2``, ``apply_to_gpt_neox`` and ``apply_to_model`` each patch a
bf16 copy, retried with a flag a refusal names (``pass swiglu=False``) or a config value it asks
for (``build the model with resid_pdrop=0.0``), and each outcome is one of:

- ``correct``: patched, and loss, logits and gradients within the bar;
- ``WRONG``: patched, and some tensor misses the bar (``worst`` names it and by how much);
- ``crashed``: an exception other than a ``KernelError``, at the patch or in the patched step;
- ``refused``: a ``KernelError`` at the patch (its message kept; ``unclear`` where it names no fix);
- ``nothing``: ``apply_to_model`` found nothing to patch (its refusal says what it looked for).

A model that does not build, or whose unpatched step fails at the small widths, is ``unbuilt`` (why
kept); one past ``--timeout`` seconds (the worker is killed and a fresh one goes on) is ``timeout``.
``--variant`` builds every model with config values that the defaults leave untried (dropout on,
the head tied or untied, biases on, another activation, the MLPs' inputs loud: :func:`variant_config`);
a model type whose config has nothing the variant changes is ``n/a``.

Run it in the background, one model at a time in a worker process on one thread, each row appended
to ``OUT/rows.jsonl`` as it finishes (a rerun goes on from the rows there; ``--redo`` drops them)::

    nice -n 10 python3 bench/hf_sweep.py bench/results/<dir> [--models llama,opt] [--timeout 300] &
    nice -n 10 python3 bench/hf_sweep.py bench/results/<dir>/act=relu6+loud --variant act=relu6+loud &
    python3 bench/hf_sweep.py bench/results/<dir> --report   # table.md and summary.json from the rows
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_sweep_judge import DROP_INS, worker  # noqa: E402

# --------------------------------------------------------------------------- the sweep (the parent)


def done_rows(rows_file: Path) -> dict[str, dict]:
    if not rows_file.exists():
        return {}
    return {r["model_type"]: r for r in map(json.loads, rows_file.read_text().splitlines()) if r}


def sweep(out: Path, models: list[str], timeout: int, build_s: int, log, variant: str = "") -> None:
    """Judge ``models`` in worker processes, each row appended to ``out/rows.jsonl`` as it comes; a
    model past ``timeout`` seconds, or whose worker dies, gets a row saying so and a fresh worker
    takes the rest."""
    rows_file = out / "rows.jsonl"
    todo = list(models)
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, str(out), "--worker", ",".join(todo),
                                 "--build-s", str(build_s), "--variant", variant], stdout=subprocess.PIPE, stderr=log, text=True)
        current, deadline = None, None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if not ready:
                if deadline is not None and time.time() > deadline:
                    proc.kill()
                    proc.wait()
                    _append(rows_file, {"model_type": current, "outcome": "timeout",
                                        "why": f"over {timeout} s (worker killed)"})
                    todo.remove(current)
                    break
                continue
            line = proc.stdout.readline()
            if not line:  # the worker died (out of memory, a crash in native code)
                rc = proc.wait()
                if current is not None:
                    _append(rows_file, {"model_type": current, "outcome": "crashed",
                                        "why": f"the worker died (exit {rc})"})
                    todo.remove(current)
                elif rc != 0:
                    raise SystemExit(f"the worker failed to start (exit {rc}); see the log")
                break
            msg = json.loads(line)
            if "start" in msg:
                current, deadline = msg["start"], time.time() + timeout
                continue
            _append(rows_file, msg)
            todo.remove(msg["model_type"])
            current, deadline = None, None
            print(f"{msg['model_type']}: {msg['outcome']} ({msg.get('seconds', '?')} s)", flush=True)
        if proc.poll() is None:
            proc.wait()


def _append(rows_file: Path, row: dict) -> None:
    with rows_file.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


# --------------------------------------------------------------------------- the report

OUTCOMES = ("correct", "WRONG", "crashed", "refused", "nothing", "unbuilt", "timeout", "n/a")


def cell(outcome: dict[str, Any] | None) -> str:
    if outcome is None:
        return ""
    what = outcome["outcome"]
    given = {**outcome.get("flags", {}), **outcome.get("config", {})}
    if given:
        what += " (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
    if outcome.get("parts"):
        what += ": " + ", ".join(f"{k}" + (f" x{v}" if v is not True else "") for k, v in outcome["parts"].items())
    if outcome.get("worst"):
        what += "; worst " + ", ".join(f"{k} {r}x" for k, r in outcome["worst"][:3])
    if outcome["outcome"] in ("crashed", "refused", "nothing") and outcome.get("message"):
        msg = outcome["message"].replace("|", "/").replace("\n", " ")
        what += ": " + msg[:160] + ("..." if len(msg) > 160 else "")
    return what


def layer_drop_in(row: dict[str, Any]) -> str:
    """The whole-layer drop-ins that patched the model (or crashed on it); refusals of other
    families' models are left out."""
    shown = [f"{d}: {cell(row[d])}" for d in DROP_INS[:3] if d in row and row[d]["outcome"] != "refused"]
    return "; ".join(shown)


def report(out: Path) -> dict[str, Any]:
    rows = sorted(done_rows(out / "rows.jsonl").values(), key=lambda r: r["model_type"])
    counts = {k: sum(r["outcome"] == k for r in rows) for k in OUTCOMES}
    by_drop_in = {d: {k: sum(r.get(d, {}).get("outcome") == k for r in rows) for k in OUTCOMES[:5]}
                  for d in DROP_INS}
    summary = {"models": len(rows), "outcomes": counts, "by_drop_in": by_drop_in,
               "transformers": _version("transformers"), "torch": torch.__version__,
               **{k: sorted(r["model_type"] for r in rows if r["outcome"] == k) for k in ("WRONG", "crashed")},
               "unclear_refusals": sorted(f"{r['model_type']}:{d}" for r in rows for d in DROP_INS
                                          if r.get(d, {}).get("unclear"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# transformers causal LMs through the drop-ins ({len(rows)} model types)", "",
             "Outcomes: " + ", ".join(f"{k} {v}" for k, v in counts.items()), "",
             "| model type | outcome | apply_to_model | whole-layer drop-ins | params | s |", "|---|---|---|---|---|---|"]
    for r in rows:
        why = r.get("why", "")
        lines.append(f"| {r['model_type']} | {r['outcome']} | {cell(r.get('apply_to_model')) or why[:160]} | "
                     f"{layer_drop_in(r)} | {r.get('params', '')} | {r.get('seconds', '')} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return summary


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the results folder (rows.jsonl, table.md, summary.json)")
    parser.add_argument("--models", default="", help="model types, comma-separated; all by default")
    parser.add_argument("--timeout", type=int, default=300, help="seconds a model type may take, all drop-ins")
    parser.add_argument("--build-s", type=int, default=60, help="seconds a model may take to build")
    parser.add_argument("--redo", action="store_true", help="judge the named models again (drop their rows)")
    parser.add_argument("--report", action="store_true", help="only write table.md and summary.json")
    parser.add_argument("--variant", default="", help="config values on top of the small widths: dropout, tied, "
                        "bias, act=NAME, each optionally +loud (variant_config); the defaults by default")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker.split(","), args.build_s, args.variant)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

        wanted = [m for m in args.models.split(",") if m] or sorted(causal_lms)
        unknown = sorted(set(wanted) - set(causal_lms))
        if unknown:
            parser.error(f"not causal LM model types of this transformers: {unknown}")
        rows_file = args.out / "rows.jsonl"
        done = done_rows(rows_file)
        if args.redo:
            keep = [r for m, r in done.items() if m not in wanted]
            rows_file.write_text("".join(json.dumps(r) + "\n" for r in keep))
            done = {r["model_type"]: r for r in keep}
        with (args.out / "sweep.log").open("a") as log:
            sweep(args.out, [m for m in wanted if m not in done], args.timeout, args.build_s, log, args.variant)
    summary = report(args.out)
    print(json.dumps({k: summary[k] for k in ("models", "outcomes", "WRONG", "crashed")}))
    return 1 if summary["WRONG"] or summary["crashed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
