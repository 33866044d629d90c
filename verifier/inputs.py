"""Fresh inputs from a task's declared init distributions, and the references.

Seeds are drawn per run by the harness and never shown to the program, so a
program cannot special-case the data.  No distribution produces all zeros: a
zero input would let a program that ignores it pass.
"""

from __future__ import annotations

import torch

from coda_agent.tasks.spec import TaskSpec, TensorSpec, eval_expr

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "int32": torch.int32, "int64": torch.int64}


def _draw(spec: TaskSpec, t: TensorSpec, shape_set: str, gen: torch.Generator,
          device: str) -> torch.Tensor:
    env = {k: float(v) for k, v in spec.shapes[shape_set].items()}
    shape = spec.shape_of(t, shape_set)
    dtype = TORCH_DTYPES[t.dtype]
    scale = float(eval_expr(t.init.scale, env))
    mean = float(eval_expr(t.init.mean, env))
    dist = t.init.dist
    kw = dict(generator=gen, device=device)
    if dist == "randint":
        high = int(eval_expr(t.init.high if t.init.high is not None else shape[-1], env))
        return torch.randint(0, high, shape, **kw).to(dtype)
    if dist == "arange_rows":
        rows = torch.arange(shape[0], device=device).reshape(-1, *([1] * (len(shape) - 1)))
        return rows.expand(shape).to(dtype).contiguous()
    if dist == "normal":
        x = mean + torch.randn(shape, **kw) * scale
    elif dist == "uniform":
        x = mean + (torch.rand(shape, **kw) * 2 - 1) * scale
    else:  # ones_plus_noise
        x = 1 + torch.randn(shape, **kw) * scale
    return x.to(dtype)


def make_inputs(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One tensor per spec input, drawn with ``seed`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: _draw(spec, t, shape_set, gen, device) for name, t in spec.inputs.items()}


def make_grads(spec: TaskSpec, shape_set: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random upstream gradients ``d<output>`` of ``spec.grad_outputs`` (normal, std 1, in the
    output's dtype)."""
    gen = torch.Generator(device=device).manual_seed(seed ^ 0x5EED)
    out = {}
    for o in spec.grad_outputs:
        t = spec.outputs[o]
        out[f"d{o}"] = torch.randn(spec.shape_of(t, shape_set), generator=gen, device=device).to(
            TORCH_DTYPES[t.dtype])
    return out


def upcast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, device: str | None = None
           ) -> dict[str, torch.Tensor]:
    """Float tensors to ``dtype`` (None keeps it), everything to ``device``."""
    out = {}
    for k, v in tensors.items():
        v = v.to(device) if device else v
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        out[k] = out[k].detach().clone()
    return out


def run_reference(task, inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None,
                  dtype: torch.dtype | None, device: str | None = None) -> dict[str, torch.Tensor]:
    """The task's PyTorch reference, forward (+ backward when ``grads``), with the
    float inputs cast to ``dtype`` (None: the inputs' own dtype).  Returns outputs and
    ``d<input>`` gradients in one dict."""
    spec = task.spec
    x = upcast(inputs, dtype, device)
    g = upcast(grads, dtype, device) if grads else {}
    if grads and task.backward_reference_fn is None:
        for name in spec.gradients:
            x[name].requires_grad_(True)
    with torch.enable_grad() if grads else torch.no_grad():
        outs = dict(task.reference_fn(**x, **spec.params))
        missing = set(spec.outputs) - set(outs)
        if missing:
            raise RuntimeError(f"the task reference returned no {sorted(missing)}")
        result = {k: outs[k].detach() for k in spec.outputs}
        if grads:
            if task.backward_reference_fn is not None:
                back = task.backward_reference_fn(**x, **spec.params, **g)
                result.update({f"d{n}": back[f"d{n}"].detach() for n in spec.gradients})
            else:
                names = spec.grad_outputs
                got = torch.autograd.grad([outs[o] for o in names], [x[n] for n in spec.gradients],
                                          [g[f"d{o}"].to(outs[o].dtype) for o in names],
                                          allow_unused=True)
                for n, d in zip(spec.gradients, got):
                    result[f"d{n}"] = d.detach() if d is not None else torch.zeros_like(x[n])
    return result
