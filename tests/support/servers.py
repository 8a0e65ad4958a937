"""Small local servers the tests start themselves: a Chroma server and an OpenAI-compatible API."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from memory_pipelines.lib.infra.services import chroma_heartbeat, chroma_run_command, free_port

__all__ = ["FakeLLM", "chroma_server", "free_port"]


@contextmanager
def chroma_server(path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`chroma run` on 127.0.0.1 (the command and heartbeat ensure_services uses); yields its URL
    and process, stops it afterwards (docs/performance.md has how long a start takes)."""
    port = free_port()
    proc = subprocess.Popen(
        chroma_run_command(path, port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not chroma_heartbeat(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("chroma server did not start")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)


class FakeLLM:
    """An OpenAI-compatible /v1/chat/completions endpoint whose behaviour a test switches."""

    def __init__(self) -> None:
        self.mode = "ok"  # ok | garbage | error | empty
        self.requests: list[dict[str, Any]] = []
        self.respond: Callable[[str], str] | None = None  # the answer to a prompt, when a test decides it
        llm = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                llm.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                if self.path != "/v1/chat/completions" or llm.mode == "error":
                    self._send(500, b'{"error": "boom"}')
                elif llm.mode == "garbage":
                    self._send(200, b"<html>not json</html>")
                else:
                    prompt = body["messages"][-1]["content"]
                    facts = prompt.count("\n") + 1
                    content = "" if llm.mode == "empty" else f"LLM summary of {facts} facts"
                    if llm.respond is not None and llm.mode == "ok":
                        content = llm.respond(prompt)
                    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
                    self._send(200, json.dumps(answer).encode())

            def _send(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeLLM:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
