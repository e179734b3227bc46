"""Fuzz the Python host's outcome mapping end to end (atheris; not run in CI).

Each input is a short script of HTTP attempts (status, raw Retry-After bytes decoded as
latin-1 the way httpx decodes headers, the overloaded mark), a key (any text, lone surrogates
included) and a policy. It goes through `LeveeTransport` over an `httpx.MockTransport`, so
every step is the real one: `outcome_for_response`, `report`, the core's verdicts, the
clamps. The properties:

- the transport returns one of the responses it was given, or raises a `CallFailed`
  subclass (a key that is not valid Unicode: `UnicodeEncodeError`, before any crossing);
- the engine never faults (`engine.faults == 0`): no input of the host reaches the guest in
  a form that traps it;
- never more attempts than the policy's maximum.

    pip install atheris
    LEVEE_COMPONENT=target/levee/levee_policy.wasm python fuzz/fuzz_outcomes.py -max_total_time=120
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import httpx

    import levee
    from levee.http import LeveeTransport

DOC = """
policies:
  retry:
    attempts: 4
    backoff: { kind: constant, base: 0ms, jitter: none }
    retry-after: { cap: 1ms, over-cap: clamp }
    retry-on: [timeout, connection-error, "http:429", "http:5xx"]
  breaker:
    attempts: 2
    backoff: { kind: constant, base: 0ms, jitter: none }
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1ms }
    retry-after: { cap: 1ms, over-cap: clamp }
"""

ENGINE = levee.loads(DOC, seed=1, snapshot_interval=0)


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    policy = ENGINE.policies[fdp.ConsumeIntInRange(0, len(ENGINE.policies) - 1)]
    key = fdp.ConsumeUnicode(12)
    script = []
    for _ in range(fdp.ConsumeIntInRange(1, 6)):
        status = fdp.ConsumeIntInRange(100, 599)
        retry_after = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 24)).decode("latin-1")
        overloaded = fdp.ConsumeBool()
        script.append((status, retry_after, overloaded))
    given: list[httpx.Response] = []

    def handler(request: httpx.Request) -> httpx.Response:
        status, retry_after, overloaded = script[min(len(given), len(script) - 1)]
        headers = {"retry-after": retry_after} if retry_after else {}
        if overloaded:
            headers["x-envoy-overloaded"] = "true"
        r = httpx.Response(status, headers=headers, content=b"x")
        given.append(r)
        return r

    transport = LeveeTransport(ENGINE, policy, transport=httpx.MockTransport(handler), key=lambda _r: key)
    try:
        response = transport.handle_request(httpx.Request("GET", "http://127.0.0.1/"))
        assert any(response is g for g in given), "a response the upstream never sent"
    except levee.CallFailed:
        pass
    except UnicodeEncodeError:
        assert not key.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == key
        return
    assert len(given) <= ENGINE.policy_info(policy).max_attempts, (len(given), policy)
    assert ENGINE.faults == 0, "the engine faulted"


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
