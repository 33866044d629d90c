"""What the suite tests (test_suite_a.py, test_suite_b.py for LLaMA-3,
test_gpt2_suite.py, test_suite_fp8.py) share: load a task and its expert program,
run a program by the verifier's contract, and judge it with the verifier's own
inputs, references and tolerance check, and its compile stage's SASS gate.

Nothing here re-implements the verifier: inputs come from
``coda_agent.verifier.inputs`` (make_inputs / make_grads, the same seeding the
verifier uses), the references from its ``run_reference`` (fp64-upcast inputs for
ref_hi, the inputs' own dtype for ref_lo) and the verdict from its ``compare``
with the task's tolerance (CODA's rule plus the relative-norm check), the compile
verdict from its ``compile_result``.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch

from coda_agent.kernels import contract
from coda_agent.primitives import CompiledKernel, compile_only, load_program, lowering
from coda_agent.primitives.lowering import padded_lanes
from coda_agent.tasks import SUITES, load_task
from coda_agent.verifier.compare import compare
from coda_agent.verifier.inputs import make_grads, make_inputs, run_reference
from coda_agent.verifier.report import Mismatch, StageResult
from coda_agent.verifier.stages import compile_result


def task(name: str, suite: str = "llama3"):
    """A task of a packaged suite by name."""
    return load_task(SUITES[suite] / f"{name}.yaml")


SHAPE_SETS = ("small", "ragged", "llama3-1b", "llama3-8b", "llama3-70b")


def check_spec(name: str, suite: str = "llama3", shape_sets: tuple[str, ...] = SHAPE_SETS) -> None:
    """The spec loads with its expert, every shape set has positive sizes and
    FLOPs, and the ragged set really is ragged (a size that is not a multiple of
    the 128 or 192 tile)."""
    t = task(name, suite)
    spec = t.spec
    assert spec.name == name
    assert t.expert_path.is_file()
    tensors = [*spec.inputs.values(), *spec.outputs.values()]
    for s in shape_sets:
        assert s in spec.shapes, f"{name}: shape set {s} missing"
        for ts in tensors:
            assert all(d > 0 for d in spec.shape_of(ts, s)), (name, s)
        assert spec.flops(s) > 0
    assert any(v % 128 for v in spec.shapes["ragged"].values()), "ragged must have a non-multiple of 128"
    assert any(d % 128 and d % 192 for ts in tensors for d in spec.shape_of(ts, "ragged"))


def static_violations(name: str, suite: str = "llama3") -> list[str]:
    """What the verifier's static stage says of the task's expert program."""
    from coda_agent.verifier.static import check_source

    t = task(name, suite)
    return [str(v) for v in check_source(t.expert_path.read_text(), t.spec)]


def load_expert(t, source: str | None = None, tag: str | None = None) -> ModuleType:
    """The task's expert program (or ``source``, e.g. a mutant of it) as a module."""
    return load_program(t.expert_path.read_text() if source is None else source,
                        name=tag or f"expert_{t.name}")


