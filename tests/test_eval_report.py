"""The batch summary's metrics and the HTML report, checked in headless Chromium.

The browser test needs ``chromium`` (Debian package; .ci/run installs it).
Without it the test is skipped on a workstation and fails in CI (``CI`` or
``CODA_CI`` set), so CI can never pass by skipping it.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from itertools import combinations
from pathlib import Path

import pytest
from agent_fixtures import WRONG
from eval_fixtures import perf_program, write_tasks
from typer.testing import CliRunner

from coda_agent.cli import app
from coda_agent.eval.summary import pass_at_k

pytestmark = pytest.mark.usefixtures("agent_env")


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            draws = list(combinations([1] * c + [0] * (n - c), k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


@pytest.fixture
def gpu_batch(tmp_path, monkeypatch) -> Path:
    """Three tasks verified on two simulated GPUs: two accepted with numbers, one rejected."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    tasks = write_tasks(tmp_path / "tasks", {"fast_task": perf_program(0.95, 1.6),
                                             "slow_task": perf_program(1.25, 0.9), "wrong_task": WRONG})
    r = cli("eval", tasks, "--author", "expert", "--samples", 2, "--runs-dir", tmp_path / "runs",
            "--verifier", "eval_fixtures:SimVerifier")
    assert r.exit_code == 0, r.output
    (batch,) = (tmp_path / "runs").iterdir()
    return batch


def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        if os.environ.get("CI") or os.environ.get("CODA_CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI runs this test")
    return path


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # No network at all: a page that needed one would come out incomplete.
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) pixels of an 8-bit non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def test_html_report_renders_offline_in_chromium(gpu_batch, tmp_path):
    r = cli("report", gpu_batch)
    assert r.exit_code == 0, r.output
    assert "| fast_task | yes (2/2) |" in r.output and f"HTML: {gpu_batch / 'report.html'}" in r.output
    html = (gpu_batch / "report.html").read_text()
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and "<link" not in html and "<img" not in html  # nothing to fetch

    page = (gpu_batch / "report.html").resolve().as_uri()
    dom = run_chromium(tmp_path, "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    dom = dom.stdout
    assert 'id="summary-table"' in dom and dom.count('class="task-row"') == 3
    for task in ("fast_task", "slow_task", "wrong_task"):
        assert f"<td>{task}</td>" in dom
    assert 'id="suite-metrics"' in dom and "pass@1" in dom
    for plot in ("plot-speedup", "plot-turns", "plot-cost"):
        assert f'<svg id="{plot}"' in dom
    speedup_svg = dom.split('<svg id="plot-speedup"')[1].split("</svg>")[0]
    # two accepted tasks x two baselines have bars; the rejected task says n/a twice
    assert speedup_svg.count('class="bar"') == 4 and speedup_svg.count(">n/a<") == 2
    assert "1.05x" in speedup_svg and "1.60x" in speedup_svg

    shot = tmp_path / "report.png"
    res = run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page)
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1200, 900)
    not_white = sum(p != b"\xff\xff\xff" for p in pixels)
    assert not_white > 0.02 * len(pixels), f"the screenshot is (nearly) blank: {not_white} non-white pixels"
    assert len(set(pixels)) > 20  # text, table lines and coloured bars, not one flat colour


def test_report_of_a_missing_batch_is_a_clean_error(tmp_path):
    r = cli("report", tmp_path)
    assert r.exit_code == 2 and "not a batch directory" in r.output, r.output
