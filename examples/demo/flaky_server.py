#!/usr/bin/env python3
"""A deterministic flaky HTTP server for the cross-language demo (Python stdlib only).

Each client id (the last path segment: GET /demo/<client-id>) gets the same sequence:
503, 429 with Retry-After: 1, 503, then 200 for every later request. So every host,
run under the same policy, meets the same failures in the same order.

    python3 flaky_server.py [--port 0] [--port-file FILE] [--idle-exit SECONDS]

It binds 127.0.0.1 only, writes the port it got to --port-file, and exits by itself after
--idle-exit seconds without a request (default 120), so a demo never leaves it behind.
"""

from __future__ import annotations

import argparse
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEQUENCE: list[tuple[int, dict[str, str]]] = [
    (503, {}),
    (429, {"Retry-After": "1"}),
    (503, {}),
]

_lock = threading.Lock()
_seen: dict[str, int] = {}
_last = time.monotonic()


class Handler(BaseHTTPRequestHandler):
    server_version = "levee-flaky/1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        global _last
        client = self.path.rstrip("/").rsplit("/", 1)[-1] or "anonymous"
        with _lock:
            n = _seen.get(client, 0)
            _seen[client] = n + 1
            _last = time.monotonic()
        status, headers = SEQUENCE[n] if n < len(SEQUENCE) else (200, {})
        body = f"request {n + 1} from {client}: {status}\n".encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--idle-exit", type=float, default=120.0)
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    port = srv.server_address[1]
    if a.port_file:
        with open(a.port_file + ".tmp", "w") as f:
            f.write(str(port))
        import os

        os.replace(a.port_file + ".tmp", a.port_file)
    else:
        print(port, flush=True)

    def watchdog() -> None:
        while True:
            time.sleep(1)
            if time.monotonic() - _last > a.idle_exit:
                srv.shutdown()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    srv.serve_forever()


if __name__ == "__main__":
    main()
