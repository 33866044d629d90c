"""`coda-agent tasks new`: each input drawn as the reference uses it, through the CLI: a
cross-entropy's target among its classes with its padding, an index below the size it indexes,
RoPE's positions and frequencies as they are."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coda_agent.cli import app

pytestmark = pytest.mark.usefixtures("agent_env")


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


CROSS_ENTROPY = '''import torch.nn.functional as F


def xent(x, w, t):
    """loss = cross_entropy(x @ w^T, t) per row, padding (-100) ignored."""
    return {"loss": F.cross_entropy((x @ w.t()).float(), t, reduction="none")}


def xent_own_index(x, w, t):
    """The same with ignore_index -1."""
    return {"loss": F.cross_entropy((x @ w.t()).float(), t, reduction="none", ignore_index=-1)}
'''


@pytest.mark.parametrize(("fn", "ignore"), [("xent", -100), ("xent_own_index", -1)])
def test_new_draws_a_cross_entropys_target_among_its_classes_with_padding(tmp_path, monkeypatch, fn, ignore):
    """The target of F.cross_entropy is drawn below the number of classes (an expression of the
    symbols) with one in eight set to the loss's ignore_index, so the task holds a program to the
    padding every batch has; the file then loads once its other TODOs are filled in."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(CROSS_ENTROPY)
    r = cli("tasks", "new", "xent", "--reference", f"ref.py:{fn}", "--input", "x=T,H", "--input", "w=V,H",
            "--input", "t=T:int64", "--shapes", "small=T:64,H:32,V:40", "--shapes", "ragged=T:50,H:24,V:56")
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path("xent.yaml").read_text())
    assert raw["inputs"]["t"] == {"shape": ["T"], "dtype": "int64", "role": "index",
                                  "init": {"dist": "randint", "high": "V",
                                           "ignore": {"value": ignore, "fraction": 0.125}}}
    assert "t: a cross-entropy's target" in Path("xent.yaml").read_text()
    assert "0-d" not in Path("xent.yaml").read_text()  # a loss per row
    text = Path("xent.yaml").read_text().replace(raw["families"], "[reduction, stateful]")
    text = text.replace(f"'{raw['target']}'", "{vs_gemm: 1.1}").replace(raw["gemms"], "[[T, V, H]]")
    Path("xent.yaml").write_text(text)
    r = cli("tasks", "check", "xent.yaml")
    assert r.exit_code == 0, r.output


def test_new_finds_rotary_inputs_through_a_concatenation(tmp_path, monkeypatch):
    """HF's RoPE makes its angles as torch.cat((freqs, freqs), -1): the inputs inside the tuple are
    the angle's positions and frequencies all the same."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(
        "import torch\n\n\ndef rope(q, pos, inv_freq):\n"
        "    freqs = pos[:, None] * inv_freq[None, :]\n"
        "    emb = torch.cat((freqs, freqs), -1)\n"
        "    h = q.shape[-1] // 2\n"
        "    rot = torch.cat((-q[:, h:], q[:, :h]), -1)\n"
        "    return {'y': (q.float() * emb.cos() + rot.float() * emb.sin()).to(q.dtype)}\n")
    r = cli("tasks", "new", "rope", "--reference", "ref.py:rope", "--input", "q=T,D", "--input", "pos=T:fp32",
            "--input", "inv_freq=D//2:fp32", "--shapes", "small=T:64,D:32")
    assert r.exit_code == 0, r.output
    inputs = yaml.safe_load(Path("rope.yaml").read_text())["inputs"]
    assert inputs["pos"]["init"] == {"dist": "positions", "high": 4096}
    assert inputs["inv_freq"]["init"]["dist"] == "uniform"


INDEXES = '''import torch
import torch.nn.functional as F


def masked_nll(h, w, t):
    """The target's log-probability by gather, padding (-100) masked out."""
    logp = torch.log_softmax((h @ w.t()).float(), -1)
    valid = t != -100
    nll = -logp.gather(-1, torch.where(valid, t, 0).unsqueeze(-1)).squeeze(-1)
    return {"loss": (nll * valid).sum() / valid.sum()}


