from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .gen_flaky import ensure as _ensure_flaky

# the gRPC tests' messages, generated from grpc/flaky.proto before any test module imports them
_ensure_flaky()


@dataclass
class Reply:
    """One scripted response: status, headers, and a delay before answering."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    body: bytes = b"ok"
    #: seconds between the body's bytes (a trickling server)
    trickle: float = 0.0
    #: close the connection after half the body
    cut: bool = False


@dataclass
class Seen:
    path: str
    method: str
    at: float
    headers: dict[str, str]


class Server:
    """A real HTTP server on 127.0.0.1 answering each path from a script (then repeating the
    script's last reply)."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Reply | Callable[[], Reply]]] = {}
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                with outer.lock:
                    outer.seen.append(Seen(self.path, self.command, time.monotonic(), dict(self.headers)))
                    script = outer.scripts.get(self.path.split("?")[0], [Reply(404)])
                    item = script.pop(0) if len(script) > 1 else script[0]
                reply = item() if callable(item) else item
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                elif self.headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:  # read the chunked body to its end
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        self.rfile.read(size + 2)
                        if size == 0:
                            break
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(reply.body)))
                    self.end_headers()
                    if reply.cut:
                        self.wfile.write(reply.body[: len(reply.body) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                    elif reply.trickle:
                        for i in range(len(reply.body)):
                            self.wfile.write(reply.body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(reply.trickle)
                    else:
                        self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass

            do_GET = _handle
            do_POST = _handle
            do_PUT = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, path: str, *replies: Reply | Callable[[], Reply]) -> None:
        with self.lock:
            self.scripts[path] = list(replies)

    def hits(self, path: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.path.split("?")[0] == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.close()
