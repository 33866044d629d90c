"""The FP8 suite (tasks/llama3_fp8): the references' two runs (the exact math, and the
fp8 recipe that sets the noise floor) and what the experts compute besides their
outputs; (GPU tier) every expert is correct on the H200.

Through the verifier on the CPU, with the other suites' experts and one judge
(tests/test_verifier_suite.py): each expert passes the static stage and the
reference stage (the reference lowering against the fp8 reference run and the exact
math, CODA's rule with the task's tolerance, on every CPU shape set), and a program
that drops a scale fails.  The compile stage for sm_90a with warpgroup MMAs (QGMMA)
in the SASS is in tests/test_expert_compiles.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda_agent.tasks import load_task
from coda_agent.tasks.llama3_fp8 import references
from coda_agent.verifier import Verifier, inputs

SUITE = Path(__file__).resolve().parent.parent / "tasks" / "llama3_fp8"
TASKS = ["swiglu_fwd_fp8", "swiglu_bwd_fp8", "mlp_block_fp8", "llama3_block_fp8"]


def _task(name: str):
    return load_task(SUITE / f"{name}.yaml")


def test_the_truth_is_exact_and_the_fp8_run_sets_the_noise_floor():
    """The upcast reference run quantizes nothing; the run in the declared dtypes
    emulates the recipe, a few percent away (the tolerance the program gets)."""
    t = _task("mlp_block_fp8")
    x = inputs.make_inputs(t.spec, "small", 3)
    hi = inputs.run_reference(t, x, None, torch.float64)
    lo = inputs.run_reference(t, x, None, None)
    exact = references.mlp_block_fp8(**{k: v.double() for k, v in x.items()}, **t.spec.params)
    assert torch.equal(hi["y"], exact["y"])
    rel = float((lo["y"].double() - hi["y"]).norm() / hi["y"].norm())
    assert 0.005 < rel < t.spec.tolerance.rel_norm / 2, rel


def test_llama3_block_fp8_epilogues_reduce_the_amax_of_what_they_store():
    """The expert's forward returns the row amax of h1 * gamma_mlp and h2 * gamma_attn
    (for the next step's delayed scales): the reference's statistic of its outputs."""
    from coda_agent.primitives import load_program, lowering

    t = _task("llama3_block_fp8")
    x = inputs.make_inputs(t.spec, "small", 5)
    with lowering("reference"):
        out = load_program(t.expert_path.read_text(), "amax").forward(**x, **t.spec.params)
    for amax, h, gamma in (("hg1_amax", out["h1"], x["gamma_mlp"]), ("hg2_amax", out["h_out"], x["gamma_attn"])):
        torch.testing.assert_close(out[amax], references.hg_amax(h, gamma).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", ["mlp_block_fp8", "llama3_block_fp8"])
def test_an_fp8_block_keeps_the_bits_of_every_token_where_rstd_is_large(name):
    """A weight gradient's per-feature fp8 scale spans every token.  With one row in eight of the
    RMSNorm input at 2**-12, one in eight at 2**5 and a small eps, RMSNorm's r on the tiny rows is
    in the thousands: the experts quantize the normalized input and d(pre), as the references'
    recipe does, so dw_gu errs as much as the fp8 reference run.  (With x = h * gamma left
    unnormalized and r moved into d(pre), the large rows set each feature's scale of x and the
    tiny rows rounded to zero there: dw_gu erred 3.2 times the reference run in mlp_block_fp8, 4.6
    times in llama3_block_fp8, and a judge's edge draw rejected the mlp expert.)  llama3_block_fp8's
    RMSNorm input h1 = h + attn @ w_o leaves its epilogue in fp8 at a delayed per-row scale, here
    one that fits each row (a delayed per-tensor scale would flush the tiny rows in the forward's
    operand already, in any recipe)."""
    from coda_agent.kernels.contract import run
    from coda_agent.primitives import load_program, lowering

    t = _task(name)
    x = inputs.make_inputs(t.spec, "ragged", 11)
    row = torch.arange(x["h"].shape[0])[:, None] % 8
    factor = torch.where(row == 3, 2.0 ** -12, torch.where(row == 5, 2.0 ** 5, 1.0))
    for k in ("h", "attn"):
        if k in x:
            x[k] = (x[k].float() * factor).to(x[k].dtype)
    params = {"eps": 1e-7}
    if name == "llama3_block_fp8":
        exact = references.llama3_block_fp8(**{k: v.double() for k, v in x.items()}, **params)
        h1 = x["h"].double() + x["attn"].double() @ x["w_o"].double().t()
        x["hg1_scale"] = (references.hg_amax(h1, x["gamma_mlp"].double()) / 448).float()
        x["hg2_scale"] = (references.hg_amax(exact["h_out"], x["gamma_attn"].double()) / 448).float()
    grads = inputs.make_grads(t.spec, "ragged", 11)
    hi = inputs.run_reference(t, x, grads, torch.float64, params=params)
    lo = inputs.run_reference(t, x, grads, None, params=params)
    with lowering("reference"):
        got = run(load_program(t.expert_path.read_text(), "tiny_rows"), x, params, grads, t.spec.outputs,
                  t.spec.gradients)
    assert {f"d{g}" for g in t.spec.gradients} <= set(got)
    for grad in (f"d{g}" for g in t.spec.gradients):
        err = float((got[grad].double() - hi[grad]).abs().max())
        floor = float((lo[grad].double() - hi[grad]).abs().max())
        assert err < 1.5 * floor, (grad, err, floor)
    # The reference's recipe itself keeps the tiny rows: its dw_gu errs a tenth of the largest value.
    assert float((lo["dw_gu"].double() - hi["dw_gu"]).abs().max()) < 0.15 * float(hi["dw_gu"].abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", TASKS)
def test_expert_is_correct_on_the_gpu(name):
    t = _task(name)
    with Verifier(stages=["static", "reference", "compile", "correctness"], cache=False,
                  shape_sets=["small", "ragged", "llama3-8b"]) as v:
        res = v.check(t, t.expert_path.read_text()).stage("correctness")
    assert res.status == "passed", res.message


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor)}
    return sum(seen.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
@pytest.mark.parametrize("name", ["mlp_block_fp8", "llama3_block_fp8"])
def test_an_fp8_block_holds_no_temporary_past_its_last_reader(name):
    """Peak memory of an fp8 block's forward + backward at llama3-1b, beyond its inputs: at most
    what it must hold (what the forward returns, the gradients), d(pre)'s two fp8 copies (per
    token for the input gradient, per feature for W_gu's) and three (T, H) bf16 tensors of
    slack (gradients in flight, a weight's fp8 copy).  A backward that wrote d(pre) to a new
    tensor beside the saved pre-activation, or kept a cast's copies past its GEMMs, holds a
    (T, 2I) bf16 tensor more (537 MB here) and fails."""
    from coda_agent.kernels.contract import call_backward, call_forward, saved_state
    from coda_agent.primitives import load_program, lowering

    t = _task(name)
    spec, prog = t.spec, load_program(t.expert_path.read_text(), name)
    x = inputs.make_inputs(spec, "llama3-1b", 11, device="cuda")
    dys = inputs.make_grads(spec, "llama3-1b", 11, device="cuda")
    params = spec.params_at("llama3-1b")

    def step():
        outs = call_forward(prog, x, params, spec.outputs)
        grads = call_backward(prog, saved_state(x, params, outs), dys, spec.gradients, None)
        return outs, grads

    with lowering("cute"):
        step()  # compiles every kernel: its allocations are not the block's
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outs, grads = step()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    kept, held = _storage_bytes(outs.values()), _storage_bytes(grads.values())
    tokens, dim = x["h"].shape
    d_pre_fp8 = outs["pre"].numel() * 2  # q and qt, one byte an element each
    slack = 3 * tokens * dim * 2
    bound = kept + held + d_pre_fp8 + slack
    mb = {k: round(v / 1e6) for k, v in dict(peak=peak, kept=kept, grads=held, d_pre_fp8=d_pre_fp8,
                                              slack=slack, bound=bound).items()}
    assert peak <= bound, mb
    assert peak >= kept + held, mb  # the measurement sees the block at all


def _on_grid(rows: int, k: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, scale = references.quantize_rows(torch.randn(rows, k, generator=g) * 3, dtype)
    return q.to(device), scale.to(device)


def test_the_fp8_gemm_of_the_recipe_sums_in_fp32_off_the_gpu():
    """On the CPU (and for shapes the fp8 GEMM does not take) the recipe's GEMM is the fp32
    sum of the fp8 operands with both scales applied after it."""
    for k in (64, 72):  # 72: K not a multiple of 16
        qa, sa = _on_grid(48, k, torch.float8_e4m3fn, "cpu", 1)
        qb, sb = _on_grid(32, k, torch.float8_e5m2, "cpu", 2)
        got = references.fp8_product(qa, sa, qb, sb, torch.float8_e4m3fn, torch.float8_e5m2)
        want = (qa.double() @ qb.double().t()) * sa.double()[:, None] * sb.double()[None, :]
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-5)  # fp32 rounding
    fp8_x = qa.to(torch.float8_e4m3fn)  # the single-GEMM tasks' low run: inputs already fp8
    for fast in (False, True):  # off the GPU, fast accumulation changes nothing: the sum is fp32
        assert torch.equal(references._scaled_gemm(fp8_x, sa, qb.to(torch.float8_e5m2), sb, fast_accum=fast),
                           references.fp8_product(qa, sa, qb, sb, torch.float8_e4m3fn, torch.float8_e5m2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fp8_tensor_cores_take_the_recipe_s_gemm():
    """The fp8 reference on a GPU carries the tensor cores' accumulation, as the program's
    kernel does: it is torch._scaled_mm's sum, promoted or fast as the recipe's GEMM asks, off
    the exact one by more than fp32 rounding at K = 4096. Promoted, it stays far under the bf16
    rounding of an output (2^-9); fast, the tensor cores' narrower accumulator drifts to about
    2^-8 of the largest output at this K (the H200 measured 3.97e-3), so its bound is 2^-6."""
    qa, sa = _on_grid(1024, 4096, torch.float8_e4m3fn, "cuda", 1)
    qb, sb = _on_grid(512, 4096, torch.float8_e4m3fn, "cuda", 2)
    one = torch.ones((), device="cuda")
    exact = (qa.double() @ qb.double().t()) * sa.double()[:, None] * sb.double()[None, :]
    for fast in (False, True):
        got = references.fp8_product(qa, sa, qb, sb, fast_accum=fast)
        assert not references._NO_FP8_GEMM, references._NO_FP8_GEMM
        hw = torch._scaled_mm(qa.to(torch.float8_e4m3fn), qb.to(torch.float8_e4m3fn).t(), scale_a=one,
                              scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        assert torch.equal(got, hw * sa[:, None] * sb[None, :]), fast
        rel = ((got.double() - exact).abs().max() / exact.abs().max()).item()
        assert 1e-7 < rel < (2 ** -6 if fast else 2 ** -9), (fast, rel)


def test_fp8_tasks_are_timed_against_fp8_gemms(tmp_path):
    """The speed of light of a task whose GEMMs run in fp8 is fp8 GEMMs of its shapes: against
    bf16 ones an honest fp8 block ran 0.67x "the plain GEMMs" and was refused as impossibly fast."""
    from coda_agent.tasks.spec import TaskSpecError

    assert {_task(n).spec.gemm_dtype for n in TASKS} == {"fp8_e4m3"}
    assert load_task(SUITE.parent / "llama3" / "mlp_block.yaml").spec.gemm_dtype is None
    text = (SUITE / "swiglu_fwd_fp8.yaml").read_text().replace("gemm_dtype: fp8_e4m3", "gemm_dtype: fp8")
    (tmp_path / "t.yaml").write_text(text)  # its reference is a module path: found from anywhere
    with pytest.raises(TaskSpecError, match="gemm_dtype"):
        load_task(tmp_path / "t.yaml")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")
def test_the_fp8_speed_of_light_runs_scaled_mm():
    from coda_agent.verifier.timing import _plain_gemms

    spec = _task("mlp_block_fp8").spec
    outs = _plain_gemms(spec, "llama3-8b")()
    assert [tuple(o.shape) for o in outs] == [(m, n) for m, n, _ in spec.gemm_shapes("llama3-8b")]
    assert {o.dtype for o in outs} == {torch.bfloat16}
