"""README.md's "Write your own task", run as written, in a temporary directory.

The section's fenced blocks are executed in order: its files (``cat > F <<'EOF'``)
are written, its ``coda-agent`` commands run through the CLI, its YAML block
is the edit a person makes, and its ``python - <<'EOF'`` snippet runs in a
fresh interpreter.  The model behind ``OPENAI_BASE_URL`` is the scripted
OpenAI-compatible HTTP server (tests/openai_server.py): its first program
imports torch (rejected by the static stage), its second is right.  The
verifier is the real one with every CPU stage, the sm_90a compile included, so
the outcome here is ``cpu_passed`` and review and export take the
``--allow-cpu-only`` path the README shows.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agent_fixtures import fenced
from typer.testing import CliRunner

from coda_agent.cli import app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("agent_env")]
README = Path(__file__).parents[1] / "README.md"

PROGRAM = '''from coda_agent.primitives import epilogue, gelu_tanh, gemm, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def geglu(acc):
    g, u = unpack(acc)  # adjacent columns (2j, 2j+1) = (gate, up)
    return {"y": gelu_tanh(g) * u}


def forward(x, w_gu, approximate):
    assert approximate == "tanh", "gelu_tanh is the tanh approximation"
    return {"y": gemm(x, w_gu, geglu)["y"]}
'''
TORCH_PROGRAM = "import torch\n" + PROGRAM

# The exit status each `coda-agent` command of the section should end with, in order.
EXPECTED_EXITS = [0, 1, 0, 3, 0, 0, 0]


def section() -> str:
    text = README.read_text()
    start = text.index("## Write your own task")
    return text[start:text.index("\n## ", start + 1)]


def steps(text: str) -> list[tuple[str, str]]:
    """(kind, text) in document order: each shell command (with its heredoc), and the YAML edit."""
    out: list[tuple[str, str]] = []
    for lang, body in re.findall(r"```(bash|yaml)\n(.*?)```", text, re.S):
        if lang == "yaml":
            out.append(("yaml", body))
            continue
        lines = body.replace("\\\n", " ").splitlines()
        while lines:
            line = lines.pop(0)
            if "<<'EOF'" in line:
                end = lines.index("EOF")
                out.append(("heredoc", line + "\n" + "\n".join(lines[:end]) + "\n"))
                lines = lines[end + 1:]
            elif line.strip():
                out.append(("sh", line))
    return out


def _verdicts() -> str:
    """The best attempt's report of every run so far (what a failed step's message carries: the why
    of a verdict)."""
    return "\n".join(p.read_text()[:4000] for p in sorted(Path.cwd().glob("runs/*/best/report.md")))


def walk(tmp_path, monkeypatch, server, expected_exits: list[int]) -> list[str]:
    """Run the section's steps in ``tmp_path``; returns the output of each command, in order."""
    server.reply(fenced(TORCH_PROGRAM), prompt_tokens=1000, completion_tokens=200)
    server.reply(fenced(PROGRAM), prompt_tokens=1300, completion_tokens=200)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))  # a fresh verdict: every stage really runs
    monkeypatch.setenv("USER", "reader")
    runner, exits, outputs, task_file = CliRunner(), [], [], None
    for kind, text in steps(section()):
        if kind == "yaml":  # the person's edit: each key's line replaced by the README's
            lines = task_file.read_text().splitlines()
            for new in text.splitlines():
                key = new.split(":")[0]
                lines = [new if line.startswith(f"{key}:") else line for line in lines]
            task_file.write_text("\n".join(lines) + "\n")
        elif kind == "heredoc" and text.startswith("cat > "):
            head, body = text.split("\n", 1)
            Path(head.split()[2]).write_text(body)
        elif kind == "heredoc" and text.startswith("python - "):
            body = text.split("\n", 1)[1]
            r = subprocess.run([sys.executable, "-"], input=body, capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            outputs.append(r.stdout)
        elif text.startswith("mkdir "):
            folder = text.split()[1]
            assert text == f"mkdir {folder} && cd {folder}", text
            (tmp_path / folder).mkdir()
            monkeypatch.chdir(tmp_path / folder)
        elif text.startswith("export "):
            name, value = text.split()[1].split("=", 1)
            monkeypatch.setenv(name, server.base_url if name == "OPENAI_BASE_URL" else value)
        elif text.startswith("coda-agent "):
            args = [a for arg in shlex.split(text, comments=True)[1:] for a in (sorted(glob.glob(arg)) or [arg])]
            r = runner.invoke(app, args, catch_exceptions=False)
            exits.append(r.exit_code)
            outputs.append(r.output)
            assert r.exit_code == expected_exits[len(exits) - 1], (text, r.output, _verdicts())
            if args[:2] == ["tasks", "new"]:
                task_file = Path(f"{args[2]}.yaml")
        else:
            pytest.fail(f"the README runs {text!r}, which this test does not know how to run")
    assert exits == expected_exits
    return outputs


def test_the_readme_walkthrough_works_as_written(tmp_path, monkeypatch, openai_server):
    outputs = walk(tmp_path, monkeypatch, openai_server, EXPECTED_EXITS)
    new, first_check, second_check, solve, review, approve, export = outputs[:7]
    assert "fill in families, gemms, target (the TODOs)" in new
    assert "families: still TODO" in first_check and "ok: geglu (geglu.yaml)" in second_check
    assert "turn 1: rejected at static: line 1: import of `torch`" in solve
    assert "turn 2: cpu_passed: passed static, reference, compile; GPU stages skipped (2700 tokens)" in solve
    assert "NOT accepted: CPU stages only" in review and "approved by reader" in approve
    assert outputs[-1].strip() == "coda_geglu matches the reference"
    (run,) = Path("runs").glob("*-geglu-qwen3-coder")
    assert (run / "reference/geglu_ref.py").read_text() == Path("geglu_ref.py").read_text()
    assert json.loads((run / "result.json").read_text())["stop_reason"] == "cpu_passed"
    prompt = openai_server.requests[0]["messages"][1]["content"]
    assert "def geglu(x, w_gu, approximate=\"tanh\"):" in prompt and "# geglu_ref.py" in prompt
    assert (Path("kernels") / "coda_geglu.py").read_text().count(PROGRAM.splitlines()[3]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (Hopper) GPU")
def test_the_readme_walkthrough_is_accepted_on_hopper(tmp_path, monkeypatch, openai_server):
    """On an H100/H200 the same steps end accepted: correctness on the task's own shape sets
    (smallest first), performance on the largest, and the exported kernel runs fused on CUDA."""
    walk(tmp_path, monkeypatch, openai_server, [0, 1, 0, 0, 0, 0, 0])
    (run,) = Path("runs").glob("*-geglu-qwen3-coder")
    report = json.loads((run / "attempts/02/report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert report["outcome"] == "accepted", [s["message"] for s in report["stages"]]
    assert stages["correctness"]["details"]["shape_sets"] == ["small", "ragged", "ragged+256", "llama-1b"]
    assert stages["performance"]["details"]["shape_set"] == "llama-1b"
    r = subprocess.run([sys.executable, "-c", CUDA_CALL], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "fused", r.stdout + r.stderr


CUDA_CALL = """
import torch
from coda_agent.primitives import launch_ledger
from kernels.coda_geglu import geglu
from geglu_ref import geglu as reference

x, w_gu = torch.randn(4096, 1024, device="cuda").bfloat16(), (torch.randn(1024, 5632, device="cuda") / 32).bfloat16()
with launch_ledger() as ledger:
    y = geglu(x, w_gu)["y"]
want = reference(x.float(), w_gu.float())["y"]
assert (y.float() - want).norm() <= 0.02 * want.norm()
assert [l.kind for l in ledger] == ["gemm"]
print("fused")
"""
