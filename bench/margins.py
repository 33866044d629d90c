"""How far each expert stands from the verifier's accuracy bars, over many fresh draws.

The judge draws fresh inputs for every verification, so an expert that passes
its bars by a thin margin on most draws fails on a rare one: an honest program
rejected, a red CI.  This measures the margin with the judge's own comparison
(:func:`coda_agent.verifier.compare.compare`), not a copy of its rules: for each
output of each draw, the largest factor by which the program's error
``out - ref_hi`` could grow and still pass (bisected between 1 and ``--cap``),
and the rule the grown error breaks first (a program the bars reject gets the factor below 1
that its error would have to shrink by to pass).  A margin under 1.5 is worth a look:
the tolerance's noise model or the expert's rounding.  The judge gives a result
that fails its first look a second one against more samples of the reference's
noise (:mod:`coda_agent.verifier.noise`), so an output whose first-look margin
is under :data:`SECOND_LOOK_BELOW` is also measured against those samples: its
judged margin is the larger of the two (a grown error passes when either look
passes it).

Runs on the CPU with the reference lowering, on the shape sets the reference
stage checks (``small`` and ``ragged``, and with ``--beyond`` the set past them at
sizes drawn as a check draws them, where edge rows meet the tiles' ragged edges at
larger sizes; fresh draws, outlier channels, edge rows and other magnitudes, all but
the first with params varied as the judge varies them)::

    python3 bench/margins.py OUT.json [--suites llama3,gpt2,llama3_fp8] [--tasks A,B] [--draws 20] [--beyond]
    python3 bench/margins.py OUT.json --program BAD.py --tasks SUITE/NAME   # how far a cheat stands
    python3 bench/margins.py OUT.json --program P.py --tasks T.yaml         # a task of one's own, by path

OUT.json gets one row per (task, output): the smallest first-look margin seen,
its shape set and draw, the rule at that margin, the median margin, and the
smallest judged margin.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SETS = ("small", "ragged")
DRAWS = ("seed", "outliers", "edge", "scaled")
SECOND_LOOK_BELOW = 2.0  # first-look margins under this are measured with the second look too


def margin(name: str, shape_set: str, out: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, tol,
           cap: float, steps: int = 12, noise=None, rows: bool = False) -> tuple[float, str]:
    """(the largest growth of ``out``'s error that still passes, the rule that growth breaks);
    (0, rule) when ``out`` fails as it is, (cap, "") when even ``cap`` times passes.  ``noise``:
    judged against more samples of the reference's noise (the second look) instead; ``rows``: the
    whole-row rule too, as the judge applies it to the edge draw's rows."""
    from coda_agent.verifier.compare import compare

    err = out.double() - hi.double()

    def fails(a: float):
        return compare(name, shape_set, (hi.double() + a * err).to(out.dtype), hi, lo, tol, noise=noise,
                       rows=rows)

    if (broken := fails(1.0)) is not None:
        if fails(1.0 / cap) is not None:
            return 0.0, broken.pattern.split(":")[0]
        good, bad = 1.0 / cap, 1.0
    elif (broken := fails(cap)) is None:
        return cap, ""
    else:
        good, bad = 1.0, cap
    for _ in range(steps):
        mid = (good * bad) ** 0.5
        if (m := fails(mid)) is None:
            good = mid
        else:
            bad, broken = mid, m
    return good, broken.pattern.split(":")[0]


def task_margins(task, draws: int, cap: float, rng: random.Random, program: Path | None = None,
                 beyond: bool = False) -> list[dict]:
    from coda_agent.kernels.contract import run
    from coda_agent.primitives import load_program, lowering
    from coda_agent.verifier.calls import draw_case, judged_by
    from coda_agent.verifier.inputs import drawn_magnitude, drawn_params, reference_takes
    from coda_agent.verifier.shape_sets import beyond_set

    prog = load_program((program or task.expert_path).read_text(), task.name)
    seen: dict[str, list[tuple[float, str, str, str]]] = {}
    sets = [s for s in SETS if s in task.spec.shapes] or [task.spec.cpu_shape_set]
    if beyond:  # one drawn size per task, as one check draws it
        name, sizes = beyond_set(task.spec, rng)
        task.spec = task.spec.model_copy(update={"shapes": {**task.spec.shapes, name: sizes}})
        sets.append(name)
    for shape_set in sets:
        for _ in range(draws):
            # as a check draws them: its varied params for every draw but the first, its magnitude
            varied = drawn_params(task.spec, rng, lambda p: reference_takes(task, task.spec, p))
            u = drawn_magnitude(rng)
            for draw in DRAWS:
                case = draw_case(task, task.spec, shape_set, rng.randrange(1 << 31), "cpu", draw,
                                 varied=varied if draw != "seed" else {}, magnitude=u if draw == "scaled" else 0.0)
                with lowering("reference"):
                    got = run(prog, case.inputs, case.params, case.grads, task.spec.outputs,
                              task.spec.gradients)
                rules = {name: judged_by(task.spec, name, draw) for name in case.hi}  # as the judge does
                first = {name: margin(name, shape_set, got[name], hi, case.lo[name], rules[name][0], cap,
                                      rows=rules[name][1]) for name, hi in case.hi.items() if hi.is_floating_point()}
                thin = [name for name, (a, _) in first.items() if a < SECOND_LOOK_BELOW]
                noise = case.noise_of(thin) if thin else {}
                for name, (a, rule) in first.items():
                    judged = a if name not in noise else max(a, margin(
                        name, shape_set, got[name], case.hi[name], case.lo[name], rules[name][0], cap,
                        noise=noise[name], rows=rules[name][1])[0])
                    seen.setdefault(name, []).append((a, rule, shape_set, draw, judged))
    rows = []
    for name, ms in seen.items():
        worst = min(ms)
        rows.append({"task": task.name, "output": name, "min_margin": round(worst[0], 3), "rule": worst[1],
                     "shape_set": worst[2], "draw": worst[3],
                     "median_margin": round(statistics.median(a for a, *_ in ms), 3),
                     "min_judged": round(min(m[4] for m in ms), 3), "samples": len(ms),
                     "judged_by_draw": {d: _spread([m[4] for m in ms if m[3] == d]) for d in DRAWS}})
    return rows


def _spread(xs: list[float]) -> dict[str, float]:
    """min, median and max of one draw kind's judged margins (a cheat passes only where all exceed 1)."""
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} \
        if xs else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--suites", default="llama3,gpt2,llama3_fp8")
    ap.add_argument("--tasks", default="", help="only these task names, comma-separated")
    ap.add_argument("--draws", type=int, default=20, help="fresh draws per shape set (each with edge rows too)")
    ap.add_argument("--cap", type=float, default=8.0, help="the largest growth tried")
    ap.add_argument("--seed", type=int, default=None, help="for a repeatable run (the judge's draws are not)")
    ap.add_argument("--beyond", action="store_true", help="the set past small and ragged too (drawn sizes)")
    ap.add_argument("--program", type=Path, default=None,
                    help="measure this program instead of the experts (with --tasks SUITE/NAME)")
    args = ap.parse_args(argv)
    from coda_agent.tasks import load_suite

    rng = random.Random(args.seed)
    only = {t for t in args.tasks.split(",") if t}
    rows = []
    if args.program is not None:
        from coda_agent.tasks.spec import load_task

        if len(only) != 1 or "/" not in next(iter(only)):
            ap.error("--program measures one task: --tasks SUITE/NAME or --tasks PATH/TO/TASK.yaml")
        name = next(iter(only))
        path = Path(name) if name.endswith(".yaml") else ROOT / "tasks" / f"{name}.yaml"
        rows = task_margins(load_task(path), args.draws, args.cap, rng, args.program, args.beyond)
        only = {""}  # and no suite task besides
    for suite in args.suites.split(","):
        for task in load_suite(ROOT / "tasks" / suite):
            if not only or task.name in only:
                rows += task_margins(task, args.draws, args.cap, rng, beyond=args.beyond)
                print(json.dumps(min((r for r in rows if r["task"] == task.name), key=lambda r: r["min_margin"])),
                      flush=True)
    rows.sort(key=lambda r: r["min_margin"])
    args.out.write_text(json.dumps({"draws": args.draws, "cap": args.cap, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
