"""Suite B of the LLaMA-3 tasks: QK-norm + RoPE, LM head + cross-entropy (forward,
and the fused training step), the MLP sub-block.

For every task: the spec loads; the expert program passes the static stage; it
matches the task reference on the CPU shape sets under the reference lowering
(forward, and backward against autograd through the reference) by CODA's rule;
and (slow) every GEMM of its forward and backward compiles for sm_90a with
HGMMA in the SASS and no register spills.
"""

from __future__ import annotations

import types

import pytest
import torch

from coda_agent.primitives import compile_only, load_program, lowering
from coda_agent.tasks import SUITE_DIR, load_task
from coda_agent.tasks.spec import eval_expr

TASKS = ["qk_norm_rope", "lm_head_xent_fwd", "lm_head_xent", "mlp_block", "llama3_block"]
CPU_SETS = ["small", "ragged"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "int32": torch.int32, "int64": torch.int64}


def _task(name):
    return load_task(SUITE_DIR / f"{name}.yaml")


def _program(task):
    return load_program(task.expert_path.read_text(), name=task.name)


# --------------------------------------------------------------------------- inputs


def _draw(spec, shape_set, seed):
    """Inputs from the spec's declared inits (never zeros), seeded."""
    gen = torch.Generator().manual_seed(seed)
    env = {k: float(v) for k, v in spec.shapes[shape_set].items()}
    out = {}
    for name, t in spec.inputs.items():
        shape = spec.shape_of(t, shape_set)
        dtype = DTYPES[t.dtype]
        scale = float(eval_expr(t.init.scale, env))
        dist = t.init.dist
        if dist == "randint":
            high = int(eval_expr(t.init.high if t.init.high is not None else shape[-1], env))
            x = torch.randint(0, high, shape, generator=gen)
        elif dist == "arange_rows":
            x = torch.arange(shape[0]).reshape(-1, *([1] * (len(shape) - 1))).expand(shape)
        elif dist == "normal":
            x = torch.randn(shape, generator=gen) * scale
        elif dist == "uniform":
            x = (torch.rand(shape, generator=gen) * 2 - 1) * scale
        else:
            x = 1 + torch.randn(shape, generator=gen) * scale
        out[name] = x.to(dtype).contiguous()
    return out


def _float_outputs(spec):
    return [o for o, t in spec.outputs.items() if t.dtype in ("bf16", "fp16", "fp32")]


def _grads(spec, shape_set, seed):
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    return {f"d{o}": torch.randn(spec.shape_of(spec.outputs[o], shape_set), generator=gen).to(
        DTYPES[spec.outputs[o].dtype]) for o in _float_outputs(spec)}


def _reference(task, inputs, grads, dtype):
    """Outputs (and d<input> by autograd) of the task reference, floats cast to dtype."""
    spec = task.spec
    x = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().clone()
         for k, v in inputs.items()}
    if grads:
        for n in spec.gradients:
            x[n].requires_grad_(True)
    with torch.enable_grad():
        outs = task.reference_fn(**x, **spec.params)
        res = {k: outs[k].detach() for k in spec.outputs}
        if grads:
            names = _float_outputs(spec)
            got = torch.autograd.grad([outs[o] for o in names], [x[n] for n in spec.gradients],
                                      [grads[f"d{o}"].to(outs[o].dtype) for o in names],
                                      allow_unused=True)
            for n, d in zip(spec.gradients, got):
                res[f"d{n}"] = d.detach() if d is not None else torch.zeros_like(x[n])
    return res


# --------------------------------------------------------------------------- the rule


def _check(name, out, hi, lo, factor=2.0, floor=1e-6, rel_norm=2e-2):
    """CODA's rule: max|out - ref64| <= factor * max|ref_lo - ref64| + floor, and
    ||out - ref64|| / ||ref64|| <= rel_norm.  Returns a failure message or None."""
    assert isinstance(out, torch.Tensor), f"{name}: not a tensor"
    assert tuple(out.shape) == tuple(hi.shape), f"{name}: shape {tuple(out.shape)} != {tuple(hi.shape)}"
    if not hi.is_floating_point():
        return None if torch.equal(out, hi) else f"{name}: integer output differs"
    o, h, lo = out.double(), hi.double(), lo.double()
    allowed = factor * float((lo - h).abs().max()) + floor
    err = float((o - h).abs().max())
    rel = float(torch.linalg.vector_norm(o - h) / torch.linalg.vector_norm(h).clamp_min(1e-30))
    if not torch.isfinite(o).all():
        return f"{name}: non-finite values"
    if err > allowed or rel > rel_norm:
        return f"{name}: max err {err:.3g} (allowed {allowed:.3g}), rel-norm {rel:.3g} (allowed {rel_norm})"
    return None


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", TASKS)
def test_spec_loads(name):
    task = _task(name)
    spec = task.spec
    assert spec.name == name
    assert task.expert_path.is_file()
    for s in ("small", "ragged", "llama3-1b", "llama3-8b", "llama3-70b"):
        assert s in spec.shapes, f"{name}: shape set {s} missing"
        assert spec.flops(s) > 0
    ragged = spec.shapes["ragged"]
    assert any(v % 128 for v in ragged.values()), "ragged must have a non-multiple of 128"