def embed_rotate(ids, table, cos, sin, pos):
    """An embedding, rotated by tables of angles read at each token's position."""
    x1, x2 = F.embedding(ids, table).chunk(2, -1)
    c, s = cos[pos], sin[pos]
    return {"y": torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)}


def picked(logits, t, experts):
    """One column per row by a subscript, and rows of a table by index_select."""
    return {"p": logits[torch.arange(logits.shape[0]), t], "e": logits.index_select(1, experts)}
'''


@pytest.mark.parametrize(("fn", "inputs", "want"), [
    ("masked_nll", ["h=T,H", "w=V,H", "t=T:int64"],
     {"t": {"dist": "randint", "high": "V", "ignore": {"value": -100, "fraction": 0.125}}}),
    ("embed_rotate", ["ids=T:int64", "table=V,H", "cos=S,H//2", "sin=S,H//2", "pos=T:int64"],
     {"ids": {"dist": "randint", "high": "V"}, "pos": {"dist": "positions", "high": "S"}}),
    ("picked", ["logits=T,V", "t=T:int64", "experts=H:int64"],
     {"t": {"dist": "randint", "high": "V"}, "experts": {"dist": "randint", "high": "V"}}),
])
def test_new_draws_an_index_below_the_size_it_indexes(tmp_path, monkeypatch, fn, inputs, want):
    """An integer input that gather, embedding, index_select or a subscript reads as an index is
    drawn below the size of the dimension it indexes (an expression of the symbols), padded with
    the value the reference masks, positions into a table as packed sequences'; no TODO is left
    for its range."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(INDEXES)
    grads = ["--gradients", "h,w"] if fn == "masked_nll" else []
    r = cli("tasks", "new", fn, "--reference", f"ref.py:{fn}", *[a for i in inputs for a in ("--input", i)],
            "--shapes", "small=T:64,H:32,V:96,S:128", "--shapes", "ragged=T:50,H:40,V:104,S:160", *grads)
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path(f"{fn}.yaml").read_text())
    assert {k: raw["inputs"][k]["init"] for k in want} == want
    assert all(raw["inputs"][k]["role"] == "index" for k in want)
    # a mean loss with a backward: the file says why its gradient is hard to take, and the way out
    assert ("# loss: 0-d (a mean)" in Path(f"{fn}.yaml").read_text()) == (fn == "masked_nll")
    r = cli("tasks", "check", f"{fn}.yaml")
    assert [line.split(": ")[1] for line in r.output.splitlines() if "still TODO" in line] == [
        "families", "gemms", "target"], r.output


HAND_NORMS = '''import torch
import torch.nn.functional as F


def llama_rms(h, weight, w, eps=1e-6):
    """HF's LlamaRMSNorm, then a linear."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return {"y": F.linear(weight * x.to(h.dtype), w)}


def layer_norm_by_hand(h, gamma, beta, w, eps=1e-5):
    """A LayerNorm written out, then a linear."""
    mean = h.mean(-1, keepdim=True)
    var = ((h - mean) ** 2).mean(-1, keepdim=True)
    return {"y": F.linear((h - mean) / torch.sqrt(var + eps) * gamma + beta, w)}


def olmo(h, w, eps=1e-5):
    """OLMo's LayerNorm without weight or bias, on x.float()."""
    return {"y": F.linear(F.layer_norm(h.float(), (h.shape[-1],), None, None, eps).to(h.dtype), w)}


def embedded(ids, table, gamma, beta, eps=1e-5):
    """BLOOM's embedding LayerNorm: the table's rows are what is centred."""
    return {"y": F.layer_norm(F.embedding(ids, table), (table.shape[-1],), gamma, beta, eps)}
