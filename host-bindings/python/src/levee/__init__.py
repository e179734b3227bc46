"""Levee: retries, circuit breakers, budgets, rate and concurrency limits, deadlines and
fallbacks, decided by one WebAssembly policy core and driven from Python.

```python
import levee

engine = levee.load("policies.yaml")        # a file; levee.loads(text) for the document's text

@engine.policy("checkout")
def charge(order_id: str) -> Receipt: ...

@engine.policy("checkout")
async def charge_async(order_id: str) -> Receipt: ...

levee.call(engine.policy("checkout"), charge, "o-1")

for attempt in engine.policy("checkout").attempts():
    with attempt:
        attempt.result = client.post(...)
```
"""

from __future__ import annotations

from . import telemetry
from .engine import (
    AsyncAttempts,
    Attempt,
    Attempts,
    Engine,
    FallbackContext,
    Policy,
    RetryInfo,
    RetryPredicate,
    TraceStep,
    attempt_cancelled,
    attempt_timeout,
    call,
    component_path,
    load,
    loads,
)
from .errors import (
    BreakerOpen,
    BudgetExhausted,
    BulkheadFull,
    CallCancelled,
    CallFailed,
    DeadlineExceeded,
    EngineClosed,
    FallbacksFailed,
    LeveeError,
    NonIdempotent,
    NotRetryable,
    PolicyError,
    ProtocolError,
    PushbackRefused,
    RateLimited,
    RetriesExhausted,
    RetryAfterTooLong,
    UnknownFallback,
    UnknownPolicy,
)
from .outcomes import Outcome, outcome_for_exception, outcome_for_response, outcome_for_result
from .types import (
    Analysis,
    BreakerState,
    CallInfo,
    Event,
    EventKind,
    LoadError,
    OutcomeKind,
    PolicyInfo,
    Reason,
    Verdict,
    VerdictKind,
)

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "AsyncAttempts",
    "Attempt",
    "Attempts",
    "BreakerOpen",
    "BreakerState",
    "BudgetExhausted",
    "BulkheadFull",
    "CallCancelled",
    "CallFailed",
    "CallInfo",
    "DeadlineExceeded",
    "EngineClosed",
    "Engine",
    "Event",
    "EventKind",
    "FallbackContext",
    "FallbacksFailed",
    "LeveeError",
    "LoadError",
    "NonIdempotent",
    "NotRetryable",
    "Outcome",
    "OutcomeKind",
    "Policy",
    "PolicyError",
    "PolicyInfo",
    "ProtocolError",
    "PushbackRefused",
    "RateLimited",
    "Reason",
    "RetriesExhausted",
    "RetryInfo",
    "RetryPredicate",
    "RetryAfterTooLong",
    "TraceStep",
    "UnknownFallback",
    "UnknownPolicy",
    "Verdict",
    "VerdictKind",
    "attempt_cancelled",
    "attempt_timeout",
    "call",
    "component_path",
    "load",
    "loads",
    "outcome_for_exception",
    "outcome_for_response",
    "outcome_for_result",
    "telemetry",
]
