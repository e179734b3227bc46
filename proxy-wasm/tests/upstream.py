"""A flaky HTTP upstream for the Envoy tests, on 127.0.0.1.

Paths (query parameters in brackets):
  /ok                          200
  /flaky?id=X&fail=N[&ra=S]    the first N requests for X answer 503 (with Retry-After: S), then 200
  /overloaded?id=X             503 marked `x-envoy-overloaded: true` (a shedding upstream)
  /slowfirst?id=X&ms=N         the first request for X answers 200 after N ms, later ones at once
  /down                        503 while down (POST /_ctl/down?on=0|1 switches; starts down)
  /fallback                    200 "from the fallback cluster"
  /_ctl/count?id=X             requests seen for X (for /down and /ok: the path), as text
  /_ctl/times?id=X             arrival times of X's requests (monotonic seconds), comma-separated
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: dict[str, list[float]] = {}
        self.down = True
        self.headers: dict[str, list[dict[str, str]]] = {}

    def seen(self, key: str, headers: dict[str, str]) -> int:
        with self.lock:
            t = self.times.setdefault(key, [])
            t.append(time.monotonic())
            self.headers.setdefault(key, []).append(headers)
            return len(t)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def answer(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        s = self.state
        hdrs = {k.lower(): v for k, v in self.headers.items()}
        if url.path == "/_ctl/count":
            with s.lock:
                self.answer(200, str(len(s.times.get(q["id"], []))))
            return
        if url.path == "/_ctl/times":
            with s.lock:
                self.answer(200, ",".join(f"{t:.6f}" for t in s.times.get(q["id"], [])))
            return
        if url.path == "/_ctl/headers":
            with s.lock:
                seen = s.headers.get(q["id"], [])
                self.answer(200, "\n".join(h.get(q["name"], "-") for h in seen))
            return
        if url.path == "/ok":
            s.seen(q.get("id", "/ok"), hdrs)
            self.answer(200, "ok\n")
            return
        if url.path == "/flaky":
            n = s.seen(q["id"], hdrs)
            if n <= int(q.get("fail", "0")):
                extra = {"retry-after": q["ra"]} if "ra" in q else {}
                self.answer(503, "flaky\n", extra)
            else:
                self.answer(200, "recovered\n")
            return
        if url.path == "/slowfirst":
            if s.seen(q["id"], hdrs) == 1:
                time.sleep(int(q["ms"]) / 1000)
                try:
                    self.answer(200, "slow\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the router cancelled this attempt when the hedge won
            else:
                self.answer(200, "fast\n")
            return
        if url.path == "/overloaded":
            s.seen(q["id"], hdrs)
            self.answer(503, "shedding\n", {"x-envoy-overloaded": "true"})
            return
        if url.path == "/down":
            s.seen(q.get("id", "/down"), hdrs)
            self.answer(503 if s.down else 200, "down\n" if s.down else "up\n")
            return
        if url.path == "/fallback":
            self.answer(200, "from the fallback cluster\n")
            return
        self.answer(404, "no such path\n")

    def do_POST(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("content-length", "0"))
        if length:
            self.rfile.read(length)
        if url.path == "/_ctl/down":
            self.state.down = q.get("on", "1") == "1"
            self.answer(200, "ok\n")
            return
        self.answer(404, "no such path\n")


def start() -> tuple[ThreadingHTTPServer, State]:
    state = State()
    handler = type("H", (Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state
