"""Calling a program by its task's contract: the one implementation.

A program (one module of catalogue calls, see ``primitives``) solves a task
(``tasks/spec.py``) through two functions:

- ``forward(**inputs, **params)`` returns a dict holding every task output;
  any other entries are state it keeps for its backward;
- ``backward(saved, **{d<output>: ...})`` gets ``saved`` = inputs + params +
  everything forward returned, and the upstream gradients of the task's
  ``grad_outputs``; it returns a dict holding ``d<input>`` for every input in
  the task's ``gradients``.

A backward that declares a parameter ``needs`` is always passed one: the
frozenset of ``d<input>`` names its caller reads, and it may leave the others
out (skip a frozen weight's gradient GEMM).  Callers ask only for the sets
the verifier checks (``TaskSpec.gradient_subsets``), and only of a program
whose source declares ``needs`` (:func:`takes_needs`, read from the source,
which is what the verifier read too); a program that does not declare it gets
the call it always got and returns every gradient.

Everything that runs a program goes through :func:`call_forward` and
:func:`call_backward` (or :func:`run`, both in one): :class:`.kernel.Kernel`
for autograd, the verifier's runner (``verifier/program.py``), the benchmarks.
What they add is their own: the Kernel its input checks and autograd, the
runner its PyTorch audit and the program's line in an error.

What backward is given is cut to what it reads when its source says so
(:func:`backward_reads`: every use of ``saved`` is a subscript by a constant
name), so a kernel's autograd Function keeps alive only those tensors, not an
output nobody reads again; the verifier hands the checked program the same cut
dict, so what runs in a model is what was judged.

A program that breaks the contract (no dict, a missing name) raises
:class:`ContractError`, whose message names what is missing; an exception the
program itself raises passes through unchanged, so each caller reports it its
own way.  This module imports only torch: the verifier's runner, where
candidate programs run, imports it too.
"""

from __future__ import annotations

import ast
import inspect
from types import MappingProxyType, ModuleType
from typing import Any, Iterable, Mapping

from coda_agent.syntax import parse


class ContractError(Exception):
    """A program's forward or backward returned something the task's contract does not allow."""


def call_forward(program: ModuleType, inputs: Mapping[str, Any], params: Mapping[str, Any],
                 outputs: Iterable[str]) -> dict[str, Any]:
    """``program.forward``: every task output, and the state it keeps for backward."""
    outputs = sorted(outputs)
    outs = program.forward(**inputs, **params)
    if not isinstance(outs, dict):
        raise ContractError(f"forward returned {type(outs).__name__}; return a dict with {outputs}")
    missing = [o for o in outputs if o not in outs]
    if missing:
        raise ContractError(f"forward's returned dict lacks {missing}{_instead(missing, outs)}; it must hold "
                            f"every task output {outputs} (extra entries are saved state for backward)")
    return dict(outs)


def takes_needs(source: str) -> bool:
    """Whether the program's top-level ``def backward`` declares ``needs`` (see the module
    docstring): read from the source, so the verifier and a Kernel decide alike whatever the
    module rebinds at import."""
    try:
        tree = parse(source)
    except SyntaxError:
        return False
    return any(isinstance(f, ast.FunctionDef) and f.name == "backward"
               and "needs" in [a.arg for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)]
               for f in tree.body)


def backward_reads(source: str) -> frozenset[str] | None:
    """The names the top-level ``def backward`` reads from ``saved`` (its first parameter), when
    every use of it is ``saved["name"]``; None (it may read anything) for any other use: passed
    on, iterated, ``.get``, rebound, shadowed, a decorated or rebound ``backward``.  Read from the
    source, like :func:`takes_needs`; an answer too small only makes the program fail its
    verification, which runs with the same cut (:func:`saved_state`)."""
    try:
        tree = parse(source)
    except SyntaxError:
        return None
    defs = [f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "backward"]
    bound = [n for top in tree.body if top not in defs for n in ast.walk(top)
             if isinstance(n, ast.Name) and n.id == "backward" and not isinstance(n.ctx, ast.Load)]
    if len(defs) != 1 or bound or defs[0].decorator_list or not (defs[0].args.posonlyargs or defs[0].args.args):
        return None
    fn = defs[0]
    first = (*fn.args.posonlyargs, *fn.args.args)[0]
    name = first.arg
    keys: set[str] = set()
    subscripted: set[int] = set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name
                and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
            subscripted.add(id(node.value))
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id == name and id(node) not in subscripted:
            return None  # used whole, or rebound
        if node is not first and isinstance(node, ast.arg) and node.arg == name:
            return None  # shadowed by an inner function's parameter
        if name in _bound_names(node):
            return None
    return frozenset(keys)


