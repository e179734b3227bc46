"""What an attempt produced, as the core wants to hear it.

The host only *describes* what happened (a timeout, a refused connection, an HTTP status with
its raw `Retry-After` header, an exception's class name); the core decides whether that is
retryable, how long to wait, and whether to give up. Nothing here decides anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ._constants import HTTP_TLS_CERTIFICATE_CLASS, HTTP_UNNAMED_ERROR_CLASS
from .types import OutcomeKind

__all__ = [
    "Classifier",
    "Outcome",
    "outcome_for_exception",
    "outcome_for_response",
    "outcome_for_result",
]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The outcome of one attempt (`kind`, and `code`/`text` as `outcome-kind` describes)."""

    kind: OutcomeKind
    code: int = 0
    text: str = ""
    overloaded: bool = False

    @classmethod
    def success(cls) -> Outcome:
        return _SUCCESS

    @classmethod
    def timeout(cls) -> Outcome:
        return _TIMEOUT

    @classmethod
    def connection_error(cls) -> Outcome:
        return _CONNECTION_ERROR

    @classmethod
    def http(cls, status: int, retry_after: str = "", *, overloaded: bool = False) -> Outcome:
        """An HTTP response: its status and its raw `Retry-After` header ("" if absent)."""
        return cls(OutcomeKind.HTTP_STATUS, int(status), retry_after or "", overloaded)

    @classmethod
    def grpc(cls, code: int, pushback: str = "") -> Outcome:
        """A gRPC status and its raw `grpc-retry-pushback-ms` trailer ("" if absent)."""
        return cls(OutcomeKind.GRPC_STATUS, int(code), pushback or "")

    @classmethod
    def error(cls, name: str) -> Outcome:
        """An error of a named class (the policy's classification names such classes)."""
        return cls(OutcomeKind.ERROR_CLASS, 0, name)


_SUCCESS = Outcome(OutcomeKind.SUCCESS)
_TIMEOUT = Outcome(OutcomeKind.TIMEOUT)
_CONNECTION_ERROR = Outcome(OutcomeKind.CONNECTION_ERROR)

#: A user classifier: given an attempt's result or exception, an `Outcome`, or `None` to let
#: Levee's default mapping decide.
Classifier = Callable[[Any], "Outcome | None"]


def _headers_get(headers: Any, name: str) -> str:
    try:
        value = headers.get(name)
    except Exception:
        return ""
    return str(value) if value is not None else ""


def outcome_for_response(response: Any) -> Outcome:
    """An `httpx.Response` or `requests.Response` (or anything with `status_code` and
    `headers`): its status, raw `Retry-After` and `x-envoy-overloaded` marker."""
    headers = getattr(response, "headers", None)
    retry_after = _headers_get(headers, "retry-after") if headers is not None else ""
    overloaded = bool(_headers_get(headers, "x-envoy-overloaded")) if headers is not None else False
    return Outcome.http(int(response.status_code), retry_after, overloaded=overloaded)


def _is_response_type(t: type) -> bool:
    module = t.__module__
    if module.startswith("httpx"):
        httpx = sys.modules.get("httpx")
        return httpx is not None and issubclass(t, httpx.Response)
    if module.startswith("requests"):
        requests = sys.modules.get("requests")
        return requests is not None and issubclass(t, requests.Response)
    return False


# type -> whether a returned value of that type is an HTTP response (cached: a dict lookup per call)
_RESULT_IS_RESPONSE: dict[type, bool] = {}


def outcome_for_result(value: Any) -> Outcome | None:
    """The outcome of a returned value: an HTTP response maps to its status; anything else is
    a plain success (`None`)."""
    t = type(value)
    is_resp = _RESULT_IS_RESPONSE.get(t)
    if is_resp is None:
        is_resp = _is_response_type(t)
        if len(_RESULT_IS_RESPONSE) < 1024:
            _RESULT_IS_RESPONSE[t] = is_resp
    return outcome_for_response(value) if is_resp else None


def error_name(exc: BaseException) -> str:
    """The class name passed as `error-class` text (docs/hosts.md, section 6): the exception
    type's `__name__`, without its module; `Error` when that is empty."""
    return type(exc).__name__ or HTTP_UNNAMED_ERROR_CLASS


_TLS_CERTIFICATE = Outcome(OutcomeKind.ERROR_CLASS, 0, HTTP_TLS_CERTIFICATE_CLASS)


def _certificate_failed(exc: BaseException, tls: ModuleType) -> bool:
    """Whether the server's TLS certificate failed verification (anywhere in the cause chain);
    `tls` is ssl's C module, `_ssl`, where its exceptions are defined."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 16:
        if isinstance(e, tls.SSLCertVerificationError):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def outcome_for_exception(exc: BaseException) -> Outcome:
    """Map an exception to an outcome (docs/hosts.md, section 6): a timeout other than
    connecting is `timeout`; a connection that could not be made (refused, reset, DNS, a connect
    timeout, a TLS handshake failure) is `connection-error`; a certificate that failed
    verification is the error class `tls-certificate`; HTTP status errors of httpx and requests
    are their status; anything else is an `error-class` named by the exception's class."""
    # ssl's exceptions are defined by its C module, `_ssl`: none exists before it is imported, so
    # `import levee` need not import ssl (as httpx and requests below are looked up, not imported).
    tls = sys.modules.get("_ssl")
    if tls is not None and _certificate_failed(exc, tls):
        return _TLS_CERTIFICATE
    httpx = sys.modules.get("httpx")
    if httpx is not None:
        if isinstance(exc, httpx.ConnectTimeout):
            return _CONNECTION_ERROR
        if isinstance(exc, httpx.TimeoutException):
            return _TIMEOUT
        if isinstance(exc, httpx.HTTPStatusError):
            return outcome_for_response(exc.response)
        if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError)):
            return _CONNECTION_ERROR
    requests = sys.modules.get("requests")
    if requests is not None:
        if isinstance(exc, requests.ConnectTimeout):
            return _CONNECTION_ERROR
        if isinstance(exc, requests.Timeout):
            return _TIMEOUT
        if isinstance(exc, requests.HTTPError) and exc.response is not None:
            return outcome_for_response(exc.response)
        if isinstance(exc, requests.ConnectionError):
            return _CONNECTION_ERROR
    if isinstance(exc, TimeoutError):
        return _TIMEOUT
    if isinstance(exc, ConnectionError):
        return _CONNECTION_ERROR
    if tls is not None and isinstance(exc, tls.SSLError):
        return _CONNECTION_ERROR
    return Outcome.error(error_name(exc))