@pytest.mark.parametrize("name", TASKS)
def test_expert_is_static_clean(name):
    static = pytest.importorskip("coda_agent.verifier.static")
    task = _task(name)
    violations = static.check_source(task.expert_path.read_text(), task.spec)
    assert not violations, "\n".join(map(str, violations))


@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_matches_reference(name, shape_set):
    task = _task(name)
    spec = task.spec
    prog = _program(task)
    inputs = _draw(spec, shape_set, seed=1234)
    grads = _grads(spec, shape_set, seed=1234) if spec.gradients else None
    hi = _reference(task, inputs, grads, torch.float64)
    lo = _reference(task, inputs, grads, None)

    with lowering("reference"), torch.no_grad():
        fwd = prog.forward(**{k: v.clone() for k, v in inputs.items()}, **spec.params)
        failures = [_check(o, fwd[o], hi[o], lo[o]) for o in spec.outputs]
        if spec.gradients:
            saved = types.MappingProxyType({**inputs, **spec.params, **fwd})
            back = prog.backward(saved, **grads)
            failures += [_check(f"d{n}", back[f"d{n}"], hi[f"d{n}"], lo[f"d{n}"])
                         for n in spec.gradients]
    failures = [f for f in failures if f]
    assert not failures, f"{name}/{shape_set}:\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_expert_compiles_for_sm90(name):
    task = _task(name)
    spec = task.spec
    prog = _program(task)
    inputs = _draw(spec, "small", seed=7)
    with compile_only() as kernels, torch.no_grad():
        fwd = prog.forward(**inputs, **spec.params)
        if spec.gradients:
            grads = _grads(spec, "small", seed=7)
            prog.backward(types.MappingProxyType({**inputs, **spec.params, **fwd}), **grads)
    assert kernels, f"{name}: no GEMM compiled"
    seen = set()
    for k in kernels:
        key = (k.epilogue, k.config)
        if key in seen:
            continue
        seen.add(key)
        assert k.sass is not None, "cuobjdump missing (pip install nvidia-cuda-cuobjdump)"
        assert k.sass.sm90a and k.sass.hgmma > 0, f"{name}/{k.epilogue}: no HGMMA in SASS"
        assert k.sass.spill_stores == 0 and k.sass.spill_loads == 0, \
            f"{name}/{k.epilogue}: register spills {k.sass}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape_set", CPU_SETS)
@pytest.mark.parametrize("name", TASKS)
def test_expert_on_gpu(name, shape_set):
    """The cute lowering (quack's SM90 GEMM) against the fp64 CPU reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (Hopper)")
    task = _task(name)
    spec = task.spec
    prog = _program(task)
    inputs = _draw(spec, shape_set, seed=4321)
    grads = _grads(spec, shape_set, seed=4321) if spec.gradients else None
    hi = _reference(task, inputs, grads, torch.float64)
    lo = _reference(task, inputs, grads, None)
    dev = {k: v.cuda() for k, v in inputs.items()}
    with lowering("cute"), torch.no_grad():
        fwd = prog.forward(**dev, **spec.params)
        got = {o: fwd[o] for o in spec.outputs}
        if spec.gradients:
            back = prog.backward(types.MappingProxyType({**dev, **spec.params, **fwd}),
                                 **{k: v.cuda() for k, v in grads.items()})
            got.update({f"d{n}": back[f"d{n}"] for n in spec.gradients})
        torch.cuda.synchronize()
    failures = [_check(k, v.cpu(), hi[k], lo[k]) for k, v in got.items()]
    failures = [f for f in failures if f]
    assert not failures, f"{name}/{shape_set} on GPU:\n" + "\n".join(failures)


MUTANTS = [
    # (task, original, mutant): each plausible slip must fail the check.
    ("mlp_block", "hr * rstd * s * inv_dim", "hr * rstd * 0.0 * inv_dim"),  # RMSNorm backward without s
    ("qk_norm_rope", "e * s + o * c", "e * s - o * c"),  # RoPE sign
    ("lm_head_xent", "dloss[r0:r1]", "dloss[0:r1 - r0]"),  # every chunk weighted like the first
    ("llama3_block", '{"s": du * u}', '{"s": du}'),  # QKV-side statistic without the saved output
]


@pytest.mark.parametrize("name,orig,mutant", MUTANTS)
def test_checker_catches_mutant(name, orig, mutant):
    task = _task(name)
    spec = task.spec
    src = task.expert_path.read_text()
    assert orig in src
    prog = load_program(src.replace(orig, mutant), name=f"{name}_mutant")
    inputs = _draw(spec, "small", seed=99)
    grads = _grads(spec, "small", seed=99) if spec.gradients else None
    hi = _reference(task, inputs, grads, torch.float64)
    lo = _reference(task, inputs, grads, None)
    with lowering("reference"), torch.no_grad():
        fwd = prog.forward(**inputs, **spec.params)
        got = {o: fwd[o] for o in spec.outputs}
        if spec.gradients:
            back = prog.backward(types.MappingProxyType({**inputs, **spec.params, **fwd}), **grads)
            got.update({f"d{n}": back[f"d{n}"] for n in spec.gradients})
    assert any(_check(k, v, hi[k], lo[k]) for k, v in got.items()), f"{name}: mutant passed"
