"""The judge <-> runner channel: length-prefixed JSON headers and raw byte blobs.

Nothing that crosses it is ever unpickled: a pickle from the runner would be
code execution in the judge.  A message is a 4-byte big-endian header length,
a UTF-8 JSON object (at most :data:`MAX_HEADER` bytes) whose ``"blobs"`` field
lists the sizes of the raw byte strings that follow.  The judge reads every
message from the runner as untrusted input: sizes are checked against the
caller's limit before anything is read, the JSON is parsed with those limits,
and tensors are rebuilt by :func:`tensor_from_blob` from the dtype and shape
the *task* declares, never from what the runner says.

:class:`WireError` means the peer sent something unusable or went quiet past a
deadline; :class:`PeerGone` that it closed the channel (the runner died).
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from typing import Any, Sequence

import torch

MAX_HEADER = 4 << 20
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "int32": torch.int32, "int64": torch.int64,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class WireError(RuntimeError):
    """The peer sent something unusable, or nothing before the deadline."""


class PeerGone(WireError):
    """The peer closed the channel (for the runner: it died or exited)."""


class Timeout(WireError):
    """No complete message before the deadline."""


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, header: dict[str, Any], blobs: Sequence[bytes | memoryview] = ()) -> None:
        body = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
        try:
            self.sock.sendall(struct.pack(">I", len(body)) + body)
            for b in blobs:
                self.sock.sendall(b)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerGone(f"the peer closed the channel ({e})") from None

    def recv(self, timeout: float | None, max_blob_bytes: int = 0) -> tuple[dict[str, Any], list[bytes]]:
        """One message; raises :class:`WireError` if it is malformed, larger than allowed, or
        not complete within ``timeout`` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (size,) = struct.unpack(">I", self._read(4, deadline))
        if size > MAX_HEADER:
            raise WireError(f"a {size}-byte message header (the limit is {MAX_HEADER})")
        header = parse_json(self._read(size, deadline))
        sizes = header.get("blobs", [])
        if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
            raise WireError("the message's blob sizes are not a list of byte counts")
        if sum(sizes) > max_blob_bytes:
            raise WireError(f"the message announces {sum(sizes)} bytes of tensors; at most "
                            f"{max_blob_bytes} were expected")
        return header, [self._read(n, deadline) for n in sizes]

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout("no complete reply before the deadline")
                self.sock.settimeout(left)
            try:
                k = self.sock.recv_into(view[got:], min(n - got, 1 << 24))
            except socket.timeout:
                raise Timeout("no complete reply before the deadline") from None
            except (ConnectionResetError, OSError) as e:
                raise PeerGone(f"the channel failed ({e})") from None
            if k == 0:
                raise PeerGone("the peer closed the channel")
            got += k
        self.sock.settimeout(None)
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise WireError(f"a message that is not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise WireError("a message that is not a JSON object")
    return obj


# --------------------------------------------------------------------------- tensors

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in row-major order."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def tensor_from_blob(blob: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor of exactly ``dtype`` and ``shape`` (the caller's, e.g. the task's) from
    ``blob``; a blob of any other length is a :class:`WireError`."""
    want = nbytes(dtype, shape)
    if len(blob) != want:
        raise WireError(f"{len(blob)} bytes for a {dtype} tensor of shape {list(shape)} ({want} expected)")
    if want == 0:
        return torch.empty(tuple(shape), dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(bytearray(blob), dtype=TORCH_DTYPES[dtype]).reshape(tuple(shape))


def describe(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": DTYPE_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}