def draw(t, shape_set: str, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The verifier's inputs for ``seed`` on the CPU, and its output gradients when the
    task has a backward (else None)."""
    spec = t.spec
    inputs = make_inputs(spec, shape_set, seed)
    grads = make_grads(spec, shape_set, seed) if spec.has_backward else None
    return inputs, grads


def run_program(t, mod: ModuleType, inputs: dict[str, torch.Tensor],
                grads: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The verifier's contract (``kernels/contract.py``): the outputs and ``d<input>``
    gradients in one dict (under whatever lowering the caller has set)."""
    return contract.run(mod, inputs, t.spec.params, grads or None, t.spec.outputs, t.spec.gradients)


def mismatches(t, shape_set: str, got: dict, inputs: dict[str, torch.Tensor],
               grads: dict[str, torch.Tensor] | None) -> list[Mismatch]:
    """The verifier's ``compare`` of every output/gradient in ``got`` against
    run_reference in fp64 (hi) and in the inputs' dtype (lo), with the task's
    tolerance.  ``inputs``/``grads`` are the CPU tensors the program was given."""
    hi = run_reference(t, inputs, grads, torch.float64)
    lo = run_reference(t, inputs, grads, None)
    assert set(got) == set(hi), f"tensors {sorted(got)} vs reference {sorted(hi)}"
    ms = [compare(k, shape_set, got[k].cpu() if isinstance(got[k], torch.Tensor) else got[k],
                  hi[k], lo[k], t.spec.tolerance) for k in hi]
    return [m for m in ms if m is not None]


def describe(m: Mismatch) -> str:
    return (f"{m.tensor} [{m.shape_set}]: {m.pattern}; max abs err {m.max_abs_err:.3g} "
            f"(allowed {m.allowed:.3g}) at {m.worst_index}"
            + ("" if m.rel_norm_err is None else f", rel norm {m.rel_norm_err:.3g}"))


def problems(t, shape_set: str, seed: int, source: str | None = None, *,
             lowering_name: str = "reference", device: str = "cpu", padded: bool = False) -> list[str]:
    """Run the expert (or ``source``) on the verifier's inputs for (shape_set, seed)
    under ``lowering_name`` and say what is wrong: inputs modified in place, and each
    tensor that fails the verifier's compare.  Empty list: it passes.

    ``device`` other than cpu: the inputs are drawn on the CPU and copied there; the
    references stay fp64/lo on the CPU, as the verifier's reference stage does.
    ``padded``: the reference lowering folds padded lanes as the kernel does
    (``padded_lanes``): a program whose reductions depend on them fails here."""
    inputs, grads = draw(t, shape_set, seed)
    dev_in = {k: v.to(device) for k, v in inputs.items()}
    dev_grads = {k: v.to(device) for k, v in grads.items()} if grads else None
    copies = {k: v.clone() for k, v in dev_in.items()}
    with lowering(lowering_name), padded_lanes() if padded else contextlib.nullcontext():
        mod = load_expert(t, source, tag=f"{'expert' if source is None else 'candidate'}_{t.name}")
        got = run_program(t, mod, dev_in, dev_grads)
        if device != "cpu":
            torch.cuda.synchronize()
    out = [f"modified input {k} in place" for k, v in copies.items() if not torch.equal(v, dev_in[k])]
    out += [describe(m) for m in mismatches(t, shape_set, got, inputs, grads)]
    return out


def mutant_problems(t, old: str, new: str, shape_set: str, seed: int) -> list[str]:
    """:func:`problems` of the expert with one slip: every ``old`` (it must be there) made ``new``."""
    src = t.expert_path.read_text()
    assert old in src, old
    return problems(t, shape_set, seed, source=src.replace(old, new))


def compile_stage(t) -> tuple[StageResult, list[CompiledKernel]]:
    """The verifier's compile stage on the task's expert, in this process: every GEMM and pass of
    its forward and backward compiled for sm_90a at the task's ``cpu_shape_set`` (as the
    verifier's runner compiles them, under the compile lowering, where kernels depend on shapes
    and dtypes only), and the stage's verdict (``compile_result``: its SASS gate) over the kernels'
    reports in the runner's form.  Returns the result and the compiled kernels."""
    shape_set = t.spec.cpu_shape_set
    inputs, grads = draw(t, shape_set, seed=5)
    with compile_only() as kernels, torch.no_grad():
        run_program(t, load_expert(t, tag=f"expert_{t.name}_compile"), inputs, grads)
    return compile_result([k.report() for k in kernels], shape_set), kernels


def compiled(t) -> list[dict]:
    """The per-kernel reports of a passed :func:`compile_stage` (its SASS counts included)."""
    res, _ = compile_stage(t)
    assert res.status == "passed", f"{t.name}: {res.message}"
    return res.details["kernels"]


def sass_problems(name: str, kernels: list[dict], allowed_spills: dict | None = None) -> list[str]:
    """What the compile stage's SASS gate says of a program's kernels (its per-kernel reports):
    sm_90a with HGMMA (a tile pass's own kernel has none), no slow-path CALL, and no STL/LDL beyond
    ``allowed_spills[(epilogue, config)]`` or ``allowed_spills[epilogue]``."""
    allowed_spills = allowed_spills or {}
    out = []
    for k in kernels:
        where = f"{name}/{k['epilogue']} [{k['config']}]"
        if "sm90a" not in k:
            out.append(f"{where}: no SASS (pip install nvidia-cuda-cuobjdump)")
            continue
        if not (k["sm90a"] and (k["hgmma"] > 0 or k.get("kind") == "pass")):
            out.append(f"{where}: not sm_90a with HGMMA ({k})")
        if k["calls"]:
            out.append(f"{where}: {k['calls']} slow-path CALLs")
        spilled = k["spill_stores"] + k["spill_loads"]
        allowed = allowed_spills.get((k["epilogue"], k["config"]), allowed_spills.get(k["epilogue"], 0))
        if spilled > allowed:
            out.append(f"{where}: {k['spill_stores']} STL / {k['spill_loads']} LDL (allowed {allowed} in all)")
    return out
