"""Where a profiled training step's device time goes: kernels by class (GEMM, attention,
other), the time inside the catalogue's launches, the kernels with the most time, and where
the device sits idle.

A kernel's class is read from its name (:func:`classify`); the catalogue's launches are the
``coda::`` ranges around them (:func:`split_step`).  ``bench/train_step.py`` and
``bench/fp8.py`` read their profiles through this module.
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION = ("flash", "fmha", "attention", "sdpa", "scaled_dot")
GEMM = ("gemm", "matmul", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "_mm_", "tem_fused_mm")


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if "passkernel" in low:  # the catalogue's tile-pass kernel: a CuTeDSL kernel, memory-bound, no MMA
        return "other"
    return "gemm" if any(k in low for k in GEMM) else "other"


def split_step(step: Any, device: str, top: int = 30) -> tuple[dict[str, float], dict[str, Any]]:
    """One step under torch.profiler: kernel ms by class and the ms inside catalogue launches,
    and where it went: the ``top`` kernels by device time, and every catalogue launch by name."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0, "coda_gemm": 0.0, "coda_aux": 0.0}
    by_kernel: dict[str, list[float]] = {}
    by_launch: dict[str, list[float]] = {}
    events = prof.events()
    kernels = device_kernels(events)
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3
        split[classify(e.name)] += ms
        _tally(by_kernel, f"{classify(e.name)}: {e.name[:160]}", ms)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA or not e.name.startswith("coda::"):
            continue
        if not _inside_coda(e):
            split["coda_gemm" if e.name.startswith("coda::gemm") else "coda_aux"] += e.device_time_total / 1e3
        # The launch's own range (coda::gemm::EPILOGUE) sits inside the custom op's event
        # (coda::gemm) when the op goes through the dispatcher, as in a compiled graph, and the
        # profiler gives the kernels' device time to the op's event.
        if e.name.count("::") == 2 and not _inside_coda(e, launches_only=True):
            _tally(by_launch, e.name, _outermost_coda(e).device_time_total / 1e3)
    split["kernels"] = split["gemm"] + split["attention"] + split["other"]
    split["fused_share"] = (split["coda_gemm"] + split["coda_aux"]) / split["kernels"] if split["kernels"] else 0.0
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])
    where = {"top_kernels": [{"kernel": k, "calls": int(n), "ms": round(ms, 3)} for k, (n, ms) in ranked[:top]],
             "coda_launches": {k: {"calls": int(n), "ms": round(ms, 3)}
                               for k, (n, ms) in sorted(by_launch.items(), key=lambda kv: -kv[1][1])},
             "idle": idle_gaps([(e.time_range.start, e.time_range.end, e.name) for e in kernels])}
    return {k: round(v, 3) for k, v in split.items()}, where


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 10, min_us: float = 20.0) -> dict[str, Any]:
    """Where the device runs nothing between a step's first kernel and its last: the idle ms in
    all, and the ``top`` longest gaps of at least ``min_us`` with the kernels on either side
    (which name the phase: a host-bound stretch shows as many gaps between short kernels).
    ``kernels``: (start_us, end_us, name), overlapping ones allowed (streams)."""
    idle, gaps, busy_until, last = 0.0, [], None, ""
    for start, end, name in sorted(kernels):
        if busy_until is not None and start > busy_until:
            idle += start - busy_until
            if start - busy_until >= min_us:
                gaps.append((start - busy_until, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"ms": round(idle / 1e3, 3), "gaps": len(gaps), "ms_in_gaps": round(sum(g[0] for g in gaps) / 1e3, 3),
            "longest": [{"us": round(us, 1), "after": a[:100], "before": b[:100]} for us, a, b in gaps[:top]]}


def _tally(table: dict[str, list[float]], key: str, ms: float) -> None:
    calls_ms = table.setdefault(key, [0, 0.0])
    calls_ms[0] += 1
    calls_ms[1] += ms


def device_kernels(events: Any) -> list[Any]:
    """The kernels among a profile's device events, each once.  A record_function range (the
    catalogue's ``coda::`` launches) also appears on the device timeline as a user annotation
    spanning its kernels: counting it adds the range's span to the kernels it holds (H200 run 12:
    the CODA rows' kernel time came to 1.8x the step).  The profiler can also report a kernel the
    DSL launches more than once; one kernel has one name and one start."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation or e.name.startswith("coda::"):
            continue
        key = (e.name, e.time_range.start, e.time_range.end)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _outermost_coda(e: Any) -> Any:
    while e.cpu_parent is not None and e.cpu_parent.name.startswith("coda::"):
        e = e.cpu_parent
    return e


def _inside_coda(e: Any, launches_only: bool = False) -> bool:
    """Whether a catalogue op or range (only a launch's range, ``coda::KIND::NAME``, with
    ``launches_only``) encloses ``e``."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("coda::") and (not launches_only or parent.name.count("::") == 2):
            return True
        parent = parent.cpu_parent
    return False
