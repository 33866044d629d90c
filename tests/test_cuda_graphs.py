"""CUDA graphs: the catalogue's launches captured once and replayed.

Training teams take the host out of a step with CUDA graphs: torch.compile's
``mode="reduce-overhead"`` (inductor's cudagraph trees) or a step captured by
hand with ``torch.cuda.graph``.  A launch that synchronises, allocates outside
PyTorch's allocator, launches on a stream of its own or bakes a host decision
into the graph breaks the capture, or replays the addresses and values of the
captured call.  So:

- each block kernel is captured forward and backward, then replayed on new
  inputs copied into the captured buffers, and must give the bits an eager
  call on those inputs gives (the verifier holds every program to
  deterministic bits) and match the task's reference;
- the patched LLaMA compiled in ``reduce-overhead`` mode captures every graph
  (inductor skips none) and trains like the same model compiled without CUDA
  graphs (both on the GPU);
- no module of the package holds a tensor between calls (CPU), the invariant
  that inductor's graphs need of every launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from suite_checks import draw, load_expert, mismatches

from coda_agent.kernels import Kernel
from coda_agent.tasks import load_task

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# GEMMs with tile, vector and paired operands, every reduction kind, head statistics, the
# LM head's chunk loop with its in-place aux kernel and reduce-add stores, the pass kernel,
# and the fp8 casts (Triton) with fp8 GEMMs and their scales in the epilogues.
BLOCKS = [("llama3", "mlp_block"), ("llama3", "llama3_block"), ("llama3", "lm_head_xent"),
          ("llama3", "qk_norm_rope"), ("llama3", "rope_bwd"), ("llama3_fp8", "mlp_block_fp8")]


def _run(kernel: Kernel, t, leaves: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None
         ) -> dict[str, torch.Tensor]:
    outs = kernel(**leaves)
    wrt = [leaves[g] for g in t.spec.gradients]
    if not wrt:
        return dict(outs)
    got = torch.autograd.grad([outs[o] for o in kernel.grad_outputs], wrt,
                              [grads[f"d{o}"] for o in kernel.grad_outputs])
    return {**outs, **{f"d{g}": d for g, d in zip(t.spec.gradients, got)}}


def _leaves(t, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cuda().requires_grad_(k in t.spec.gradients) for k, v in inputs.items()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))


def _task(suite: str, name: str):
    return load_task(ROOT / "tasks" / suite / f"{name}.yaml")


@pytest.mark.parametrize("shape_set", ["small", "ragged"])
@pytest.mark.parametrize(("suite", "name"), BLOCKS, ids=[n for _, n in BLOCKS])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_block_kernels_replay_from_a_cuda_graph(suite, name, shape_set):
    t = _task(suite, name)
    kernel = Kernel.from_files(t.expert_path, t.path)
    inputs, grads = draw(t, shape_set, seed=3)
    static = _leaves(t, inputs)
    static_grads = {k: v.cuda() for k, v in (grads or {}).items()}
    # Warm-up on a side stream, as capture wants: the first calls compile and load the kernels.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run(kernel, t, static, static_grads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(kernel, t, static, static_grads)

    new_inputs, new_grads = draw(t, shape_set, seed=11)
    with torch.no_grad():
        for k, v in new_inputs.items():
            static[k].copy_(v)
        for k, v in (new_grads or {}).items():
            static_grads[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    want = _run(kernel, t, _leaves(t, new_inputs), {k: v.cuda() for k, v in (new_grads or {}).items()})
    assert set(captured) == set(want)
    differ = [k for k in want if not _same_bits(captured[k], want[k])]
    assert not differ, f"replayed {differ} differ from an eager call on the same inputs"
    bad = mismatches(t, shape_set, {k: v.detach().cpu() for k, v in captured.items()}, new_inputs, new_grads)
    assert not bad, bad


def test_the_catalogue_keeps_no_tensor_between_calls():
    """No module of the package holds a tensor once the experts' calls have returned: memory a
    launch kept would live wherever its first call ran, and under torch.compile's CUDA graphs
    that is the graphs' pool, whose every live block must be a graph output (the GPU test
    below runs that case).  The experts run here on the CPU, through every shared code path
    but the cute lowering's launch."""
    import importlib
    import pkgutil

    from suite_checks import run_program

    import coda_agent.kernels
    import coda_agent.primitives
    from coda_agent.primitives import lowering

    # Every module of the folders a training step imports, whether or not an earlier test did:
    # a module-level tensor anywhere there (the drop-ins' included) lives across calls.
    for package in (coda_agent.primitives, coda_agent.kernels):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)

    for suite, name in [*BLOCKS, ("gpt2", "ln_qkv"), ("gpt2", "gelu_bwd")]:
        t = _task(suite, name)
        inputs, grads = draw(t, "small", seed=5)
        mod = load_expert(t)
        with lowering("reference"):
            run_program(t, mod, inputs, grads)
    held = [where for mod_name, mod in list(sys.modules.items()) if mod_name.startswith("coda_agent")
            for where in _tensors_in(vars(mod), mod_name)]
    assert not held, f"tensors kept between calls: {held}"


