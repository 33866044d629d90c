"""Moving tensors between the runner and the judge on one GPU, with CUDA IPC.

Ownership runs one way: the **runner owns every buffer** that crosses (the
input buffers the judge fills, the outputs the program returns); the judge
only imports runner memory, and never exports its own.  An IPC handle opens a
whole ``cudaMalloc`` allocation, which under PyTorch's caching allocator is a
segment holding many tensors: exporting a judge tensor would hand the runner
its neighbours (the pristine inputs, the reference outputs).

The runner describes a tensor as ``{"handle": hex, "offset": bytes}``; the
judge builds its view from that and from the dtype and shape the *task*
declares (:meth:`Imports.tensor`), after checking against the driver, not the
runner, that the bytes lie inside the opened allocation.  Imported views are
valid until :meth:`Imports.close`; the judge copies what it keeps into its own
memory first.

The driver API is called through ctypes (``libcuda.so.1``), the stable C ABI;
PyTorch's own IPC path (``torch.multiprocessing.reductions``) also shares a
reference counter in a file the producer names, which a hostile runner could
point anywhere.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import torch

from coda_agent.verifier.wire import TORCH_DTYPES, WireError, nbytes

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
# __cuda_array_interface__ has no bfloat16: views are built as same-width integers.
_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class CudaError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, size_t = ctypes.c_uint64, ctypes.c_size_t
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(size_t), u64]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _call(name: str, *args: Any) -> None:
    lib = _driver()
    rc = getattr(lib, name)(*args)
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise CudaError(f"{name}: {msg.value.decode() if msg.value else rc}")


def _range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address ``ptr``, as the driver knows it."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    return base.value, size.value


# --------------------------------------------------------------------------- the runner's side

def export(t: torch.Tensor) -> dict[str, Any]:
    """The runner's side: a tensor as its allocation's handle and its offset in it.  Asked of
    the driver every time: the caching allocator may free a segment and get another at the
    same address, whose handle differs."""
    if t.numel() == 0:
        return {"handle": "", "offset": 0}
    base, _ = _range(t.data_ptr())
    h = _Handle()
    _call("cuIpcGetMemHandle", ctypes.byref(h), ctypes.c_uint64(base))
    return {"handle": ctypes.string_at(ctypes.addressof(h), HANDLE_BYTES).hex(), "offset": t.data_ptr() - base}


PROBE_LEN = 16  # int32 values 0..15: what a GPU runner exports before it accepts any program


def probe() -> tuple[torch.Tensor, dict[str, Any]]:
    """The runner's side of the start-up probe: a tensor (kept alive by the caller while the
    judge reads it) and its description."""
    t = torch.arange(PROBE_LEN, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    return t, export(t)


# --------------------------------------------------------------------------- the judge's side

def probe_reads_back(desc: Any) -> bool:
    """The judge's side of the start-up probe: whether the runner's tensor reads as it should."""
    with Imports() as imports:
        got = imports.tensor(desc, "int32", [PROBE_LEN]).clone()
    return torch.equal(got.cpu(), torch.arange(PROBE_LEN, dtype=torch.int32))


class Imports:
    """Runner allocations the judge has opened; :meth:`close` unmaps them all."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, int]] = {}  # handle hex -> (base in this process, size)

    def tensor(self, desc: Any, dtype: str, shape: list[int]) -> torch.Tensor:
        """A view of ``dtype``/``shape`` at the runner's ``desc``; WireError if it does not fit."""
        if not isinstance(desc, dict) or not isinstance(desc.get("handle"), str) \
                or type(desc.get("offset")) is not int:
            raise WireError("a device tensor without a valid handle and offset")
        size = nbytes(dtype, shape)
        if size == 0:
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="cuda")
        base, length = self._opened(desc["handle"])
        offset = desc["offset"]
        width = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        if offset < 0 or offset % width or offset + size > length:
            raise WireError(f"a {size}-byte tensor at offset {offset} of a {length}-byte allocation")
        return torch.as_tensor(_View(base + offset, size // width, width), device="cuda") \
            .view(TORCH_DTYPES[dtype]).view(shape)

    def _opened(self, handle_hex: str) -> tuple[int, int]:
        if handle_hex not in self._open:
            try:
                raw = bytes.fromhex(handle_hex)
            except ValueError:
                raise WireError("a device handle that is not hex") from None
            if len(raw) != HANDLE_BYTES:
                raise WireError(f"a {len(raw)}-byte device handle ({HANDLE_BYTES} expected)")
            h = _Handle()
            ctypes.memmove(ctypes.addressof(h), raw, HANDLE_BYTES)
            ptr = ctypes.c_uint64()
            # cuIpcOpenMemHandle needs a current context on this thread; a runtime call makes the
            # primary one current (the judge may not have touched CUDA yet: a runner's probe)
            torch.cuda.synchronize()
            try:
                _call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS)
            except CudaError as e:
                raise WireError(f"the runner's device handle does not open ({e})") from None
            self._open[handle_hex] = _range(ptr.value)
        return self._open[handle_hex]

    def close(self) -> None:
        torch.cuda.synchronize()  # nothing of the judge's may still read or write these
        for base, _ in self._open.values():
            _call("cuIpcCloseMemHandle", ctypes.c_uint64(base))
        self._open.clear()

    def __enter__(self) -> "Imports":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _View:
    """A bare ``__cuda_array_interface__`` over imported memory."""

    def __init__(self, ptr: int, count: int, width: int):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": _TYPESTR[width],
                                         "data": (ptr, False), "version": 2}
