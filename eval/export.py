"""``export``: an accepted, approved kernel as a module a training script imports.

``DIR/coda_<task>.py`` embeds the program source (so it cannot drift from what
was reviewed) and exposes:

- ``<Task>Function``: a ``torch.autograd.Function``.  forward calls the
  program's ``forward``, saves the inputs, params and everything forward
  returned (its extra entries are the state the program saved for backward);
  backward calls the program's ``backward(saved, d<output>...)`` and returns
  ``d<input>`` for the task's gradients (None for the rest).
- ``<task>(inputs..., *, params=task values) -> dict``: the Function behind a
  plain call, for an ``nn.Module``'s forward; outputs by name, as the task's
  reference returns them.

Beside it: ``coda_<task>.report.md`` / ``.report.json`` (the verifier's report of
the exported attempt) and ``.review.json`` (who approved it, when).

Only what a human approved is exported, and only the program they approved
(``review.json`` carries its sha256).  A CPU-only approval (``best/``, GPU
stages never ran) additionally needs ``allow_cpu_only``.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import yaml

from coda_agent.agent.protocols import CodaError
from coda_agent.storage import write_atomic, write_json
from coda_agent.tasks.spec import TaskSpec

from .review import CPU_ONLY_BANNER, candidate

TEMPLATE = '''"""{task}: a CODA GEMM-epilogue kernel exported by coda-agent.

From: {run} (attempt {attempt:02d}, {outcome}){cpu_note}
Approved by {who} at {when}.  Report: {module}.report.md next to this file.

In a model::

    from {module} import {func}
    outs = {func}({call})   # {{{outputs}}}

``{cls}.apply(*inputs, *params)`` is the autograd Function itself (inputs in
the order {inputs}).  CUDA tensors run the fused kernels (Hopper); CPU
tensors run the catalogue's PyTorch reference lowering.
"""

import torch

from coda_agent.primitives import load_program

PROGRAM_SOURCE = {source}
INPUTS = {inputs!r}
PARAMS = {params!r}  # the task's values
OUTPUTS = {outputs_t!r}
GRAD_OUTPUTS = {grad_outputs!r}  # backward receives d<output> for these
GRADIENTS = {gradients!r}  # backward returns d<input> for these

program = load_program(PROGRAM_SOURCE, {module!r})


class {cls}(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        inputs = dict(zip(INPUTS, args))
        params = dict(zip(PARAMS, args[len(INPUTS):]))
        outs = dict(program.forward(**inputs, **params))
        saved = {{**inputs, **params, **outs}}
        ctx.tensor_names = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(saved[k] for k in ctx.tensor_names))
        ctx.others = {{k: v for k, v in saved.items() if k not in ctx.tensor_names}}
        ctx.mark_non_differentiable(*(outs[o] for o in OUTPUTS if o not in GRAD_OUTPUTS))
        return tuple(outs[o] for o in OUTPUTS)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not GRADIENTS:
            raise RuntimeError("{task} is a forward-only task: its program has no backward")
        saved = {{**ctx.others, **dict(zip(ctx.tensor_names, ctx.saved_tensors))}}
        grads = {{f"d{{o}}": g for o, g in zip(OUTPUTS, grad_outputs) if o in GRAD_OUTPUTS}}
        back = program.backward(saved, **grads)
        return tuple(back[f"d{{n}}"] if n in GRADIENTS else None for n in INPUTS) + (None,) * len(PARAMS)


def {func}({signature}):
    """{summary}
    """
    outs = {cls}.apply({apply_args})
    return dict(zip(OUTPUTS, outs))
'''


def module_name(task: str) -> str:
    return "coda_" + re.sub(r"\W", "_", task)


def export(run: Path, to: Path, allow_cpu_only: bool = False) -> Path:
    c = candidate(run)
    if c is None:
        raise CodaError(f"{run}: nothing to export: no accepted/ program (nor a cpu_passed best/) in this "
                        "trajectory directory (give runs/.../ or runs/batch-.../<task>/sample-<i>/)")
    review = c.review()
    if review is None or review["decision"] != "approved":
        raise CodaError(f"{run}: not approved; review it first: coda-agent review {run} --approve")
    if review["program_sha256"] != c.program_sha256:
        raise CodaError(f"{run}: the program changed since {review['who']} approved it; review it again")
    if c.cpu_only and not allow_cpu_only:
        raise CodaError(f"{run}: {CPU_ONLY_BANNER}; exporting it needs --allow-cpu-only")
    spec = TaskSpec.model_validate(yaml.safe_load(c.task_path().read_text()))
    module = module_name(spec.name)
    to.mkdir(parents=True, exist_ok=True)
    write_atomic(to / f"{module}.py", render_module(spec, c, review, module))
    attempt = c.path / "attempts" / f"{c.result['best_attempt']:02d}"
    shutil.copyfile(c.path / c.kind / "report.md", to / f"{module}.report.md")
    shutil.copyfile(attempt / "report.json", to / f"{module}.report.json")
    write_json(to / f"{module}.review.json", review)
    return to / f"{module}.py"


def source_literal(source: str) -> str:
    """The program as a readable raw triple-quoted literal; repr() when it cannot be one."""
    if "'''" in source or source.endswith("\\"):
        return repr(source)
    return "r'''" + source + "'''"


def render_module(spec: TaskSpec, c, review: dict, module: str) -> str:
    inputs, params, outputs = tuple(spec.inputs), dict(spec.params), tuple(spec.outputs)
    func = re.sub(r"\W", "_", spec.name)
    signature = ", ".join([*inputs, *(["*"] if params else []), *(f"{k}={v!r}" for k, v in params.items())])
    return TEMPLATE.format(
        task=spec.name, run=c.path, attempt=c.result["best_attempt"], outcome=c.report()["outcome"],
        cpu_note=f"\n{CPU_ONLY_BANNER}: exported with --allow-cpu-only." if c.cpu_only else "",
        who=review["who"], when=review["when"], module=module, func=func, call=", ".join(inputs),
        outputs=", ".join(f"{o!r}: ..." for o in outputs), cls="".join(w.title() for w in func.split("_")) + "Function",
        inputs=inputs, source=source_literal(c.program), params=params, outputs_t=outputs,
        grad_outputs=tuple(spec.grad_outputs), gradients=tuple(spec.gradients), signature=signature,
        summary=textwrap.fill(" ".join(spec.summary.split()).replace('"""', "'''"), 100,
                              subsequent_indent="    "),
        apply_args=", ".join([*inputs, *params]))
