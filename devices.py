"""Which GPUs this process may use.  A leaf module: it imports nothing from the package."""

from __future__ import annotations

import os


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else every CUDA device."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch  # here: a process that never asks needs no torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU, not a crash
        return []
