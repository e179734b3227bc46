"""Latency the levee filter adds in Envoy, from a load generator in another process.

One Envoy (--concurrency 2) with four listeners in front of the same fast upstream (Go, a
third process), all on 127.0.0.1:
  plain   the router alone, no retry policy
  wasm    a proxy-wasm filter that does nothing (examples/passthrough.rs), same V8 runtime:
          the price of Envoy's Wasm machinery, the baseline of the levee filter's own cost
  native  Envoy's own retry_policy (the document's, from `levee envoy-config`) and cluster
          circuit_breakers
  levee   the levee filter (breaker, token budget, retries) + the same retry_policy
The generator (proxy-wasm/bench/loadgen) sends a fixed rate, open loop, measured from each
request's scheduled time; rounds alternate the listeners. Prints p50 and p99 per listener and
what the filter adds to each, and Envoy's CPU time per request (all its threads, from
/proc/PID/task/*/schedstat, over each listener's run, warm-up included): the work the filter
adds, less moved by the machine's load than a latency percentile.

  python3 bench.py ENVOY LEVEE_CLI FILTER.wasm PASSTHROUGH.wasm LOADGEN [--rate 500] [--seconds 10] [--rounds 3]
      [--compare OTHER_FILTER.wasm]   # e.g. the previous commit's filter, measured in the same rounds
      [--perf DIR]                    # also a CPU profile of Envoy per listener and round, DIR/NAME-ROUND.data
                                      # (perf record -F 4000 -g, Debian's linux-perf): where the CPU goes
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import envoy_test as et  # noqa: E402

DOC = {
    "policies": {
        "edge": {
            "attempts": 3,
            "backoff": {"base": "25ms", "cap": "250ms"},
            "retry-on": ["http:503", "connection-error"],
            "budget": {"kind": "token", "max-tokens": 100, "token-ratio": 0.1},
            "breaker": {"window": {"kind": "count", "size": 100}, "minimum-calls": 20, "failure-rate": 50, "open-duration": "5s"},
        }
    }
}
BREAKERS = """
    circuit_breakers:
      thresholds:
      - {max_connections: 1024, max_pending_requests: 1024, max_requests: 1024, max_retries: 3}"""


def host_calls(envoy: et.Envoy) -> tuple[int, int]:
    """The levee filter's host calls so far (its `levee.host_calls` counter, all workers), and
    the requests its listener completed (the load generator's warm-up included)."""
    stats = envoy.stats()
    return stats.get("wasmcustom.levee.host_calls", 0), stats.get("http.levee.downstream_rq_completed", 0)


def envoy_cpu_ns(pid: int) -> int:
    """CPU time Envoy's threads have run, in nanoseconds (the first field of each schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("envoy")
    ap.add_argument("cli")
    ap.add_argument("wasm")
    ap.add_argument("passthrough")
    ap.add_argument("loadgen")
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", metavar="FILTER.wasm", help="another build of the levee filter (listener `other`), same rounds")
    ap.add_argument("--perf", metavar="DIR", help="record a CPU profile of Envoy during each listener's run into DIR")
    a = ap.parse_args()
    if a.perf:
        Path(a.perf).mkdir(parents=True, exist_ok=True)
    if a.compare:
        a.compare = str(Path(a.compare).resolve())  # Envoy runs in a directory of its own
    work = Path(tempfile.mkdtemp(prefix="levee-bench-"))
    up = subprocess.Popen([a.loadgen, "-serve", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    envoy = None
    try:
        assert up.stdout is not None
        up_port = int(up.stdout.readline().strip().rsplit(":", 1)[1])
        retry = et.route_retry_policy(a.cli, work, "edge", DOC)
        names = ["plain", "wasm", "native", "levee"] + (["other"] if a.compare else [])
        ports = {n: et.free_port() for n in names}
        listeners = (
            et.listener("plain", ports["plain"], "upstream", None, "", "", "")
            + et.listener("wasm", ports["wasm"], "upstream", {}, a.passthrough, "passthrough", "")
            + et.listener("native", ports["native"], "guarded", None, "", "", retry)
            + et.listener("levee", ports["levee"], "upstream", DOC, a.wasm, "levee", retry)
            + (et.listener("other", ports["other"], "upstream", DOC, a.compare, "other", retry) if a.compare else "")
        )
        config = (
            "static_resources:\n  listeners:" + listeners + "  clusters:" + et.cluster("upstream", up_port) + et.cluster("guarded", up_port, BREAKERS)
        )
        envoy = et.Envoy(a.envoy, config, work, "bench")
        if not envoy.wait_ready():
            print(envoy.log.read_text()[-3000:], file=sys.stderr)
            return 1
        results: dict[str, list[tuple[float, float]]] = {n: [] for n in ports}
        cpu: dict[str, list[float]] = {n: [] for n in ports}
        calls0 = host_calls(envoy)
        for r in range(a.rounds):
            for name, port in ports.items():
                rec = None
                if a.perf:
                    rec = subprocess.Popen(["perf", "record", "-q", "-F", "4000", "-g", "-p", str(envoy.proc.pid),
                                            "-o", str(Path(a.perf) / f"{name}-{r + 1}.data")], stderr=subprocess.DEVNULL)
                    time.sleep(0.3)  # perf attaches before the load starts
                c0 = envoy_cpu_ns(envoy.proc.pid)
                out = subprocess.run(
                    [a.loadgen, "-url", f"http://127.0.0.1:{port}/", "-rate", str(a.rate), "-for", f"{a.seconds}s"],
                    check=True, capture_output=True, text=True,
                ).stdout.split()
                c1 = envoy_cpu_ns(envoy.proc.pid)
                if rec is not None:
                    rec.send_signal(signal.SIGINT)
                    rec.wait()
                p50, p99, measured, errs, sent = float(out[0]), float(out[1]), int(out[2]), int(out[3]), int(out[4])
                results[name].append((p50, p99))
                cpu[name].append((c1 - c0) / 1000 / sent)
                print(f"round {r + 1} {name:6s} p50 {p50:7.1f} us  p99 {p99:7.1f} us  Envoy CPU {cpu[name][-1]:6.1f} us/request"
                      f"  ({measured} requests, {errs} errors)", flush=True)
        med = {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for n, v in results.items()}
        print(f"\nmedian of {a.rounds} rounds at {a.rate:.0f} requests/s, {a.seconds} s each, Envoy --concurrency 2:")
        mcpu = {n: statistics.median(v) for n, v in cpu.items()}
        for n, (p50, p99) in med.items():
            print(f"  {n:6s} p50 {p50:7.1f} us  p99 {p99:7.1f} us  Envoy CPU {mcpu[n]:6.1f} us/request")
        lp50, lp99 = med["levee"]
        w50, w99 = med["wasm"]
        p50, p99 = med["plain"]
        print(f"  wasm  - plain : p50 {w50 - p50:+6.1f} us  p99 {w99 - p99:+6.1f} us  (Envoy's Wasm machinery)")
        for base in ("plain", "wasm", "native"):
            b50, b99 = med[base]
            print(f"  levee - {base:6s}: p50 {lp50 - b50:+6.1f} us  p99 {lp99 - b99:+6.1f} us")
        if a.compare:
            o50, o99 = med["other"]
            print(f"  other - wasm  : p50 {o50 - w50:+6.1f} us  p99 {o99 - w99:+6.1f} us  (the --compare build)")
        # Paired: each round's difference (the listeners of a round ran seconds apart, under
        # the same load), then the median: less moved by a load that changes between rounds.
        p50s = {n: [r[0] for r in v] for n, v in results.items()}

        def paired(series: dict[str, list[float]], x: str, y: str) -> float:
            return statistics.median(p - q for p, q in zip(series[x], series[y]))
        print("  median of the rounds' own p50 differences:")
        pairs = [("wasm", "plain"), ("levee", "wasm"), ("levee", "native")] + ([("other", "wasm"), ("levee", "other")] if a.compare else [])
        for x, y in pairs:
            print(f"    {x:6s} - {y:6s}: {paired(p50s, x, y):+6.1f} us")
        print("  Envoy CPU per request, median of the rounds' own differences:")
        for x, y in [("wasm", "plain"), ("native", "plain"), ("levee", "plain")] + pairs[1:]:
            print(f"    {x:6s} - {y:6s}: {paired(cpu, x, y):+6.1f} us")
        time.sleep(1.5)  # the workers publish their counters every second
        calls1 = host_calls(envoy)
        calls, requests = calls1[0] - calls0[0], calls1[1] - calls0[1]
        print(f"  levee filter: {calls / max(requests, 1):.2f} proxy-wasm host calls per request"
              f" ({calls} over {requests} requests, the workers' 1 s metric ticks included;"
              " a --compare build that counts them too adds to the same counter)")
        return 0
    finally:
        if envoy is not None:
            envoy.stop()
        up.terminate()
        up.wait()


if __name__ == "__main__":
    sys.exit(main())
