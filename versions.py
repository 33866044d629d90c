"""What software a verdict, a tuned config or a recorded run depends on.

A leaf module (it imports nothing from the package but its version string),
so cache keys and run records in every layer read versions the same way.
:func:`versions` gives installed distributions by name; :func:`environment`
adds the Python, the CUDA and the GPU a run record names.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Iterable

from coda_agent import __version__

# The libraries a kernel's behaviour depends on: every cache key names them.
KERNEL_LIBRARIES = ("coda-agent", "quack-kernels", "nvidia-cutlass-dsl", "torch")
# What a run record names beside them: the libraries a run may have used.
ENVIRONMENT = (*KERNEL_LIBRARIES, "triton", "openai", "liger-kernel")
ABSENT = "absent"


def versions(dists: Iterable[str] = KERNEL_LIBRARIES) -> dict[str, str]:
    """``{distribution: installed version}``, :data:`ABSENT` for one not installed.
    coda-agent run from a checkout that is not pip-installed (the GPU machine's
    PYTHONPATH) reports the package's own version."""
    out = {}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = __version__ if dist == "coda-agent" else ABSENT
    return out


def environment(dists: Iterable[str] = ENVIRONMENT) -> dict[str, str | None]:
    """:func:`versions` of ``dists`` plus ``python``, torch's ``cuda`` (None in a
    CPU build) and the ``gpu`` ("none" without one)."""
    out: dict[str, str | None] = {"python": platform.python_version(), **versions(dists)}
    try:
        import torch  # here, not at the top: run records are written by commands that need no torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as e:  # noqa: BLE001 - a broken torch must not stop a run from being recorded
        out["gpu"] = f"unknown ({type(e).__name__})"
    return out
