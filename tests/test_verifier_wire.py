"""What crosses from the runner to the judge is read as untrusted input: the channel's framing
(coda_agent.verifier.wire), the judge's reading of replies (remote, calls) and of device
handles (cuda_ipc).  A hostile runner is played by the other end of a socket pair."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
import torch

from coda_agent.verifier.cuda_ipc import Imports
from coda_agent.verifier.program import CandidateError
from coda_agent.verifier.remote import Remote
from coda_agent.verifier.wire import (Channel, PeerGone, Timeout, WireError, tensor_bytes, tensor_from_blob)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield Channel(a), b
    a.close()
    b.close()


def test_a_message_round_trips_with_its_blobs(pair):
    judge, raw = pair
    other = Channel(raw)
    t = torch.randn(3, 5).to(torch.bfloat16)
    other.send({"op": "x", "n": 1}, [tensor_bytes(t), b"abc"])
    header, blobs = judge.recv(timeout=5, max_blob_bytes=1 << 10)
    assert header["op"] == "x" and header["blobs"] == [30, 3]
    assert torch.equal(tensor_from_blob(blobs[0], "bf16", [3, 5]), t)


def _raw(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("frame,why", [
    (struct.pack(">I", 64 << 20), "message header"),
    (_raw(b"notjson"), "not JSON"),
    (_raw(b"[]"), "not a JSON object"),
    (_raw(b"[" * 10000 + b"1" + b"]" * 10000), "not JSON"),
    (_raw(b'{"blobs": [1073741824]}'), "at most"),
    (_raw(b'{"blobs": ["1"]}'), "blob sizes"),
])
def test_malformed_messages_are_refused_before_they_are_read(pair, frame, why):
    judge, raw = pair
    raw.sendall(frame)
    with pytest.raises(WireError, match=why):
        judge.recv(timeout=5, max_blob_bytes=1 << 20)


def test_silence_and_a_closed_channel(pair):
    judge, raw = pair
    with pytest.raises(Timeout):
        judge.recv(timeout=0.2)
    raw.sendall(struct.pack(">I", 100) + b"{")  # half a message, then gone
    raw.close()
    with pytest.raises(PeerGone):
        judge.recv(timeout=5)


def test_a_blob_of_the_wrong_length_is_refused():
    with pytest.raises(WireError, match="expected"):
        tensor_from_blob(b"\0" * 10, "bf16", [3, 2])
    assert tensor_from_blob(b"", "fp32", [0, 4]).shape == (0, 4)


class _Hostile:
    """A runner's end that answers every request with a scripted reply."""

    def __init__(self, sock: socket.socket, replies: list[bytes]):
        self.sock, self.replies = sock, replies
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for reply in self.replies:
            (n,) = struct.unpack(">I", self.sock.recv(4))
            while n:
                n -= len(self.sock.recv(n))
            self.sock.sendall(reply)


def _remote(sock: socket.socket) -> Remote:
    remote = Remote.__new__(Remote)  # no process: the channel is all a request uses
    remote.channel, remote.dead, remote.exit_status, remote.proc = Channel(sock), False, 0, None
    remote.log = type("Log", (), {"text": lambda self: ""})()
    return remote


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def test_an_error_the_runner_reports_is_the_candidates_and_bounded(pair):
    judge, raw = pair
    _Hostile(raw, [_frame({"error": {"message": "x" * 100_000, "line": "seven", "log": ["not text"]}})])
    with pytest.raises(CandidateError) as e:
        _remote(judge.sock).request({"op": "call"}, timeout=5)
    assert len(e.value.message) <= 4000 and e.value.line is None and isinstance(e.value.log, str)


def test_garbage_from_the_runner_is_a_rejection_never_a_crash(pair):
    judge, raw = pair
    _Hostile(raw, [struct.pack(">I", 5) + b"{{{{{"])
    remote = _remote(judge.sock)
    remote.kill = lambda: None
    with pytest.raises(CandidateError, match="reply to `call` is unusable"):
        remote.request({"op": "call"}, timeout=5)


@pytest.mark.parametrize("desc,why", [
    (None, "without a valid handle"),
    ({"handle": 5, "offset": 0}, "without a valid handle"),
    ({"handle": "zz", "offset": 0}, "not hex"),
    ({"handle": "00" * 10, "offset": 0}, "10-byte device handle"),
    ({"handle": "00" * 64, "offset": 1.5}, "without a valid handle"),
])
def test_device_handles_are_validated_before_the_driver_sees_them(desc, why):
    with pytest.raises(WireError, match=why):
        Imports().tensor(desc, "bf16", [4, 4])
