"""``export``: an accepted, approved kernel as a module a training script imports.

``DIR/coda_<task>.py`` embeds the program source and the task spec as reviewed
(so neither can drift from what was approved) and the catalogue version the
program was verified against, and builds a :class:`coda_agent.kernels.Kernel`
from them when imported; everything that runs the program under autograd lives
in ``coda_agent.kernels``.  The module exposes:

- ``kernel``: the Kernel (``kernel.module()`` is an ``nn.Module``);
- ``<Task>Function``: its ``torch.autograd.Function`` (``apply(*inputs, *params)``);
- ``<task>(inputs..., params=task values) -> dict``: a plain call, outputs by
  name, as the task's reference returns them.

Beside it: ``coda_<task>.report.md`` / ``.report.json`` (the verifier's report of
the exported attempt) and ``.review.json`` (who approved it, when).

Only what a human approved is exported, and only the program they approved
(``review.json`` carries its sha256).  A CPU-only approval (``best/``, GPU
stages never ran) additionally needs ``allow_cpu_only``.  The kernel is built
once here too, so a program that would not load (or a catalogue mismatch)
fails the export, not the training run that imports it.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from coda_agent.agent.protocols import CodaError
from coda_agent.kernels import Kernel
from coda_agent.kernels.source import why_not_final
from coda_agent.storage import write_atomic, write_json

from .review import CPU_ONLY_BANNER, candidate

TEMPLATE = '''"""{task}: a CODA GEMM-epilogue kernel exported by coda-agent.

From: {run} (attempt {attempt:02d}, {outcome}){cpu_note}
Approved by {who} at {when}.  Report: {module}.report.md next to this file.

In a model::

    from {module} import {func}
    outs = {func}({call})   # {{{outputs}}}

``{cls}.apply(*inputs, *params)`` is the autograd Function itself (inputs in
the order {inputs}); ``kernel.module()`` is an nn.Module.  CUDA tensors run the
fused kernels (Hopper); CPU tensors run the catalogue's PyTorch reference lowering.
"""

from coda_agent.kernels import Kernel

PROGRAM_SOURCE = {source}
TASK_SPEC = {spec}
CATALOGUE = {catalogue!r}  # the catalogue version the program was verified against

kernel = Kernel.from_source(PROGRAM_SOURCE, TASK_SPEC, catalogue=CATALOGUE, origin={origin!r})
{cls} = kernel.function


def {func}({signature}):
    """{summary}
    """
    return kernel({call_args})
'''


def module_name(task: str) -> str:
    return "coda_" + re.sub(r"\W", "_", task)


def export(run: Path, to: Path, allow_cpu_only: bool = False) -> Path:
    c = candidate(run)
    if c is None and (why := why_not_final(run)):
        raise CodaError(f"{run}: nothing to export: {why}; verify the program again (coda-agent verify)")
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
    spec_text = c.task_path().read_text()
    catalogue = c.report().get("versions", {}).get("catalogue")
    kernel = Kernel.from_source(c.program, spec_text, catalogue=catalogue, origin=str(c.path))
    module = module_name(kernel.name)
    to.mkdir(parents=True, exist_ok=True)
    write_atomic(to / f"{module}.py", render_module(kernel, c, review, module, spec_text))
    attempt = c.path / "attempts" / f"{c.result['best_attempt']:02d}"
    write_atomic(to / f"{module}.report.md", (c.path / c.kind / "report.md").read_text())
    write_atomic(to / f"{module}.report.json", (attempt / "report.json").read_text())
    write_json(to / f"{module}.review.json", review)
    return to / f"{module}.py"


def source_literal(source: str) -> str:
    """Text as a readable raw triple-quoted literal; repr() when it cannot be one."""
    if "'''" in source or source.endswith("\\"):
        return repr(source)
    return "r'''" + source + "'''"


def render_module(kernel: Kernel, c, review: dict, module: str, spec_text: str) -> str:
    func = re.sub(r"\W", "_", kernel.name)
    params = kernel.params
    signature = ", ".join([*kernel.inputs, *(f"{k}={v!r}" for k, v in params.items())])  # the reference's order
    return TEMPLATE.format(
        task=kernel.name, run=c.path, attempt=c.result["best_attempt"], outcome=c.report()["outcome"],
        cpu_note=f"\n{CPU_ONLY_BANNER}: exported with --allow-cpu-only." if c.cpu_only else "",
        who=review["who"], when=review["when"], module=module, func=func, call=", ".join(kernel.inputs),
        outputs=", ".join(f"{o!r}: ..." for o in kernel.outputs), cls=kernel.function.__name__,
        inputs=kernel.inputs, source=source_literal(c.program), spec=source_literal(spec_text),
        catalogue=kernel.catalogue, origin=str(c.path), signature=signature,
        summary=textwrap.fill(" ".join(str(kernel.spec.summary).split()).replace('"""', "'''"), 100,
                              subsequent_indent="    "),
        call_args=", ".join([*kernel.inputs, *(f"{k}={k}" for k in params)]))
