"""The runner: the one process in which a candidate program runs.

It holds no verdict, no reference, no seeds and no path to anything the
verdict is written on: it receives tensors on its channel (:mod:`.wire`),
calls the program (:mod:`.program`) and sends back what the program returned,
with timings when asked.  The judge (:mod:`.judge`) starts it behind walls
(:mod:`.sandbox`) and believes nothing it says that the judge cannot check.

Two ways in: ``python -m coda_agent.verifier.runner FD PLAN`` (a fresh
process: the GPU path, since CUDA does not survive ``fork``), or
:func:`serve` in a child the zygote forked (:mod:`.zygote`: the CPU path,
which saves the catalogue's import per program).  Either way
:func:`sandbox.enter` runs before anything untrusted.

On the CPU tensors travel as bytes.  On the GPU the runner owns every buffer
that crosses: ``alloc`` makes the input buffers the judge fills, results stay
alive in numbered slots until the judge ``release``s them, and both are
described by CUDA IPC handles (:mod:`.cuda_ipc`).
"""

from __future__ import annotations

import contextlib

import hashlib
import json
import os
import socket
import sys
import time
from typing import Any, Callable

import torch

from coda_agent.verifier import cuda_ipc, sandbox
from coda_agent.verifier import program as prog
from coda_agent.verifier.program import CandidateError, Contract
from coda_agent.verifier.wire import TORCH_DTYPES, Channel, PeerGone, describe, tensor_bytes, tensor_from_blob

MAX_REQUEST_BYTES = 1 << 34  # what the judge may send (it is trusted; this is a sanity bound)
BLOCK_ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


class State:
    def __init__(self, device: str):
        self.device = device
        self.contract: Contract | None = None
        self.programs: dict[str, tuple[Any, str]] = {}  # tag -> (module, lowering)
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.slots: dict[int, dict[str, torch.Tensor]] = {}
        self.timer: Any = None  # a FlushedCall, made on the first timed call


# --------------------------------------------------------------------------- requests

