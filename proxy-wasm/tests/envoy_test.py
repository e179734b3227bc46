"""The levee filter in a real Envoy (2 workers) in front of a flaky upstream, all on 127.0.0.1.

Run by proxy-wasm/ci.sh, which builds the filter (and its trap-test build) and installs Envoy:
  python3 envoy_test.py ENVOY LEVEE_CLI FILTER.wasm TRAP_FILTER.wasm WORKDIR
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import upstream

HERE = Path(__file__).resolve().parent

RETRY = {"policies": {"retry": {"attempts": 3, "backoff": {"base": "10ms", "cap": "50ms"}, "retry-on": ["http:503"]}}}
BREAKER = {
    "policies": {
        "breaker": {
            "attempts": 1,
            "breaker": {
                "window": {"kind": "count", "size": 4},
                "minimum-calls": 4,
                "failure-rate": 50,
                "open-duration": "1s",
                "half-open-permits": 1,
            },
        }
    }
}
RATE = {"policies": {"rate": {"attempts": 1, "rate-limit": {"rate": 10, "per": "60s", "burst": 10}}}}
FALLBACK = {
    "document": {
        "policies": {
            "fb": {
                "attempts": 1,
                "breaker": {
                    "window": {"kind": "count", "size": 2},
                    "minimum-calls": 2,
                    "failure-rate": 50,
                    "open-duration": "30s",
                },
                "fallbacks": [{"name": "spare", "on": ["breaker-open"]}],
            }
        }
    },
    "key": {"header": "x-tenant"},
    "fallbacks": {"spare": {"cluster": "spare", "timeout": "1s"}},
}
# The application retries (3 attempts), the proxy would too (3 attempts).
CROSS = {"policies": {"cross": {"attempts": 3, "backoff": {"base": "5ms", "cap": "10ms"}, "retry-on": ["http:503"]}}}
# A breaker that stays open through the test: its 503s are the filter's own rejections.
SHED = {
    "policies": {
        "shed": {
            "attempts": 1,
            "breaker": {"window": {"kind": "count", "size": 2}, "minimum-calls": 2, "failure-rate": 50, "open-duration": "60s"},
        }
    }
}
# An outer Envoy's route, from `levee envoy-config`: retries 429 and 5xx, backoff only.
OUTER = {"policies": {"outer": {"attempts": 3, "backoff": {"base": "10ms", "cap": "50ms"}, "retry-after": {"honor": False}}}}
# Hedged: a second attempt 100 ms after the first, unless the first has answered.
HEDGE = {"policies": {"hedge": {"hedge": {"attempts": 2, "delay": "100ms"}, "deadline": "5s"}}}
BAD = {"document": {"policies": {"p": {"atempts": 3, "backoff": {"base": "250"}}}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def route_retry_policy(cli: str, workdir: Path, name: str, doc: dict[str, Any]) -> str:
    """The route's timeout and retry_policy, from `levee envoy-config`."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(doc.get("document", doc)))
    out = subprocess.run([cli, "envoy-config", str(path)], check=True, capture_output=True, text=True).stdout
    return "\n".join(" " * 18 + line for line in out.splitlines())


def listener(name: str, port: int, cluster: str, plugin: dict[str, Any] | None, wasm: str, vm_id: str, retry_yaml: str) -> str:
    """A listener with the levee filter (none when `plugin` is None) before the router."""
    conf = json.dumps(json.dumps(plugin))
    levee = "" if plugin is None else f"""
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                failure_policy: FAIL_OPEN
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {conf}
                vm_config:
                  vm_id: {vm_id}
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: {wasm}}}}}"""
    return f"""
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              include_attempt_count_in_response: true
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: {cluster}
{retry_yaml}
          http_filters:{levee}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
"""


def upstream_filter(wasm: str) -> str:
    """The filter in its upstream role among a cluster's upstream HTTP filters: it marks each
    overloaded attempt so that the router never retries it."""
    return f"""
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http_protocol_options: {{}}}}
        http_filters:
        - name: envoy.filters.http.wasm
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
            config:
              name: levee-upstream
              root_id: levee-upstream
              failure_policy: FAIL_OPEN
              configuration:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: "role: upstream"
              vm_config:
                vm_id: levee-upstream
                runtime: envoy.wasm.runtime.v8
                code: {{local: {{filename: {wasm}}}}}
        - name: envoy.filters.http.upstream_codec
          typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec}}"""


def cluster(name: str, port: int, extra: str = "") -> str:
    return f"""
  - name: {name}
    connect_timeout: 1s
    type: STATIC{extra}
    load_assignment:
      cluster_name: {name}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}}}]}}]
"""