'''
NORM_WEIGHT = {"dist": "ones_plus_noise", "scale": 0.1}
NORM_BIAS = {"dist": "normal", "scale": 0.5}
CENTRED = {"dist": "normal", "mean": 1.0, "scale": 1.0}


@pytest.mark.parametrize(("fn", "inputs", "want"), [
    ("llama_rms", ["h=T,H", "weight=H", "w=N,H"], {"weight": NORM_WEIGHT, "h": {"dist": "normal", "scale": 1.0}}),
    ("layer_norm_by_hand", ["h=T,H", "gamma=H", "beta=H", "w=N,H"],
     {"gamma": NORM_WEIGHT, "beta": NORM_BIAS, "h": CENTRED}),
    ("olmo", ["h=T,H", "w=N,H"], {"h": CENTRED}),
    ("embedded", ["ids=T:int64", "table=V,H", "gamma=H", "beta=H"],
     {"table": CENTRED, "gamma": NORM_WEIGHT, "beta": NORM_BIAS}),
])
def test_new_finds_a_norm_written_by_hand_or_on_a_cast(tmp_path, monkeypatch, fn, inputs, want):
    """Norms ported from HF are written out (RMSNorm's rsqrt of the mean square, a LayerNorm's
    centring and division) or called on ``x.float()``: their weights are drawn near 1, biases at
    0.5 and the input a LayerNorm centres with mean 1, as for F.layer_norm on the input itself."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(HAND_NORMS)
    r = cli("tasks", "new", fn, "--reference", f"ref.py:{fn}", *[a for i in inputs for a in ("--input", i)],
            "--shapes", "small=T:64,H:32,N:48,V:80", "--shapes", "ragged=T:50,H:40,N:56,V:96")
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load(Path(f"{fn}.yaml").read_text())
    assert {k: raw["inputs"][k]["init"] for k in want} == want


PARAMETERS = """import torch
import torch.nn.functional as F


def dyt(x, alpha, w):
    return {"y": F.linear(torch.tanh(F.softplus(alpha) * x), w)}


def scaled_linear(h, w, b, gain):
    return {"y": F.gelu(F.linear(h, w, b)) * gain}


def vector(v, alpha):
    return {"y": torch.tanh(alpha * v)}
"""


@pytest.mark.parametrize(("fn", "inputs", "grads", "want"), [
    ("dyt", ["x=T,H", "alpha=1", "w=N,H"], "x,alpha,w", {"alpha"}),
    ("scaled_linear", ["h=B,S,H", "w=N,H", "b=N", "gain=N"], "h,w,b,gain", {"b", "gain"}),
    ("vector", ["v=T", "alpha=1"], "v,alpha", {"alpha"}),
])
def test_new_takes_an_input_without_a_token_size_for_a_models_parameter(tmp_path, monkeypatch, fn, inputs, grads,
                                                                        want):
    """A bias (N), a per-channel gain (N) and a trained scalar (DyT's alpha, xIELU's slopes) hold no
    token size: each is a model's parameter, drawn and varied as a weight; left an activation, the
    judge's scaled draw took a slope to thousands, where an honest fp32 softplus gradient
    underflows.  With no input of two dimensions to show the token axis, only a fixed size tells."""
    monkeypatch.chdir(tmp_path)
    Path("ref.py").write_text(PARAMETERS)
    r = cli("tasks", "new", fn, "--reference", f"ref.py:{fn}", *[a for i in inputs for a in ("--input", i)],
            "--gradients", grads, "--shapes", "small=T:64,B:2,S:32,H:32,N:48")
    assert r.exit_code == 0, r.output
    text = Path(f"{fn}.yaml").read_text()
    roles = {k: v.get("role") for k, v in yaml.safe_load(text)["inputs"].items()}
    assert {k for k, v in roles.items() if v == "weight"} - {"w"} == want, roles
    why = "a fixed size (no symbol)" if fn == "vector" else "no token size"
    assert f"{', '.join(sorted(want, key=list(roles).index))}: {why}" in text