def _bound_names(node: ast.AST) -> tuple[str, ...]:
    """Names a statement or pattern binds other than through an ``ast.Name`` store."""
    if isinstance(node, ast.ExceptHandler):
        return (node.name,) if node.name else ()
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return (node.name,) if node.name else ()
    if isinstance(node, ast.MatchMapping):
        return (node.rest,) if node.rest else ()
    if isinstance(node, ast.alias):
        return (node.asname or node.name.split(".")[0],)
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return tuple(node.names)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    return ()


def call_backward(program: ModuleType, saved: Mapping[str, Any], grads: Mapping[str, Any],
                  gradients: Iterable[str], needs: Iterable[str] | None = None) -> dict[str, Any]:
    """``program.backward``: ``d<input>`` for every input in ``gradients`` (or, given ``needs``, for
    every ``d<input>`` in it), nothing else.  A backward that declares ``needs`` gets it (all of
    ``gradients`` when ``needs`` is None); one that does not is called as it always was."""
    wanted = [f"d{g}" for g in gradients]
    if needs is not None:
        needs = frozenset(needs)
        unknown = sorted(needs - set(wanted))
        if unknown:
            raise ContractError(f"needs names {unknown}, which are not gradients of the task ({wanted})")
        wanted = [w for w in wanted if w in needs]
    try:
        declares = "needs" in inspect.signature(program.backward).parameters
    except (TypeError, ValueError):
        declares = False
    back = (program.backward(saved, **grads, needs=frozenset(wanted)) if declares
            else program.backward(saved, **grads))
    if not isinstance(back, dict):
        raise ContractError(f"backward returned {type(back).__name__}; return a dict with {wanted}")
    missing = [w for w in wanted if w not in back]
    if missing:
        asked = f" (called with needs={sorted(needs)}: return every name in needs)" if needs is not None else ""
        raise ContractError(f"backward's returned dict lacks {missing}{_instead(missing, back)}{asked}")
    return {w: back[w] for w in wanted}


def _instead(missing: list[str], returned: dict) -> str:
    """The returned names that look like a missing one (``d_gamma`` for ``dgamma``), as a hint."""
    import difflib

    keys = [k for k in returned if isinstance(k, str) and k not in missing]
    near = {m: difflib.get_close_matches(m, keys, n=1, cutoff=0.6) for m in missing}
    pairs = [f"`{hit[0]}` for `{m}`" for m, hit in near.items() if hit]
    return f" (it returned {', '.join(pairs)}: rename them)" if pairs else ""


def saved_state(inputs: Mapping[str, Any], params: Mapping[str, Any], outs: Mapping[str, Any],
                reads: frozenset[str] | None = None) -> Mapping[str, Any]:
    """What backward is given, read-only: inputs, params and everything forward returned, cut to
    ``reads`` (:func:`backward_reads`) unless it is None."""
    every = {**inputs, **params, **outs}
    return MappingProxyType(every if reads is None else {k: v for k, v in every.items() if k in reads})


def run(program: ModuleType, inputs: Mapping[str, Any], params: Mapping[str, Any],
        grads: Mapping[str, Any] | None, outputs: Iterable[str], gradients: Iterable[str],
        needs: Iterable[str] | None = None) -> dict[str, Any]:
    """forward, then (given ``grads``) backward: the task outputs and ``d<input>`` in one dict."""
    outputs = list(outputs)
    outs = call_forward(program, inputs, params, outputs)
    result = {o: outs[o] for o in outputs}
    if grads is not None:
        result.update(call_backward(program, saved_state(inputs, params, outs), grads, gradients, needs))
    return result