def _load(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    from coda_agent.primitives import lowering

    st.contract = Contract.from_json(req["contract"])
    with lowering(req["lowering"]):
        mod = prog.load(req["source"], req["tag"], req.get("python_rules", True))
    st.programs[req["tag"]] = (mod, req["lowering"])
    return {"loaded": req["tag"]}, []


def _tensors(st: State, req: dict, blobs: list[bytes]) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The call's inputs and upstream gradients: from the blobs (CPU) or a buffer set (GPU)."""
    if "set" in req:
        bufs = st.buffers[req["set"]]
        inputs = {k: bufs[k] for k in st.contract.inputs}
        grads = {k: bufs[k] for k in bufs if k not in inputs} if req.get("backward") else None
        return inputs, grads
    items = iter(zip(req["tensors"], blobs))
    got = {d["name"]: tensor_from_blob(b, d["dtype"], d["shape"]) for d, b in items}
    inputs = {k: got[k] for k in st.contract.inputs}
    grads = {k: v for k, v in got.items() if k not in inputs} if req.get("backward") else None
    return inputs, grads


def _run(st: State, req: dict, inputs: dict, grads: dict | None, audit: Any = None) -> dict[str, torch.Tensor]:
    from coda_agent.primitives import lowering
    from coda_agent.primitives.lowering import padded_lanes

    mod, lowering_name = st.programs[req["tag"]]
    # padded: the reference lowering folds a ragged tile's padded lanes as the kernel does
    with lowering(lowering_name), padded_lanes() if req.get("padded") else contextlib.nullcontext():
        results = prog.call(st.contract, mod, inputs, grads, audit, req.get("needs"), req.get("params"))
    return prog.check_results(st.contract, results, req["shapes"], inputs, grads, st.device)


def _reply_results(st: State, results: dict[str, torch.Tensor], slot: int | None) -> tuple[list[dict], list]:
    if st.device == "cuda":
        st.slots[slot] = results
        return [{"name": k, **describe(v), **cuda_ipc.export(v)} for k, v in results.items()], []
    return [{"name": k, **describe(v)} for k, v in results.items()], [tensor_bytes(v) for v in results.values()]


def _call(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    inputs, grads = _tensors(st, req, blobs)
    if req.get("poison"):
        prog.poison_allocator(prog.call_bytes([*inputs.values(), *(grads or {}).values()], req["shapes"]))
    mod, _ = st.programs[req["tag"]]
    audit = prog.TorchAudit(mod.__file__, prog.epilogue_codes(mod)) if req.get("audit") else None
    results = _run(st, req, inputs, grads, audit)
    if st.device == "cuda":
        torch.cuda.synchronize()
    descs, out = _reply_results(st, results, req.get("slot"))
    reply: dict[str, Any] = {"results": descs}
    if st.device == "cpu":  # the judge compares these with its own copies' digests
        reply["digests"] = {k: hashlib.sha256(tensor_bytes(v)).hexdigest()
                            for k, v in {**inputs, **(grads or {})}.items()}
    if audit is not None and (err := audit.verdict()):
        reply["torch_compute"] = err.to_json()
    return reply, out


def _compile(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    from coda_agent.primitives import compile_only

    st.contract = Contract.from_json(req["contract"])
    # Shape carriers: under the compile lowering kernels depend on shapes and dtypes only.
    # CPU tensors suffice without a GPU; with one, quack's compile path wants CUDA tensors.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    carriers = {d["name"]: torch.empty(d["shape"], dtype=TORCH_DTYPES[d["dtype"]], device=device)
                for d in req["tensors"]}
    inputs = {k: carriers[k] for k in st.contract.inputs}
    grads = {k: v for k, v in carriers.items() if k not in inputs} if req.get("backward") else None
    kernels_json: list[dict] = []
    with compile_only() as kernels:
        try:
            mod = prog.load(req["source"], "compile", req.get("python_rules", True))
            prog.call(st.contract, mod, inputs, grads)
            full = len(kernels)
            for needs in req.get("needs_sets", []):  # a backward's paths for smaller gradient sets
                prog.call(st.contract, mod, inputs, grads, needs=needs)
        except CandidateError as e:
            e.log = prog.trim("\n".join(k.log for k in kernels if k.log) + "\n" + e.log)
            raise
        # Each kernel once: the whole call's, then those only a smaller gradient set compiled.
        seen = {(k.epilogue, k.config) for k in kernels[:full]}
        for i, k in enumerate(kernels):
            if i < full or (k.epilogue, k.config) not in seen:
                seen.add((k.epilogue, k.config))
                kernels_json.append(k.report(prog.trim(k.log)))
    return {"kernels": kernels_json}, []


def _profile(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    from coda_agent.primitives import lowering

    inputs, grads = _tensors(st, req, blobs)
    mod, lowering_name = st.programs[req["tag"]]
    with lowering(lowering_name):
        return prog.profile(st.contract, mod, inputs, grads, req.get("params")), []


def _alloc(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    bufs = {d["name"]: torch.empty(d["shape"], dtype=TORCH_DTYPES[d["dtype"]], device="cuda")
            for d in req["tensors"]}
    st.buffers[req["set"]] = bufs
    torch.cuda.synchronize()
    return {"buffers": {k: cuda_ipc.export(v) for k, v in bufs.items()}}, []


def _free(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    st.buffers.pop(req["set"], None)
    st.slots.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the next shape set, and the judge, need the memory back
    return {"freed": req["set"]}, []


def _release(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    for slot in req["slots"]:
        st.slots.pop(slot, None)
    return {"released": len(req["slots"])}, []


def _time(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    """One timed call (``primitives.timing.FlushedCall``; the judge sets the spin)."""
    from coda_agent.primitives.timing import FlushedCall

    if st.timer is None:
        st.timer = FlushedCall()
    inputs, grads = _tensors(st, req, blobs)
    ms, results = st.timer(lambda: _run(st, req, inputs, grads), req["spin_ms"])
    descs, _ = _reply_results(st, results, req["slot"])
    return {"ms": ms, "results": descs}, []


def _block(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    """Calls back to back on the given buffer sets, the device synchronized before and after:
    the judge times this from outside with its own clock."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    kept = []
    for set_id, slot in zip(req["sets"], req["slots"]):
        inputs, grads = _tensors(st, {**req, "set": set_id}, blobs)
        kept.append((slot, _run(st, req, inputs, grads)))
    enqueued = time.perf_counter() - t0
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    # What slowed the block, for the judge's report (diagnostics, never the verdict's): the host's
    # share of it (near the whole block: the host waited on the device within calls) and the
    # allocator's device calls (a retry frees the cache after a synchronisation of every stream).
    seen = {"host_ms": round(enqueued * 1e3, 3), "block_ms": round((time.perf_counter() - t0) * 1e3, 3),
            **{k: after.get(k, 0) - before.get(k, 0) for k in BLOCK_ALLOCATOR_STATS}}
    return {"results": [_reply_results(st, r, slot)[0] for slot, r in kept], "seen": seen}, []


def _enqueue(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    from coda_agent.primitives.timing import enqueue_ms

    inputs, grads = _tensors(st, req, blobs)
    ms = enqueue_ms(lambda: _run(st, req, inputs, grads))
    return {"host_ms": ms}, []


def _ping(st: State, req: dict, blobs: list[bytes]) -> tuple[dict, list]:
    return {"pong": True}, []


OPS: dict[str, Callable[[State, dict, list[bytes]], tuple[dict, list]]] = {
    "load": _load, "call": _call, "compile": _compile, "profile": _profile, "alloc": _alloc, "free": _free,
    "release": _release, "time": _time, "block": _block, "enqueue": _enqueue, "ping": _ping}


# --------------------------------------------------------------------------- the process

def serve(channel: Channel, walls: sandbox.Walls, device: str, probe: dict | None = None) -> None:
    """Answer the judge's requests until it closes the channel."""
    st = State(device)
    channel.send({"ready": True, "walls": walls.describe(), "pid": os.getpid(), "device": device,
                  **({"probe": probe} if probe is not None else {})})
    while True:
        try:
            req, blobs = channel.recv(None, MAX_REQUEST_BYTES)
        except PeerGone:
            return
        t0 = time.perf_counter()
        try:
            reply, out = OPS[req["op"]](st, req, blobs)
        except CandidateError as e:
            reply, out = {"error": e.to_json()}, []
        except Exception as e:  # noqa: BLE001 - whatever broke, the judge decides what it means
            reply, out = {"error": prog.candidate_error(e, "candidate_", f"the runner's `{req.get('op')}`")
                          .to_json()}, []
        reply["runner_s"] = round(time.perf_counter() - t0, 4)
        channel.send(reply, out)


def start(channel_fd: int, plan: sandbox.Plan, keep: tuple[int, ...]) -> None:
    """Enter the walls, then serve; a runner that cannot build its walls says so and exits."""
    channel = Channel(socket.socket(fileno=channel_fd))
    try:
        walls = sandbox.enter(plan, keep_fds=(channel_fd, *keep))
    except sandbox.SandboxError as e:
        channel.send({"ready": False, "error": str(e)})
        return
    probe, desc = None, None
    if plan.cuda:  # before any program: CUDA must work behind these walls (sandbox.py)
        try:
            probe, desc = cuda_ipc.probe()
        except Exception as e:  # noqa: BLE001 - any failure means these walls and CUDA do not mix
            channel.send({"ready": False, "cuda_failed": True,
                          "error": f"CUDA does not start behind {walls.describe()}: {type(e).__name__}: {e}"})
            return
    serve(channel, walls, "cuda" if plan.cuda else "cpu", desc)


def main(argv: list[str]) -> int:
    fd, plan = int(argv[0]), sandbox.Plan(**json.loads(argv[1]))
    start(fd, plan, keep=())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
