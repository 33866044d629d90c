"""A scripted OpenAI-compatible Chat Completions server for the agent tests.

It speaks real HTTP on 127.0.0.1 so the tests exercise the real ``openai``
client (retries, status codes, headers) without a network.  Script it with a
queue of steps; every request body is recorded::

    server.reply("```python\\n...\\n```", prompt_tokens=100, completion_tokens=50)
    server.status(429, headers={"Retry-After": "0"})
    gate = server.hang()          # holds the request until gate.set() (or the client dies)
    server.fallback = ("status", 500, {}, None)   # what to answer when the queue is empty

A CLI run in a subprocess talks to the same server (it lives in the pytest
process), which is how the kill-and-resume test holds a request open.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedServer:
    def __init__(self) -> None:
        self.steps: "queue.Queue[tuple]" = queue.Queue()
        self.requests: list[dict[str, Any]] = []
        self.fallback: tuple = ("status", 500, {}, {"error": {"message": "script exhausted"}})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def start(self) -> "ScriptedServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ------------------------------------------------------------------ script

    def reply(self, text: str, prompt_tokens: int = 100, completion_tokens: int = 50,
              finish_reason: str = "stop") -> None:
        self.steps.put(("reply", text, prompt_tokens, completion_tokens, finish_reason))

    def status(self, code: int, headers: dict[str, str] | None = None, body: dict | None = None) -> None:
        self.steps.put(("status", code, headers or {}, body or {"error": {"message": f"scripted {code}"}}))

    def hang(self) -> threading.Event:
        gate = threading.Event()
        self.steps.put(("hang", gate))
        return gate

    def messages(self, i: int = -1) -> list[dict[str, str]]:
        return self.requests[i]["messages"]

    # ------------------------------------------------------------------ HTTP

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                body["_path"], body["_auth"] = self.path, self.headers.get("Authorization")
                server.requests.append(body)
                try:
                    step = server.steps.get_nowait()
                except queue.Empty:
                    step = server.fallback
                if step[0] == "hang":
                    step[1].wait(timeout=60)
                    step = ("status", 503, {}, {"error": {"message": "released"}})
                try:
                    if step[0] == "status":
                        self._send(step[1], step[3], step[2])
                    else:
                        _, text, pt, ct, finish = step
                        self._send(200, {
                            "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                            "created": 0, "model": body.get("model", "test-model"),
                            "choices": [{"index": 0, "finish_reason": finish,
                                         "message": {"role": "assistant", "content": text}}],
                            "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}})
                except (BrokenPipeError, ConnectionResetError):  # the client was killed meanwhile
                    pass

            def _send(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        return Handler
