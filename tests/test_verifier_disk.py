"""The judge's watch on what a runner writes to disk (verifier/disk.py): blocks, not sizes, and
entries; past either bound the runner's process group is killed."""

from __future__ import annotations

import subprocess
import time

from coda_agent.verifier import disk


def test_usage_counts_blocks_and_entries_not_sizes(tmp_path):
    (tmp_path / "sparse").write_bytes(b"")
    with open(tmp_path / "sparse", "r+b") as f:
        f.truncate(1 << 30)  # a GiB by its size, no block on the disk
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data").write_bytes(b"\x01" * (1 << 20))
    (tmp_path / "link").symlink_to("/usr")  # not followed
    used, entries = disk.usage([str(tmp_path)])
    assert (1 << 20) <= used < (1 << 21) and entries == 4
    assert disk.usage([str(tmp_path)], max_entries=2)[1] == 3  # the count stops past the bound


def test_a_runner_past_the_bound_is_killed_and_told(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "RUNNER_DISK_BYTES", 1 << 20)
    monkeypatch.setattr(disk, "DISK_POLL_S", 0.05)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    watch = disk.DiskWatch([str(tmp_path)], proc.pid)
    try:
        time.sleep(0.2)
        assert proc.poll() is None and watch.over is None  # an empty directory: left alone
        (tmp_path / "big").write_bytes(b"\x01" * (2 << 20))
        assert proc.wait(timeout=5) == -9
        assert "a runner may write" in watch.over
    finally:
        watch.stop()
        proc.kill()
