"""The outlier draw's channels, and the second look that judges an element carrying most of
a tensor's noise against more samples of the reference's own (verifier/noise.py)."""

from __future__ import annotations

import torch
from suite_checks import load_expert, run_program, task
from verifier_helpers import CORPUS

from coda_agent.primitives import lowering
from coda_agent.tasks import SUITE_DIR
from coda_agent.tasks.spec import Tolerance, load_task
from coda_agent.verifier.calls import draw_case, verdict
from coda_agent.verifier.compare import compare
from coda_agent.verifier.inputs import make_inputs
from coda_agent.verifier.noise import Noise, nudged
from coda_agent.verifier.outliers import outlier_inputs


def test_the_outlier_draw_gives_hidden_states_outlier_channels():
    """One to three channels of every activation and residual, the same in tensors of one width,
    at 8 to 64 times the rest and one sign down the tokens (a trained model's outlier features);
    weights untouched, every other column as drawn."""
    spec = load_task(SUITE_DIR / "residual_rmsnorm.yaml").spec
    plain, drawn = make_inputs(spec, "ragged", 7), outlier_inputs(spec, "ragged", 7)
    cols = {name: (drawn[name] != plain[name]).any(0).nonzero().flatten().tolist() for name in ("x", "z")}
    assert cols["x"] == cols["z"] and 1 <= len(cols["x"]) <= 3, cols
    for name in ("x", "z"):
        rest = plain[name].float().square().mean().sqrt()
        for c in cols[name]:
            v = drawn[name][:, c].float()
            assert v.abs().mean() > 6 * rest
            assert max((v > 0).float().mean(), (v < 0).float().mean()) > 0.75  # one sign down the tokens
    assert torch.equal(plain["W1"], drawn["W1"]) and torch.equal(plain["gamma"], drawn["gamma"])


def test_a_backwards_saved_hidden_state_has_them_and_its_row_statistics_do_not():
    """rmsnorm_bwd reads the forward's pre-norm x as ``saved``: its outlier channels are there (a
    backward that clips them was let through), its per-row r and s are drawn as ever."""
    spec = load_task(SUITE_DIR / "rmsnorm_bwd.yaml").spec
    plain, drawn = make_inputs(spec, "ragged", 3), outlier_inputs(spec, "ragged", 3)
    cols = (drawn["x"] != plain["x"]).any(0).nonzero().flatten()
    assert 1 <= len(cols) <= 3 and drawn["x"][:, cols].float().abs().mean() > 6
    assert torch.equal(drawn["r"], plain["r"]) and torch.equal(drawn["s"], plain["s"])  # per-row statistics


def test_nudged_inputs_move_by_an_ulp_at_most():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g).to(torch.bfloat16)
    x[:16] = 0
    ids = torch.arange(10)
    out = nudged({"x": x, "ids": ids}, g)
    assert torch.equal(out["ids"], ids) and bool((out["x"][:16] == 0).all())
    ulp = 2.0 ** (torch.floor(torch.log2(x[16:].float().abs())) - 7)
    step = (out["x"][16:].float() - x[16:].float()).abs()
    assert bool((step <= ulp * 2 + 1e-30).all()) and 0.2 < float((step > 0).float().mean()) < 0.8


def test_an_element_that_carries_the_noise_is_judged_by_more_samples_of_it():
    """The reference's one error at a dominant element happened to be small; an honest program's
    1.5 sigma there fails the first look and passes the second, while 10 sigma fails both, and
    the quiet elements keep the first look's bar."""
    g = torch.Generator().manual_seed(3)
    hi = torch.randn(512, generator=g, dtype=torch.float64)
    hi[7] = 300.0
    sigma = torch.full_like(hi, 1e-3)
    sigma[7] = 0.5
    z = torch.randn(512, generator=g, dtype=torch.float64).clamp(-3, 3)
    z[7] = 0.2
    lo = hi + sigma * z
    noise = Noise(rms=sigma, norm=float(sigma.norm()), mean=0.0, se=float(sigma.norm()) / 512)
    tol = Tolerance()
    honest = hi.clone()
    honest[7] += 1.5 * sigma[7]
    assert compare("dgamma", "s", honest, hi, lo, tol) is not None
    assert compare("dgamma", "s", honest, hi, lo, tol, noise=noise) is None
    wrong = hi.clone()
    wrong[7] += 10 * sigma[7]
    assert compare("dgamma", "s", wrong, hi, lo, tol, noise=noise) is not None
    quiet = hi.clone()
    quiet[3] += 0.3  # past the first look's bar (twice the largest error, 0.1)
    assert compare("dgamma", "s", quiet, hi, lo, tol, noise=noise) is not None


def test_the_gpt2_mlp_blocks_expert_passes_every_outlier_draw_the_first_look_alone_fails():
    """The honest expert's dgamma at an outlier channel's column errs as much as the reference
    does, and in about one draw in twenty more than twice the reference's one sample there: the verdict's second
    look passes every such draw (and the first-look failures are there to be judged)."""
    t = task("mlp_block", "gpt2")
    mod = load_expert(t)
    first_look = 0
    for seed in range(40):
        case = draw_case(t, t.spec, "ragged", 100 + seed, "cpu", "outliers")
        with lowering("reference"):
            got = run_program(t, mod, {k: v.clone() for k, v in case.inputs.items()}, case.grads)
        got = {k: got[k] for k in case.hi}
        tol = t.spec.tolerance_for("dgamma")
        first_look += compare("dgamma", "ragged", got["dgamma"], case.hi["dgamma"], case.lo["dgamma"], tol) is not None
        assert verdict(t.spec, case, got) == [], seed
        if first_look:
            break
    assert first_look


def test_clipping_at_six_rms_passes_plain_fresh_draws_and_fails_the_outlier_draws():
    """What catches the clipper (tests/bad_programs/extreme/clips_outliers.py) is the outlier
    channels: no element of the other draws stands past six times its row's RMS."""
    t = task("mlp_block", "gpt2")
    mod = load_expert(t, (CORPUS / "extreme" / "clips_outliers.py").read_text())
    for draw, fails in (("seed", False), ("outliers", True)):
        case = draw_case(t, t.spec, "ragged", 5, "cpu", draw)
        with lowering("reference"):
            got = run_program(t, mod, {k: v.clone() for k, v in case.inputs.items()}, case.grads)
        assert bool(verdict(t.spec, case, {k: got[k] for k in case.hi})) == fails, draw
