"""The rules of docs/hosts.md that the Python host applies itself: the HTTP key, the start flags
of a request, error naming, the method table (the host scenarios replay them end to end)."""

from __future__ import annotations

import ssl

import httpx
import pytest

from levee import OutcomeKind
from levee._constants import METHODS
from levee.engine import method_flags
from levee.http import http_key, request_flags
from levee.outcomes import outcome_for_exception


@pytest.mark.parametrize(
    ("url", "key"),
    [
        ("https://API.example.com/a", "api.example.com:443"),
        ("https://api.example.com:443/b", "api.example.com:443"),
        ("http://api.example.com/", "api.example.com:80"),
        ("http://api.example.com:8080/", "api.example.com:8080"),
        ("http://user:pw@[::1]:8080/x", "[::1]:8080"),
        ("http://[::1]/", "[::1]:80"),
        ("http://10.0.0.1/", "10.0.0.1:80"),
    ],
)
def test_http_key_is_host_and_port(url: str, key: str) -> None:
    assert http_key(httpx.URL(url)) == key


def test_methods_are_case_sensitive() -> None:
    assert method_flags("GET") == METHODS["GET"] << 8
    assert method_flags("get") == 15 << 8  # an unknown token, not GET
    assert method_flags("PURGE") == 15 << 8
    assert method_flags(None) == 0


def _flags(method: str, headers: dict[str, str] | None = None, stream: bool = False) -> int:
    def gen() -> object:
        yield b"x"

    content = gen() if stream else b"body"
    return request_flags(httpx.Request(method, "http://svc.test/", headers=headers, content=content))  # type: ignore[arg-type]


def test_request_flags() -> None:
    assert _flags("POST") == METHODS["POST"] << 8
    assert _flags("POST", {"Idempotency-Key": "k"}) == (METHODS["POST"] << 8) | 2
    assert _flags("POST", {"X-IDEMPOTENCY-KEY": "k"}) == (METHODS["POST"] << 8) | 2
    assert _flags("POST", {"Idempotency-Key": ""}) == METHODS["POST"] << 8
    # a body that cannot be sent twice: non-idempotent, and no idempotency key whatever the headers
    assert _flags("PUT", {"Idempotency-Key": "k"}, stream=True) == (METHODS["PUT"] << 8) | 1


def test_error_naming() -> None:
    req = httpx.Request("GET", "http://svc.test/")
    assert outcome_for_exception(httpx.ConnectTimeout("t", request=req)).kind is OutcomeKind.CONNECTION_ERROR
    assert outcome_for_exception(httpx.ReadTimeout("t", request=req)).kind is OutcomeKind.TIMEOUT
    assert outcome_for_exception(ConnectionRefusedError()).kind is OutcomeKind.CONNECTION_ERROR
    cert = ssl.SSLCertVerificationError(1, "certificate verify failed")
    try:
        raise httpx.ConnectError("tls", request=req) from cert
    except httpx.ConnectError as e:
        o = outcome_for_exception(e)
    assert (o.kind, o.text) == (OutcomeKind.ERROR_CLASS, "tls-certificate")
    assert outcome_for_exception(ssl.SSLError(1, "handshake")).kind is OutcomeKind.CONNECTION_ERROR

    class ThrottlingException(Exception):
        pass

    o = outcome_for_exception(ThrottlingException())
    assert (o.kind, o.text) == (OutcomeKind.ERROR_CLASS, "ThrottlingException")


def test_http_attempt_spans_carry_resend_count_and_degraded() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import levee
    from levee.http import LeveeTransport
    from levee.telemetry import OpenTelemetrySink
    from levee.testing import VirtualClock, inject_fault

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    doc = "policies:\n  p: { attempts: 3, backoff: { kind: constant, base: 1s, jitter: none } }\n"
    engine = levee.loads(doc, seed=1, clock=VirtualClock(), telemetry=OpenTelemetrySink(tracer_provider=provider))
    answers = iter([503, 200, 200])
    mock = httpx.MockTransport(lambda request: httpx.Response(next(answers)))
    with httpx.Client(transport=LeveeTransport(engine, "p", transport=mock)) as client:
        assert client.get("http://svc.test/").status_code == 200
        inject_fault(engine, "start")
        assert client.get("http://svc.test/").status_code == 200
    attrs = [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == "levee.attempt"]
    assert attrs == [
        {"levee.attempt": 1, "levee.outcome": "http-status"},
        {"levee.attempt": 2, "http.request.resend_count": 1, "levee.outcome": "http-status"},
        {"levee.attempt": 1, "levee.degraded": True, "levee.outcome": "http-status"},
    ]