def _tensors_in(value, where: str, depth: int = 0) -> list[str]:
    """Where ``value`` (a module's namespace, and the containers in it, three levels down)
    holds a tensor."""
    if isinstance(value, torch.Tensor):
        return [where]
    if depth >= 3 or isinstance(value, (str, bytes, type)):
        return []
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, (list, tuple, set, frozenset)) else ())
    return [w for k, v in items for w in _tensors_in(v, f"{where}[{k!r}]", depth + 1)]


# The patched model trained under torch.compile, in a fresh interpreter: the catalogue's first
# calls (cold caches, first compiles) then run inside inductor's cudagraph warm-up, in the
# graphs' pool, as in a training job; the LM head runs several logits chunks.
_TRAIN = r"""
import copy, json, sys
import torch
sys.path.insert(0, sys.argv[1])
import test_llama
import coda_agent
from coda_agent.kernels import Kernel
from coda_agent.tasks import SUITE_DIR
from coda_agent.tasks.llama3.experts import lm_head_xent
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

test_llama.DEVICE = "cuda"
base = test_llama.tiny_llama().bfloat16()
g = torch.Generator().manual_seed(2)
ids = torch.randint(0, base.config.vocab_size, (2, 160), generator=g).cuda()
source = open(lm_head_xent.__file__).read().replace("LOGITS_BYTES = 256 * 2**20", "LOGITS_BYTES = 128 * 1024")
xent = Kernel.from_source(source, (SUITE_DIR / "lm_head_xent.yaml").read_text(), origin="lm_head_xent@128KiB")

def train(mode):
    torch._dynamo.reset()
    model = coda_agent.apply_to_llama(copy.deepcopy(base), kernels={"lm_head_xent": xent})
    compiled = torch.compile(model, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}

graph_losses, graph_weights = train("reduce-overhead")
skips = counters["inductor"]["cudagraph_skips"]
manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
recorded = bool(manager is not None and manager.roots)
plain_losses, plain_weights = train(None)
worst = max(((graph_weights[k] - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
            for k, w in plain_weights.items())
print(json.dumps({"skips": skips, "recorded": recorded, "graph": graph_losses, "plain": plain_losses,
                  "worst_weight_rel": worst}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_patched_llama_trains_in_reduce_overhead_mode():
    """torch.compile(mode="reduce-overhead") around the patched model: inductor records every
    graph, forward and backward, as a CUDA graph, and three SGD steps give the losses and the
    weights of the same model compiled without CUDA graphs."""
    proc = subprocess.run([sys.executable, "-c", _TRAIN, str(HERE)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["skips"] == 0 and got["recorded"], got
    torch.testing.assert_close(torch.tensor(got["graph"]), torch.tensor(got["plain"]), rtol=1e-2, atol=1e-2)
    assert got["worst_weight_rel"] < 2e-2, got