class Envoy:
    def __init__(self, binary: str, config: str, workdir: Path, tag: str) -> None:
        self.admin = free_port()
        cfg = workdir / f"envoy-{tag}.yaml"
        cfg.write_text(f"admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {self.admin}}}}}\n" + config)
        self.log = workdir / f"envoy-{tag}.log"
        self.proc = subprocess.Popen(
            [binary, "-c", str(cfg), "--concurrency", "2", "--base-id", str(os.getpid() % 60000 + len(tag)),
             "-l", "info", "--log-path", str(self.log), "--file-flush-interval-msec", "50", "--disable-hot-restart"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                status, body, _ = get(self.admin, "/ready")
                if status == 200 and "LIVE" in body:
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def stats(self) -> dict[str, int]:
        _, body, _ = get(self.admin, "/stats")
        out: dict[str, int] = {}
        for line in body.splitlines():
            k, _, v = line.partition(": ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    """One request on a fresh connection (so that requests spread over Envoy's workers)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        body = r.read().decode()
        return r.status, body, {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


FAILURES: list[str] = []


def check(cond: bool, what: str) -> None:
    print(("  ok   " if cond else "  FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


def main() -> int:
    envoy_bin, cli, wasm, trap_wasm, workdir_s = sys.argv[1:6]
    app = sys.argv[6] if len(sys.argv) > 6 else ""
    workdir = Path(workdir_s)
    workdir.mkdir(parents=True, exist_ok=True)
    server, state = upstream.start()
    up = int(server.server_address[1])
    ports = {n: free_port() for n in ["retry", "headers", "breaker", "rate", "trap", "fallback", "cross", "shed", "outer-shed", "outer-rate", "hedge"]}
    listeners = "".join(
        [
            listener("retry", ports["retry"], "upstream", RETRY, wasm, "levee", route_retry_policy(cli, workdir, "retry", RETRY)),
            listener("headers", ports["headers"], "upstream", RETRY, wasm, "levee", ""),
            listener("breaker", ports["breaker"], "upstream", BREAKER, wasm, "levee", route_retry_policy(cli, workdir, "breaker", BREAKER)),
            listener("rate", ports["rate"], "upstream", RATE, wasm, "levee", route_retry_policy(cli, workdir, "rate", RATE)),
            listener("fallback", ports["fallback"], "upstream", FALLBACK, wasm, "levee", route_retry_policy(cli, workdir, "fallback", FALLBACK)),
            listener("cross", ports["cross"], "upstream", CROSS, wasm, "levee", route_retry_policy(cli, workdir, "cross", CROSS)),
            listener("trap", ports["trap"], "upstream", RETRY, trap_wasm, "levee-trap", route_retry_policy(cli, workdir, "trap", RETRY)),
            listener("shed", ports["shed"], "upstream", SHED, wasm, "levee", route_retry_policy(cli, workdir, "shed", SHED)),
            listener("hedge", ports["hedge"], "upstream", HEDGE, wasm, "levee", route_retry_policy(cli, workdir, "hedge", HEDGE)),
            # An outer proxy in front of the levee listeners, without the filter, retrying as
            # `levee envoy-config` says.
            listener("outer-shed", ports["outer-shed"], "inner-shed", None, wasm, "levee", route_retry_policy(cli, workdir, "outer", OUTER)),
            listener("outer-rate", ports["outer-rate"], "inner-rate", None, wasm, "levee", route_retry_policy(cli, workdir, "outer", OUTER)),
        ]
    )
    config = (
        "static_resources:\n  listeners:" + listeners + "  clusters:" + cluster("upstream", up, upstream_filter(wasm)) + cluster("spare", up)
        + cluster("inner-shed", ports["shed"]) + cluster("inner-rate", ports["rate"])
    )
    # The fallback cluster's calls go to /fallback: the filter keeps the request's path, so
    # the test asks for /fallback-able paths through a rewrite-free upstream instead.
    envoy = Envoy(envoy_bin, config, workdir, "main")
    try:
        started = envoy.wait_ready()
        check(started, "Envoy starts with the filter on 2 workers")
        if not started:
            lines = envoy.log.read_text().splitlines() if envoy.log.exists() else ["(no log)"]
            print("\n".join([l for l in lines if "[critical]" in l or "[error]" in l][-20:] or lines[-20:]))
            return 1

        print("== retries: the core decides, the router acts")
        status, _, h = get(ports["retry"], "/flaky?id=r1&fail=2")
        check(status == 200 and h.get("x-envoy-attempt-count") == "3", f"two 503s retried under attempts: 3 (status {status}, attempts {h.get('x-envoy-attempt-count')})")
        status, _, h = get(ports["retry"], "/flaky?id=r2&fail=9")
        _, n, _ = get(up, "/_ctl/count?id=r2")
        check(status == 503 and n == "3", f"at most 3 attempts reach the upstream ({n}), then the 503 is returned ({status})")
        status, _, h = get(ports["headers"], "/flaky?id=r3&fail=2")
        check(status == 200 and h.get("x-envoy-attempt-count") == "3", f"on a route with no retry_policy the filter's headers alone make the router retry (status {status}, attempts {h.get('x-envoy-attempt-count')})")

        print("== overload is never retried by the router")
        for listener_name in ("retry", "headers"):
            status, _, h = get(ports[listener_name], f"/overloaded?id=ov-{listener_name}")
            _, n, _ = get(up, f"/_ctl/count?id=ov-{listener_name}")
            check(
                status == 503 and h.get("x-envoy-attempt-count") == "1" and n == "1",
                f"behind the filter ({listener_name}), an upstream's 503 marked x-envoy-overloaded is not retried "
                f"(status {status}, attempts {h.get('x-envoy-attempt-count')}, upstream saw {n})",
            )
        for _ in range(2):
            get(ports["shed"], "/flaky?id=shed&fail=99")
        status, _, h = get(ports["outer-shed"], "/flaky?id=shed&fail=99")
        check(
            status == 503 and h.get("x-levee-reason") == "breaker-open" and h.get("x-envoy-attempt-count") == "1",
            f"an outer Envoy with envoy-config's retry policy does not retry the filter's 503 "
            f"(status {status}, {h.get('x-levee-reason')}, attempts {h.get('x-envoy-attempt-count')})",
        )

        print("== hedging: the router sends a hedge after hedge.delay, the first answer wins")
        t0 = time.monotonic()
        status, body, h = get(ports["hedge"], "/slowfirst?id=hedge&ms=1500")
        took = time.monotonic() - t0
        _, n, _ = get(up, "/_ctl/count?id=hedge")
        check(
            status == 200 and body == "fast\n" and h.get("x-envoy-attempt-count") == "2" and n == "2" and took < 1.0,
            f"the hedge answered first ({status} {body.strip()!r}, attempts {h.get('x-envoy-attempt-count')}, upstream saw {n}, {took:.2f} s)",
        )
        hedge_route = route_retry_policy(cli, workdir, "hedge", HEDGE)
        check("hedge_on_per_try_timeout: true" in hedge_route and "num_retries: 1" in hedge_route, f"envoy-config maps the hedge:\n{hedge_route}")
        check("levee: policy `hedge`: hedge.preset grpc:" in envoy.log.read_text(), "the filter warns in Envoy's log of what the router cannot do of the hedge")

        print("== Retry-After honoured by the router (rate_limited_retry_back_off from levee envoy-config)")
        t0 = time.monotonic()
        status, _, h = get(ports["retry"], "/flaky?id=ra&fail=1&ra=1")
        took = time.monotonic() - t0
        _, times, _ = get(up, "/_ctl/times?id=ra")
        ts = [float(x) for x in times.split(",") if x]
        gap = ts[1] - ts[0] if len(ts) == 2 else 0.0
        check(status == 200 and 0.95 <= gap < 3.0, f"the retry waited the upstream's Retry-After: 1 ({gap:.3f} s between attempts, {took:.2f} s in all)")

        print("== the breaker opens, fails fast locally, recovers through half-open")
        for i in range(4):
            status, _, h = get(ports["breaker"], f"/down?id=b")
            check(status == 503 and "x-levee-reason" not in h, f"request {i + 1}: the upstream's own 503")
        _, before, _ = get(up, "/_ctl/count?id=b")
        t0 = time.monotonic()
        status, body, h = get(ports["breaker"], "/down?id=b")
        fast = time.monotonic() - t0
        _, after, _ = get(up, "/_ctl/count?id=b")
        check(status == 503 and h.get("x-levee-reason") == "breaker-open" and h.get("x-envoy-overloaded") == "true", f"open: a local 503 marked overloaded ({status} {h.get('x-levee-reason')})")
        check(h.get("retry-after") == "1", f"Retry-After from the core's hint: {h.get('retry-after')}")
        check(before == after, f"the upstream saw nothing while open ({before} -> {after}); answered in {fast * 1000:.1f} ms")
        get(up, "/_ctl/down?on=0", method="POST")
        time.sleep(1.1)
        results = [get(ports["breaker"], "/down?id=b")[0] for _ in range(5)]
        check(results == [200] * 5, f"after open-duration a half-open trial succeeds and closes the breaker: {results}")

        print("== a rate limit admits exactly its rate across both workers")
        with ThreadPoolExecutor(max_workers=20) as pool:
            codes = list(pool.map(lambda i: get(ports["rate"], f"/ok?id=rate")[0], range(40)))
        stats = envoy.stats()
        workers = [stats.get(f"listener.127.0.0.1_{ports['rate']}.worker_{w}.downstream_cx_total", 0) for w in (0, 1)]
        check(codes.count(200) == 10 and codes.count(429) == 30, f"burst 10 of 40 concurrent requests admitted: {codes.count(200)} x 200, {codes.count(429)} x 429")
        check(all(w > 0 for w in workers), f"both workers took connections: {workers}")
        status, _, h = get(ports["rate"], "/ok?id=rate")
        check(status == 429 and h.get("retry-after", "0").isdigit() and int(h.get("retry-after", "0")) >= 1, f"429 carries Retry-After: {h.get('retry-after')}")
        status, _, h = get(ports["outer-rate"], "/ok?id=rate")
        check(
            status == 429 and h.get("x-envoy-attempt-count") == "1",
            f"an outer Envoy with envoy-config's retry policy does not retry the filter's 429 (status {status}, attempts {h.get('x-envoy-attempt-count')})",
        )

        print("== fallback to a cluster when the breaker is open (key: a header)")
        for _ in range(2):
            get(ports["fallback"], "/down?id=fb", {"x-tenant": "t1"})
        get(up, "/_ctl/down?on=1", method="POST")
        for _ in range(2):
            get(ports["fallback"], "/down?id=fb", {"x-tenant": "t2"})
        status, body, h = get(ports["fallback"], "/fallback", {"x-tenant": "t2"})
        check(status == 200 and h.get("x-levee-fallback") == "cluster" and "fallback cluster" in body, f"tenant t2's open breaker sends it to the spare cluster ({status}, {h.get('x-levee-fallback')})")
        status, _, h = get(ports["fallback"], "/ok", {"x-tenant": "t1"})
        check(status == 200 and "x-levee-fallback" not in h, "tenant t1 (another key) is untouched")

        print("== cross-layer: the application retries, the proxy does not add its own")
        if app:
            policy = workdir / "app.json"
            policy.write_text(json.dumps({"policies": {"app": {"attempts": 3, "backoff": {"base": "5ms", "cap": "10ms"}, "retry-on": ["http:503"]}}}))
            url = f"http://127.0.0.1:{ports['cross']}/flaky?id=app&fail=9"
            run = subprocess.run([app, "--policy-file", str(policy), "--policy", "app", url], capture_output=True, text=True, timeout=60)
            _, n, _ = get(up, "/_ctl/count?id=app")
            _, marks, _ = get(up, "/_ctl/headers?id=app&name=x-levee-attempt")
            check("attempt #3" in run.stdout, f"the application (host-rust's reqwest client) made 3 attempts: {run.stdout.strip()[-400:]} {run.stderr.strip()[-300:]}")
            check(n == "3", f"3 attempts at the application x 1 at the proxy = {n} upstream requests (9 without coordination)")
            check(marks.splitlines() == ["1", "2", "3"], f"the application marked its attempts: {marks.splitlines()}")
        for i in range(3):
            get(ports["cross"], "/flaky?id=unmarked&fail=99")
        _, n, _ = get(up, "/_ctl/count?id=unmarked")
        check(n == "9", f"without the mark, 3 application attempts become {n} upstream requests")

        print("== a trap in the filter fails open and is reported")
        status, _, _ = get(ports["trap"], "/ok?id=trap", {"x-levee-test-trap": "1"})
        later = [get(ports["trap"], "/ok?id=trap")[0] for _ in range(4)]
        time.sleep(0.3)
        log = envoy.log.read_text()
        check(all(s == 200 for s in later), f"requests after the trap pass (fail open): trap request {status}, then {later}")
        check("[critical][wasm]" in log and "x-levee-test-trap" in log, "the trap is reported at critical level in Envoy's log (proxy-wasm's panic hook)")
        check("Function: proxy_on_request_headers failed" in log, "and Envoy reports the failed VM call")
        levee = {k: v for k, v in envoy.stats().items() if ".levee." in k or k.startswith("levee.")}
        check(any(k.endswith("levee.rejected") and v > 0 for k, v in levee.items()), f"the filter's counters are Envoy metrics: {sorted(levee)[:4]}...")
    finally:
        envoy.stop()

    print("== a bad document is refused at configure")
    bad_config = "static_resources:\n  listeners:" + listener("bad", free_port(), "upstream", BAD, wasm, "levee-bad", "") + "  clusters:" + cluster("upstream", up)
    bad = Envoy(envoy_bin, bad_config, workdir, "bad")
    try:
        ready = bad.wait_ready(timeout=15)
        log = bad.log.read_text() if bad.log.exists() else ""
        check(not ready, "Envoy does not start the filter")
        check("levee: configuration: document.policies.p.atempts" in log and "document.policies.p.backoff.base" in log, "every field-path error is in Envoy's log")
    finally:
        bad.stop()
        server.shutdown()
    if FAILURES:
        print(f"proxy-wasm: {len(FAILURES)} check(s) failed", file=sys.stderr)
        return 1
    print("proxy-wasm: all Envoy checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
