"""Removing what a program leaves on disk: :func:`remove_tree`, which never raises and takes any
tree.

A runner's scratch folder and its kernel cache are the program's to fill, and the judge removes
both (after every check, and every judge prunes old caches as it starts).  ``shutil.rmtree``
recurses once per level and holds a descriptor per level: a few thousand nested folders make it
raise RecursionError, which ``ignore_errors`` does not cover, so one program could stop every
later judge on the machine from starting (``tests/bad_programs/files/deep_tree.py``).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path


def remove_tree(top: str | Path) -> None:
    """Remove a directory a program wrote (a runner's scratch, its kernel cache), whatever it
    holds, and never raise.  ``shutil.rmtree`` recurses once per level and holds a descriptor
    per level: a program that nests a few thousand directories made it raise RecursionError
    (``ignore_errors`` does not cover it) in the judge, at the end of every check and at every
    judge's start (``sandbox.prune_kernel_caches``).  Here each directory found below another is
    first renamed up to ``top`` itself, so no path grows deeper than two levels and at most two
    descriptors are open; symlinks are removed, never followed.  What cannot be removed stays."""
    try:
        top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        try:
            os.unlink(top)  # a file or a symlink where a directory was expected
        except OSError:
            pass
        return
    queue = collections.deque()
    moved = 0
    try:
        with os.scandir(top_fd) as entries:
            queue.extend((e.name, e.is_dir(follow_symlinks=False)) for e in entries)
        while queue:  # each directory opened once: its subdirectories join the queue at the top
            name, is_dir = queue.popleft()
            if not is_dir:
                _unlink_at(name, top_fd)
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top_fd)
            except OSError:
                continue
            try:
                with os.scandir(fd) as entries:
                    inner = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, child_is_dir in inner:
                    if not child_is_dir:
                        _unlink_at(child, fd)
                        continue
                    moved += 1
                    new = f".coda-removing-{moved}"
                    try:
                        os.rename(child, new, src_dir_fd=fd, dst_dir_fd=top_fd)
                        queue.append((new, True))
                    except OSError:
                        pass
            except OSError:
                pass
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=top_fd)
            except OSError:
                pass
    except OSError:
        pass
    finally:
        os.close(top_fd)
    try:
        os.rmdir(top)
    except OSError:
        pass


def _unlink_at(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
