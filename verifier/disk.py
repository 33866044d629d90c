"""What a runner writes to disk, watched from the judge: at most :data:`RUNNER_DISK_BYTES` in at
most :data:`RUNNER_FILES` entries across its writable directories, else the judge kills it.

Behind the walls a runner can write two directories of the machine's disk (:mod:`.sandbox`): its
scratch directory and its program's kernel cache, which outlives the check (a week unused,
``sandbox.prune_kernel_caches``).  The file-size limit caps one file at a GiB, not how many, so a
program could fill the disk there (or its inodes, with empty files), and every later write on the
machine would fail: the verdict cache, run directories, an eval's results.  A thread of the
judge's (:class:`DiskWatch`) adds up the blocks (not the sizes: a sparse file takes none) and the
entries of both trees every :data:`DISK_POLL_S`; a runner past either bound is killed (its
request fails as the program's), and its kernel cache is emptied when the runner is closed.
Between two looks a runner writes at most what the disk takes in :data:`DISK_POLL_S`.

Not covered: a GPU runner's /dev/shm is the machine's (CUDA IPC needs it shared), which is memory
rather than disk; and below the namespaces' walls (``CODA_SANDBOX=uid`` or ``none``, or a judge that
is not root) the runner can write wherever its user can.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from coda_agent.verifier.strays import kill_group

RUNNER_DISK_BYTES = 2 << 30  # an honest runner's caches and cubins take megabytes
RUNNER_FILES = 100_000
DISK_POLL_S = 0.25


def usage(dirs: Sequence[str], max_entries: int = RUNNER_FILES) -> tuple[int, int]:
    """(bytes of disk blocks, entries) under ``dirs``, symlinks not followed; the count stops just
    past ``max_entries``.  What the judge cannot read counts nothing."""
    total = entries = 0
    stack = list(dirs)
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        return total, entries
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total, entries


class DiskWatch:
    """Kills process group ``pid`` once ``dirs`` hold more than :data:`RUNNER_DISK_BYTES` or
    :data:`RUNNER_FILES` entries; :attr:`over` then says what it found."""

    def __init__(self, dirs: Sequence[str], pid: int):
        self.dirs, self.pid = list(dirs), pid
        self.over: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(DISK_POLL_S):
            used, entries = usage(self.dirs)
            if used <= RUNNER_DISK_BYTES and entries <= RUNNER_FILES:
                continue
            self.over = (f"the judge killed it: it wrote {used / 2**30:.1f} GiB in {entries} files and folders "
                         f"to its scratch directory and kernel cache, past the {RUNNER_DISK_BYTES / 2**30:.0f} GiB "
                         f"in {RUNNER_FILES} a runner may write (a program writes no files)")
            kill_group(self.pid)
            return

    def stop(self) -> None:
        self._stop.set()
