"""CUDA graphs: the catalogue's launches captured once and replayed (GPU tier).

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
  graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from suite_checks import draw, mismatches, task

from coda_agent.kernels import Kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")]

# GEMMs with tile, vector and paired operands, every reduction kind, head statistics, the
# LM head's chunk loop with its in-place aux kernel and reduce-add stores, the pass kernel,
# and the fp8 casts (Triton) with fp8 GEMMs and delayed-scale stores.
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


@pytest.mark.parametrize("shape_set", ["small", "ragged"])
@pytest.mark.parametrize(("suite", "name"), BLOCKS, ids=[n for _, n in BLOCKS])
def test_block_kernels_replay_from_a_cuda_graph(suite, name, shape_set):
    t = task(name, suite)
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


def test_patched_llama_trains_in_reduce_overhead_mode(monkeypatch):
    """torch.compile(mode="reduce-overhead") around the patched model: inductor records every
    graph, forward and backward, as a CUDA graph, and three SGD steps give the losses and the
    weights of the same model compiled without CUDA graphs."""
    import test_llama
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    import coda_agent

    monkeypatch.setattr(test_llama, "DEVICE", "cuda")
    base = test_llama.tiny_llama().bfloat16()
    ids, labels = test_llama.batch()

    def train(mode: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch._dynamo.reset()
        model = coda_agent.apply_to_llama(copy.deepcopy(base))
        compiled = torch.compile(model, mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(ids, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain_losses, plain_weights = train(None)
    counters.clear()
    graph_losses, graph_weights = train("reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.roots, "inductor recorded no CUDA graph"
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(plain_losses), rtol=1e-2, atol=1e-2)
    for k, w in plain_weights.items():
        torch.testing.assert_close(graph_weights[k].float(), w.float(), rtol=2e-2, atol=2e-2, msg=k)
