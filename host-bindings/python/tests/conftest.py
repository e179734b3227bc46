from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------ PostgreSQL for the durable tests


def _pg_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian's layout), or None."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return found[-1].parent if found else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server for the session, on 127.0.0.1 only: `$LEVEE_TEST_POSTGRES` when set
    (a conninfo), else one started from the installed binaries in a temporary directory (as the
    `postgres` user when run as root, as durable/tests/run.sh does); skipped when neither."""
    dsn = os.environ.get("LEVEE_TEST_POSTGRES")
    if dsn:
        yield dsn
        return
    pg = _pg_bin()
    if pg is None:
        if os.environ.get("LEVEE_REQUIRE_POSTGRES"):  # ci.sh: never pass by being skipped
            pytest.fail("no PostgreSQL under /usr/lib/postgresql and no LEVEE_TEST_POSTGRES")
        pytest.skip("no PostgreSQL: set LEVEE_TEST_POSTGRES or install postgresql")
    as_user: dict[str, Any] = {}
    data = Path(tempfile.mkdtemp(prefix="levee-pg-"))
    if os.geteuid() == 0:  # initdb refuses root
        shutil.chown(data, "postgres", "postgres")
        as_user = {"user": "postgres", "group": "postgres", "extra_groups": []}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(*args: str) -> None:
        subprocess.run(args, cwd=data, check=True, capture_output=True, **as_user)

    try:
        run(str(pg / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres", "--no-sync")
        opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {data} -c fsync=off -c max_connections=50"
        run(str(pg / "pg_ctl"), "-D", str(data / "db"), "-w", "-l", str(data / "log"), "-o", opts, "start")
        yield f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            run(str(pg / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop")
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def postgres(postgres_server: str) -> Iterator[str]:
    """A fresh database on the session's server, for one test; its conninfo."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_conninfo(postgres_server, dbname=name)
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
