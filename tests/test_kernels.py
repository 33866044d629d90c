"""The public kernel API (coda_agent.kernels): a program + task as an autograd op.

The gradients come from torch.autograd through the Kernel's Function and are
judged by the verifier's own compare against the task references (the same
check the suite tests make of the programs called directly); the run-directory
path is a real `coda-agent eval` batch judged by the real verifier's CPU stages.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from suite_checks import draw, mismatches, task
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.kernels import Kernel, KernelError, KernelModule, load_kernel
from coda_agent.primitives import CATALOGUE_VERSION
from coda_agent.primitives.lowering import launch_ledger
from coda_agent.tasks import SUITE_DIR
from coda_agent.verifier.compare import compare
from coda_agent.verifier.inputs import run_reference


def suite_kernel(name: str, suite: str = "llama3") -> Kernel:
    t = task(name, suite)
    return Kernel.from_files(t.expert_path, t.path)


def autograd_mismatches(name: str, shape_set: str, device: str) -> list:
    """The Kernel's outputs and its autograd gradients, judged by the verifier's compare."""
    t = task(name)
    kernel = suite_kernel(name)
    inputs, grads = draw(t, shape_set, seed=7)
    leaves = {k: v.to(device).requires_grad_(k in t.spec.gradients) for k, v in inputs.items()}
    outs = kernel(**leaves)
    assert list(outs) == list(t.spec.outputs)
    wrt = [leaves[g] for g in t.spec.gradients]
    got_grads = torch.autograd.grad([outs[o] for o in kernel.grad_outputs], wrt,
                                    [grads[f"d{o}"].to(device) for o in kernel.grad_outputs])
    got = {**{o: v.detach().cpu() for o, v in outs.items()},
           **{f"d{g}": d.cpu() for g, d in zip(t.spec.gradients, got_grads)}}
    return mismatches(t, shape_set, got, inputs, grads)


BLOCKS = ["mlp_block", "llama3_block", "out_proj_residual"]


@pytest.mark.parametrize("name", BLOCKS)
def test_autograd_through_the_kernel_matches_the_reference(name):
    bad = autograd_mismatches(name, "small", "cpu")
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("shape_set", ["small", "ragged"])
@pytest.mark.parametrize("name", BLOCKS)
def test_autograd_through_the_kernel_on_gpu(name, shape_set):
    """The cute lowering (quack's SM90 GEMMs) under autograd, against the fp64 reference."""
    bad = autograd_mismatches(name, shape_set, "cuda")
    assert not bad, bad


FROZEN = [("llama3", "mlp_block"), ("llama3", "out_proj_residual"), ("gpt2", "mlp_block"),
          ("gpt2", "mlp_block_tanh"), ("gpt2", "ln_qkv"), ("gpt2", "out_proj_residual")]


def frozen_backward(suite: str, name: str, trained: set[str], device: str = "cpu") -> tuple[frozenset, int, list]:
    """Autograd through the suite's kernel with only ``trained`` requiring a gradient: the set the
    program's backward was asked for, the GEMMs it launched, and the mismatches of the gradients
    autograd got against the fp64 reference."""
    t = task(name, suite)
    kernel = Kernel.from_files(t.expert_path, t.path)
    asked, gemms = [], []
    backward = kernel.program.backward

    def recording(saved, *, needs, **grads):  # declares needs, as the program does
        asked.append(needs)
        # The ledger is opened here: autograd runs a CUDA backward in its own device thread.
        with launch_ledger() as launches:
            back = backward(saved, needs=needs, **grads)
        gemms.append(sum(x.kind == "gemm" for x in launches))
        return back

    kernel.program.backward = recording
    inputs, grads = draw(t, "small", seed=3)
    leaves = {k: v.to(device).requires_grad_(k in trained) for k, v in inputs.items()}
    outs = kernel(**leaves)
    torch.autograd.backward([outs[o] for o in kernel.grad_outputs],
                            [grads[f"d{o}"].to(device) for o in kernel.grad_outputs])
    hi = run_reference(t, inputs, grads, torch.float64)
    lo = run_reference(t, inputs, grads, None)
    bad = [m for g in sorted(trained) if (m := compare(f"d{g}", "small", leaves[g].grad.cpu(), hi[f"d{g}"], lo[f"d{g}"],
                                                       t.spec.tolerance_for(f"d{g}")))]
    assert all(leaves[k].grad is None for k in inputs if k not in trained)
    return asked[0], gemms[0], bad


def assert_frozen_backwards(suite: str, name: str, device: str) -> None:
    spec = task(name, suite).spec
    params = {g for g in spec.gradients if spec.inputs[g].role in ("weight", "norm_weight")}
    needs, full_gemms, bad = frozen_backward(suite, name, set(spec.gradients), device)
    assert needs == {f"d{g}" for g in spec.gradients} and not bad, bad
    needs, gemms, bad = frozen_backward(suite, name, set(spec.gradients) - params, device)
    assert needs == {f"d{g}" for g in spec.gradients if g not in params} and not bad, bad
    assert gemms < full_gemms
    for p in sorted(params):
        needs, _, bad = frozen_backward(suite, name, set(spec.gradients) - {p}, device)
        assert f"d{p}" not in needs and not bad, (p, bad)


@pytest.mark.parametrize("suite,name", FROZEN)
def test_frozen_weights_skip_their_gradient_gemms(suite, name):
    """LoRA's case: every parameter frozen. The backward is asked for the activations' gradients
    alone (``needs``), launches fewer GEMMs, and those gradients still match the reference; a
    frozen input (the parameters train) and each single frozen parameter likewise."""
    assert_frozen_backwards(suite, name, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("suite,name", FROZEN)
def test_frozen_weights_skip_their_gradient_gemms_on_gpu(suite, name):
    """The same with the cute lowering: the frozen paths' own epilogues (dswiglu_frozen) on SM90."""
    assert_frozen_backwards(suite, name, "cuda")


def test_a_backward_without_needs_returns_every_gradient():
    """A program whose backward does not declare ``needs`` is verified and called for the whole set
    only: with a frozen weight it still runs, and autograd drops that gradient."""
    t = task("out_proj_residual")
    source = t.expert_path.read_text().replace("def backward(saved, dy, needs):", "def backward(saved, dy):")
    source = source.replace('if "dattn" in needs:', "if True:").replace('if "dWo" in needs:', "if True:")
    kernel = Kernel.from_source(source, t.path.read_text())
    assert kernel.subsets == [frozenset({"dattn", "dWo", "dresidual"})]
    assert kernel.needs_for({"dattn"}) == kernel.subsets[0]
    inputs, grads = draw(t, "small", seed=3)
    attn = inputs["attn"].clone().requires_grad_()
    kernel(attn, inputs["Wo"], inputs["residual"])["y"].backward(grads["dy"])
    assert attn.grad is not None and attn.grad.abs().sum() > 0


def test_a_kernel_asks_only_for_verified_gradient_sets():
    kernel = suite_kernel("mlp_block")
    assert kernel.needs_for({"dh"}) == {"dh"}
    both = kernel.needs_for({"dh", "dgamma"})  # two sets of three hold it; no smaller one does
    assert len(both) == 3 and both > {"dh", "dgamma"} and both in kernel.subsets
    assert kernel.needs_for({"dw_gu"}) == {"dgamma", "dw_gu", "dw_down"}
    with pytest.raises(KernelError, match="verifier checked its backward for the gradient sets"):
        kernel.backward({}, {}, frozenset({"dh", "dw_gu"}))


def test_module_positional_call_and_params():
    kernel = suite_kernel("mlp_block")
    t = task("mlp_block")
    inputs, _ = draw(t, "small", seed=3)
    layer = kernel.module(eps=1e-6)
    assert isinstance(layer, KernelModule) and "mlp_block" in repr(layer)
    a = layer(*inputs.values())["y"]
    b = kernel(**inputs, eps=1e-6)["y"]
    c = kernel(**inputs)["y"]  # the task's eps, 1e-5
    d = kernel(*inputs.values(), 1e-6)["y"]  # params follow the inputs, as in the reference's signature
    assert torch.equal(a, b) and torch.equal(a, d) and not torch.equal(a, c)
    with pytest.raises(KernelError, match="param 'eps' given twice"):
        kernel(*inputs.values(), 1e-6, eps=1e-6)
    with pytest.raises(KernelError, match=r"takes 4 inputs .* and 1 params \['eps'\]; got 6 positional"):
        kernel(*inputs.values(), 1e-6, 2.0)
    assert kernel.function.__name__ == "MlpBlockFunction"
    assert issubclass(kernel.function, torch.autograd.Function)
    with pytest.raises(KernelError, match="has params \\['eps'\\]"):
        kernel.module(epsilon=1.0)


def test_a_shape_param_comes_from_the_inputs_shapes():
    """A param written as a shape expression (a GQA head width, a group size) is worked out from
    the inputs a call is given, unless the call gives it; one that no input's shape holds is
    refused with the fix."""
    t = task("swiglu_fwd")
    spec = t.path.read_text().replace("reference:", "params: {width: H, pairs: I, per_head: H // 8}\nreference:")
    source = t.expert_path.read_text().replace(
        "def forward(x, W_gu):", "def forward(x, W_gu, width, pairs, per_head):\n"
                                "    assert (width, pairs, per_head) == (x.shape[1], W_gu.shape[1] // 2, x.shape[1] // 8)")
    kernel = Kernel.from_source(source, spec)
    inputs, _ = draw(t, "small", seed=3)
    want = kernel(**inputs, width=inputs["x"].shape[1], pairs=inputs["W_gu"].shape[1] // 2,
                  per_head=inputs["x"].shape[1] // 8)["y"]
    assert torch.equal(kernel(**inputs)["y"], want) and torch.equal(kernel.module()(*inputs.values())["y"], want)
    binds_q = re.sub(r"(\n  [\w-]+: \{)(T:)", r"\1Q: 8, \2", spec)  # every shape set binds Q
    odd = Kernel.from_source(source, binds_q.replace("per_head: H // 8", "per_head: H // Q"))
    with pytest.raises(KernelError, match=r"params.per_head is 'H // Q', and no input has Q as a whole dimension; "
                                          r"pass per_head= explicitly"):
        odd(**inputs)


def test_bad_calls_name_the_input_and_the_fix():
    kernel = suite_kernel("mlp_block")
    inputs, _ = draw(task("mlp_block"), "small", seed=3)
    with pytest.raises(KernelError, match=r"input 'w_gu' dimension 0 is 768; the task declares 2\*I = 200 with I = 100 \(from 'w_down'\)"):
        kernel(**{**inputs, "w_down": inputs["w_down"][:, :100]})
    with pytest.raises(KernelError, match=r"input 'w_gu' dimension 0 is 700; the task declares 2\*I = 768"):
        kernel(**{**inputs, "w_gu": inputs["w_gu"][:700]})
    with pytest.raises(KernelError, match="'h' is torch.float32; the kernel was verified for bf16"):
        kernel(**{**inputs, "h": inputs["h"].float()})
    with pytest.raises(KernelError, match="no input or param 'gama'; did you mean 'gamma'"):
        kernel(inputs["h"], gama=inputs["gamma"])
    with pytest.raises(KernelError, match=r"missing inputs \['w_down'\]"):
        kernel(*list(inputs.values())[:3])


def test_forward_only_kernel_refuses_a_gradient():
    kernel = suite_kernel("swiglu_fwd")
    t = task("swiglu_fwd")
    inputs, _ = draw(t, "small", seed=5)
    x = inputs["x"].clone().requires_grad_(True)
    y = kernel(x, inputs["W_gu"])["y"]
    with pytest.raises(KernelError, match="forward-only kernel"):
        y.float().sum().backward()


def test_catalogue_guard(tmp_path):
    t = task("out_proj_residual")
    with pytest.raises(KernelError, match=f"verified against catalogue 1999.01.01-1; this coda-agent has "
                                          f"catalogue {CATALOGUE_VERSION}"):
        Kernel.from_files(t.expert_path, t.path, catalogue="1999.01.01-1")
    assert Kernel.from_files(t.expert_path, t.path, catalogue=CATALOGUE_VERSION).catalogue == CATALOGUE_VERSION
    broken = tmp_path / "p.py"
    broken.write_text("def forward(:\n")
    with pytest.raises(KernelError, match="the program does not load: syntax error"):
        Kernel.from_files(broken, t.path)
    (tmp_path / "fwd_only.py").write_text("def forward(attn, Wo, residual):\n    return {}\n")
    with pytest.raises(KernelError, match="defines no backward"):
        Kernel.from_files(tmp_path / "fwd_only.py", t.path)


def test_load_kernel_from_a_run_directory(tmp_path, agent_env):
    r = CliRunner().invoke(app, ["eval", str(SUITE_DIR / "out_proj_residual.yaml"), "--author", "expert",
                                 "--runs-dir", str(tmp_path / "runs"), "--verifier",
                                 "eval_fixtures:reference_verifier"], catch_exceptions=False)
    assert r.exit_code == 3, r.output  # cpu_passed: the CPU stages passed, nothing could be accepted
    (batch,) = (tmp_path / "runs").iterdir()
    run = batch / "out_proj_residual"
    with pytest.raises(KernelError, match="NOT ACCEPTED: CPU stages only.*allow_cpu_only=True"):
        load_kernel(run)
    kernel = load_kernel(run, allow_cpu_only=True)  # the one sample is found
    assert kernel.name == "out_proj_residual" and kernel.origin.endswith("sample-0")
    g = torch.Generator().manual_seed(0)
    attn, res = (torch.randn(32, 64, generator=g).bfloat16() for _ in range(2))
    wo = (torch.randn(64, 64, generator=g) / 8).bfloat16()
    assert torch.allclose(kernel(attn, wo, res)["y"].float(), (attn.float() @ wo.float() + res.float()),
                          atol=0.1)
    report = run / "sample-0" / "attempts" / "01" / "report.json"
    data = json.loads(report.read_text())
    data["versions"]["catalogue"] = "1999.01.01-1"
    report.write_text(json.dumps(data))
    with pytest.raises(KernelError, match="verified against catalogue 1999.01.01-1"):
        load_kernel(run, allow_cpu_only=True)
    with pytest.raises(KernelError, match="no accepted program here"):
        load_kernel(tmp_path)
    data["versions"]["catalogue"] = CATALOGUE_VERSION
    report.write_text(json.dumps(data))
    program = run / "sample-0" / "best" / "program.py"
    program.write_text(program.read_text() + "# edited after its verdict\n")
    with pytest.raises(KernelError, match="no accepted program here"):  # the one sample is no final program
        load_kernel(run, allow_cpu_only=True)
    with pytest.raises(KernelError, match="not the program attempt 1 judged"):
        load_kernel(run / "sample-0", allow_cpu_only=True)


def test_a_verdict_of_a_stage_subset_backs_no_kernel(tmp_path):
    """`verify --stages static` is cpu_passed (every stage that ran passed) and writes best/: a
    program that never met the reference stage must not load, list for review or export."""
    from verifier_helpers import TASK_PATH

    from coda_agent.agent.verdict import record_verdict
    from coda_agent.eval.export import export
    from coda_agent.eval.review import find_candidates
    from coda_agent.tasks.spec import load_task
    from coda_agent.verifier import Verifier

    wrong = tmp_path / "zeros.py"
    wrong.write_text((Path(__file__).parent / "bad_programs" / "wrong" / "returns_zeros.py").read_text())
    t = load_task(TASK_PATH)
    verifier = Verifier(stages=["static"], cache=False)
    report = verifier.check(t, wrong.read_text())
    assert report.outcome == "cpu_passed"  # the report itself is honest: only static ran
    run = record_verdict(tmp_path / "runs", t, wrong, wrong.read_text(), report, verifier.config())
    assert (run / "best" / "program.py").is_file()
    with pytest.raises(KernelError, match="never passed the reference stage"):
        load_kernel(run, allow_cpu_only=True)
    assert find_candidates(tmp_path / "runs") == []
    with pytest.raises(Exception, match="never passed the reference stage"):
        export(run, tmp_path / "out", allow_cpu_only=True)


@pytest.mark.parametrize("name,kept", [("mlp_block", {"pre", "rstd"}), ("llama3_block", {"h1", "pre", "r1", "r2"})])
def test_blocks_keep_only_what_their_backward_needs(name, kept):
    """Between forward and backward a block holds its outputs, the pre-activation and the
    RMS statistics: not the GEMM inputs (h * gamma, silu(g) * u) that its backward can
    rebuild for free (at LLaMA-3 1B, 320 MiB less per block; 8B: 576 MiB)."""
    t = task(name)
    inputs, _ = draw(t, "small", seed=2)
    outs = suite_kernel(name).forward(inputs, dict(t.spec.params))
    assert set(outs) - set(t.spec.outputs) == kept


def test_a_second_backward_through_reused_state_is_refused():
    """mlp_block's backward writes d(pre) over the saved pre-activation: autograd's version
    counter (bumped by the custom op's declared mutation) turns a second backward into an error."""
    t = task("mlp_block")
    inputs, _ = draw(t, "small", seed=3)
    leaves = {n: v.clone().requires_grad_(True) for n, v in inputs.items()}
    loss = suite_kernel("mlp_block")(**leaves)["y"].float().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _GraphLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.graphs.append(record.getMessage())


def test_a_compiled_backward_writes_over_no_saved_tensor_and_copies_none():
    """Under torch.compile a backward's ``gemm(..., out=saved)`` gets a buffer of its own: the
    saved pre-activation is an input of the compiled backward graph, which inductor would clone
    whole before any write into it (a (T, 2I) copy per layer).  Inductor on the CPU, the
    post-grad graphs read from its log: no clone of a (T, 2I) tensor, and the gradients those
    of the uncompiled kernel."""
    t = task("mlp_block")
    inputs, _ = draw(t, "small", seed=4)
    kernel = suite_kernel("mlp_block")

    def grads(fn):
        leaves = {n: v.clone().requires_grad_(True) for n, v in inputs.items()}
        fn(**leaves)["y"].float().square().sum().backward()
        return {n: v.grad for n, v in leaves.items()}

    want = grads(kernel)
    log, handler = torch._logging.getArtifactLogger("torch._inductor.compile_fx", "post_grad_graphs"), _GraphLog()
    log.addHandler(handler)
    torch._logging.set_logs(post_grad_graphs=True)
    try:  # compiled afresh: a cached graph is not logged
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            got = grads(torch.compile(kernel, backend="inductor", fullgraph=True))
    finally:
        torch._logging.set_logs()
        log.removeHandler(handler)
    graphs = "\n".join(handler.graphs)
    tokens, width = inputs["h"].shape[0], inputs["w_gu"].shape[0]  # the pre-activation: (T, 2I)
    assert "coda.gemm" in graphs and "dswiglu" in graphs, graphs[:2000]
    clones = [line for line in graphs.splitlines() if "aten.clone" in line]
    assert not [c for c in clones if f"[{tokens * width}]" in c or f"[{tokens}, {width}]" in c], clones
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


READS = [
    ('def backward(saved, dy):\n    return {"dx": dy * saved["w"] + saved["x"]}\n', {"w", "x"}),
    ('def backward(s, dy, needs):\n    f = lambda: s["pre"]\n    return {"dx": f()}\n', {"pre"}),
    ('def backward(saved, dy):\n    return {"dx": saved.get("x")}\n', None),  # a method of the dict
    ('def backward(saved, dy):\n    return helper(saved, dy)\n', None),  # passed on whole
    ('def backward(saved, dy):\n    return {"dx": sum(saved[k] for k in saved)}\n', None),  # iterated
    ('def backward(saved, dy):\n    k = "x"\n    return {"dx": saved[k]}\n', None),  # a computed key
    ('def backward(saved, dy):\n    saved = dict(saved)\n    return {"dx": saved["x"]}\n', None),  # rebound
    ('def backward(saved, dy):\n    g = lambda saved: saved["x"]\n    return {"dx": g(saved)}\n', None),
    ('def backward(saved, dy):\n    try:\n        pass\n    except E as saved:\n        pass\n'
     '    return {"dx": saved["x"]}\n', None),  # rebound by an except clause
    ('@wrap\ndef backward(saved, dy):\n    return {"dx": saved["x"]}\n', None),  # decorated
    ('def backward(saved, dy):\n    return {"dx": saved["x"]}\nbackward = other\n', None),  # rebound after
    ('def backward(*args):\n    return {"dx": args[0]["x"]}\n', None),  # no named first parameter
    ('def forward(x):\n    return {"y": x}\n', None),  # no backward (a forward-only task keeps nothing)
]


@pytest.mark.parametrize("source,reads", READS)
def test_what_a_backward_reads_is_read_from_its_source(source, reads):
    """``backward_reads``: the constant names ``saved`` is subscripted with, or None (keep it all)
    for every other use of ``saved`` or of ``backward``."""
    from coda_agent.kernels.contract import backward_reads

    got = backward_reads(source)
    assert got == (None if reads is None else frozenset(reads))


def _saved_by(out: torch.Tensor) -> list[torch.Tensor]:
    return list(out.grad_fn.saved_tensors)


def test_the_function_keeps_only_what_the_backward_reads():
    """gelu_mlp's backward reads x, the weights and the pre-activation: the Function keeps neither
    its output y nor the biases, so y is freed when the model is done with it, and a model may
    change y in place (Falcon's layer adds into its MLP's output) and still get HF's gradients."""
    t = task("gelu_mlp", "gpt2")
    kernel = suite_kernel("gelu_mlp", "gpt2")
    assert kernel.reads == {"x", "w_fc", "w_proj", "pre"}
    assert not kernel.keeps("y") and not kernel.keeps("b_fc")
    inputs, grads = draw(t, "small", seed=5)

    def grads_of(in_place: bool) -> dict[str, torch.Tensor]:
        leaves = {n: v.clone().requires_grad_(True) for n, v in inputs.items()}
        y = kernel(**leaves)["y"]
        assert all(s.data_ptr() != y.data_ptr() for s in _saved_by(y))
        assert len(_saved_by(y)) == 4
        if in_place:
            y += 1.0
        y.backward(grads["dy"])
        return {n: v.grad for n, v in leaves.items()}

    want, got = grads_of(False), grads_of(True)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)


def test_a_backward_that_reads_its_output_keeps_it():
    """The same program with a backward that also reads y keeps y, and autograd's version counter
    refuses a backward after y was changed in place (not a wrong gradient)."""
    t = task("gelu_mlp", "gpt2")
    source = t.expert_path.read_text().replace('x, w_fc = saved["x"], saved["w_fc"]',
                                               'x, w_fc, _ = saved["x"], saved["w_fc"], saved["y"]')
    kernel = Kernel.from_source(source, t.path.read_text())
    assert kernel.keeps("y") and not kernel.keeps("b_fc")
    inputs, grads = draw(t, "small", seed=5)
    leaves = {n: v.clone().requires_grad_(True) for n, v in inputs.items()}
    y = kernel(**leaves)["y"]
    y += 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(grads["dy"])


def test_the_verifier_hands_the_backward_the_same_cut(monkeypatch):
    """The runner's call (``verifier/program.py``) cuts ``saved`` to what the source reads, as a
    Kernel does: what runs in a model is what was judged."""
    from coda_agent.verifier import program as prog

    t = task("gelu_mlp", "gpt2")
    seen: list[set[str]] = []
    real = prog.call_backward

    def spy(mod, saved, *args, **kwargs):
        seen.append(set(saved))
        return real(mod, saved, *args, **kwargs)

    monkeypatch.setattr(prog, "call_backward", spy)
    source = t.expert_path.read_text()
    contract = prog.Contract(inputs=list(t.spec.inputs), params=dict(t.spec.params),
                             outputs={o: s.dtype for o, s in t.spec.outputs.items()},
                             gradients=list(t.spec.gradients), grad_outputs=list(t.spec.grad_outputs))
    inputs, grads = draw(t, "small", seed=6)
    result = prog.call(contract, prog.load(source, "cut"), inputs, grads)
    assert seen == [{"x", "w_fc", "w_proj", "pre"}]
    assert {"y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"} <= set(result)
