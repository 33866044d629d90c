"""The static stage's contract rule (:func:`check_contract`, which :func:`.static.check_source`
calls with its checker's ``bad``): ``forward`` takes the task's inputs and params by keyword,
``backward`` takes ``saved`` and the upstream gradients (and ``needs`` where it declares it), and a
task with gradients has a backward.  The verifier calls both by keyword, so a name it does not pass
or one it passes that the function lacks is a failure before anything runs."""

from __future__ import annotations

import ast
from typing import Callable

from coda_agent.tasks.spec import TaskSpec


def check_contract(bad: Callable[[ast.AST, str], None], tree: ast.Module, spec: TaskSpec) -> None:
    """``forward``'s and ``backward``'s signatures against the task: what the verifier passes,
    by keyword, and the backward the task's gradients ask for."""
    funcs = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
    wanted = [*spec.inputs, *spec.params]
    fwd = funcs.get("forward")
    if fwd is None:
        bad(tree.body[0] if tree.body else tree, f"no top-level `def forward({', '.join(wanted)})`; "
            f"define it, returning a dict with {sorted(spec.outputs)}")
    else:
        a = fwd.args
        if a.posonlyargs:
            bad(fwd, "forward: parameters are passed by keyword; drop the `/`")
        _check_params(bad, fwd, [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]], wanted, "forward")
    bwd = funcs.get("backward")
    grads = [f"d{o}" for o in spec.grad_outputs]
    if spec.has_backward and bwd is None:
        bad(fwd or tree, f"the task asks for gradients {spec.gradients}: define "
            f"`def backward(saved, {', '.join(grads)})` returning "
            f"{{{', '.join(repr('d' + g) for g in spec.gradients)}}}")
    elif not spec.has_backward and bwd is not None:
        bad(bwd, "this task has no gradients; remove `backward`")
    elif bwd is not None:
        positional = [*bwd.args.posonlyargs, *bwd.args.args]
        if not positional:
            bad(bwd, "backward's first parameter must be `saved` (the forward's inputs, params and "
                "returned dict)")
        else:
            rest = [p.arg for p in positional[1:]] + [p.arg for p in bwd.args.kwonlyargs]
            # ``needs``: the gradients the caller reads, passed to a backward that declares it
            _check_params(bad, bwd, rest, grads, "backward", optional=("needs",))


def _check_params(bad: Callable[[ast.AST, str], None], fn: ast.FunctionDef, names: list[str], wanted: list[str],
                  what: str, optional: tuple[str, ...] = ()) -> None:
    a = fn.args
    missing = [w for w in wanted if w not in names]
    if missing and not a.kwarg:
        bad(fn, f"{what} does not accept {missing}; its parameters must be "
            f"({', '.join(wanted)}) (called by keyword)")
    extra = [n for n in names if n not in wanted and n not in optional]
    if len(extra) > len(a.defaults) + sum(d is not None for d in a.kw_defaults):
        bad(fn, f"{what} has parameters {extra} the verifier does not pass; its parameters "
            f"must be ({', '.join(wanted)})")
