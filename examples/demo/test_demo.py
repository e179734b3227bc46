#!/usr/bin/env python3
"""Tests of the demo's flaky server and of compare.py (stdlib only; run by cli/ci.sh).

    python3 examples/demo/test_demo.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# One decision sequence in each host's own style (abridged from real runs).
RUST = """rust backend wasm
rust step 1 t=1ms call=1 start -> attempt #1 (timeout 2s)
rust step 2 t=3ms call=1 report http 503 -> retry after 70.292184ms
rust step 3 t=75ms call=1 acquire -> attempt #2 (timeout 2s)
rust step 4 t=80ms call=1 report http 429 (Retry-After "1") -> retry after 1s
rust step 5 t=1.08s call=1 acquire -> attempt #3 (timeout 2s)
rust step 6 t=1.09s call=1 report http 503 -> retry after 208.174648ms
rust step 7 t=1.3s call=1 acquire -> attempt #4 (timeout 2s)
rust step 8 t=1.31s call=1 report http 200 -> done
rust result http 200 (23 bytes)
"""
PYTHON = """policy 'demo' -> http://127.0.0.1:1/demo/python
step 1: start           attempt=0 outcome=-                            verdict=attempt(n=1, timeout_ns=2000000000)
step 2: report          attempt=1 outcome=http-status 503              verdict=retry(reason=none, ns=70292184)
        event: retry scheduled in 70.292 ms after attempt 1 (policy=0 call=1)
step 3: acquire         attempt=1 outcome=-                            verdict=attempt(n=2, timeout_ns=2000000000)
step 4: report          attempt=2 outcome=http-status 429 (1)          verdict=retry(reason=none, ns=1000000000)
step 5: acquire         attempt=2 outcome=-                            verdict=attempt(n=3, timeout_ns=2000000000)
step 6: report          attempt=3 outcome=http-status 503              verdict=retry(reason=none, ns=208174648)
step 7: acquire         attempt=3 outcome=-                            verdict=attempt(n=4, timeout_ns=2000000000)
step 8: report          attempt=4 outcome=http-status 200              verdict=done
result: HTTP 200
"""
JS = """+    1ms js start                              -> attempt 1 (timeout 2000.0ms)
+    3ms js attempt 1: HTTP 503                -> retry after 70.3ms
+   70ms js acquire                            -> attempt 2 (timeout 2000.0ms)
+   72ms js attempt 2: HTTP 429 Retry-After: 1 -> retry after 1000.0ms
+ 1073ms js acquire                            -> attempt 3 (timeout 2000.0ms)
+ 1075ms js attempt 3: HTTP 503                -> retry after 208.2ms
+ 1371ms js event breaker closed -> open
+ 1371ms js acquire                            -> attempt 4 (timeout 2000.0ms)
+ 1373ms js attempt 4: HTTP 200                -> done
+ 1373ms js result HTTP 200
"""
GO_DISAGREES = """go step 1 t=1ms call=1 start -> attempt #1 (timeout 2s)
go step 2 t=3ms call=1 report http 503 -> fail: retries-exhausted
go result error: gave up
"""


class FlakyServer(unittest.TestCase):
    def test_the_fast_hosts_run_first_and_rust_last(self) -> None:
        # A newcomer's first `./dev demo` shows results within a minute: Python, JS and Go
        # need no build of wasmtime; the Rust host's first build takes minutes, so it goes last.
        out = subprocess.run(["bash", os.path.join(HERE, "run.sh"), "--plan"], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.split(), ["python", "js", "go", "rust"])
        out = subprocess.run(["bash", os.path.join(HERE, "run.sh"), "--plan", "rust", "go"], capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.split(), ["rust", "go"])

    def test_sequence_per_client(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            port_file = os.path.join(d, "port")
            srv = subprocess.Popen([sys.executable, os.path.join(HERE, "flaky_server.py"), "--port-file", port_file, "--idle-exit", "30"])
            try:
                for _ in range(100):
                    if os.path.exists(port_file):
                        break
                    time.sleep(0.05)
                with open(port_file) as f:
                    port = int(f.read())

                def get(client: str) -> tuple[int, str | None]:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/demo/{client}", timeout=5) as r:
                            return r.status, r.headers.get("Retry-After")
                    except urllib.error.HTTPError as e:
                        return e.code, e.headers.get("Retry-After")

                self.assertEqual([get("a") for _ in range(5)], [(503, None), (429, "1"), (503, None), (200, None), (200, None)])
                self.assertEqual(get("b"), (503, None), "each client id has its own sequence")
            finally:
                srv.terminate()
                srv.wait(timeout=10)


class Compare(unittest.TestCase):
    def run_compare(self, outputs: dict[str, str]) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory() as d:
            args = []
            for name, text in outputs.items():
                path = os.path.join(d, name)
                with open(path, "w") as f:
                    f.write(text)
                args.append(f"{name}={path}")
            return subprocess.run([sys.executable, os.path.join(HERE, "compare.py"), *args], capture_output=True, text=True, timeout=30)

    def test_hosts_in_their_own_styles_agree(self) -> None:
        r = self.run_compare({"rust": RUST, "python": PYTHON, "js": JS})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("all 3 host(s) agree: attempt 1 -> 503: retry 70ms -> attempt 2 -> 429: retry 1000ms", r.stdout)
        self.assertIn("429: retry 1000ms", r.stdout)
        self.assertIn("=> HTTP 200", r.stdout)

    def test_a_different_delay_is_a_disagreement(self) -> None:
        r = self.run_compare({"rust": RUST, "js": JS.replace("retry after 70.3ms", "retry after 66.1ms")})
        self.assertEqual(r.returncode, 1)
        self.assertIn("DISAGREE", r.stdout)
        self.assertIn("503: retry 66ms", r.stdout)

    def test_a_disagreement_is_reported(self) -> None:
        r = self.run_compare({"rust": RUST, "go": GO_DISAGREES})
        self.assertEqual(r.returncode, 1)
        self.assertIn("DISAGREE", r.stdout)
        self.assertIn("503: fail: retries-exhausted", r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=1)
