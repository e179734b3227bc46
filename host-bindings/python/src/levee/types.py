"""Typed mirrors of the WIT types (`levee:policy/types@0.1.0`) and of packed verdicts."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = [
    "Analysis",
    "BreakerState",
    "CallInfo",
    "DurableAction",
    "DurableReason",
    "DurableStep",
    "Event",
    "EventKind",
    "LoadError",
    "OutcomeKind",
    "PolicyInfo",
    "Reason",
    "Verdict",
    "VerdictKind",
]


class Reason(enum.IntEnum):
    """Why the core refused an attempt, stopped retrying, or chose a fallback.

    The numbering is the WIT's declaration order (it travels in packed verdicts).
    """

    NONE = 0
    DEADLINE = 1
    RETRIES_EXHAUSTED = 2
    NON_RETRYABLE = 3
    BUDGET = 4
    BREAKER_OPEN = 5
    RATE_LIMITED = 6
    BULKHEAD_FULL = 7
    NON_IDEMPOTENT = 8
    RETRY_AFTER_TOO_LONG = 9
    PUSHBACK = 10
    CANCELLED = 11
    FALLBACKS_FAILED = 12

    @property
    def wit(self) -> str:
        """The WIT (kebab-case) name."""
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_wit(cls, name: str) -> Reason:
        return cls[name.upper().replace("-", "_")]

    @classmethod
    def from_code(cls, code: int) -> Reason:
        """Decode a reason byte from a verdict; unknown codes (an untrusted guest) read as NONE."""
        try:
            return cls(code)
        except ValueError:
            return cls.NONE


class _WitEnum(enum.Enum):
    """An enum whose values are the WIT kebab-case names."""

    @property
    def wit(self) -> str:
        return str(self.value)

    @classmethod
    def from_wit(cls, name: str) -> _WitEnum:
        return cls(name)


class OutcomeKind(_WitEnum):
    """What the host observed for one attempt."""

    SUCCESS = "success"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection-error"
    HTTP_STATUS = "http-status"
    GRPC_STATUS = "grpc-status"
    ERROR_CLASS = "error-class"


class BreakerState(_WitEnum):
    """Circuit breaker states."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"
    FORCED_OPEN = "forced-open"
    FORCED_CLOSED = "forced-closed"
    DISABLED = "disabled"


class EventKind(_WitEnum):
    """Kinds of event. All but `ENGINE_FAULT` come from the core; `ENGINE_FAULT` is the
    host's report that the component trapped and was re-instantiated."""

    RETRY_SCHEDULED = "retry-scheduled"
    GAVE_UP = "gave-up"
    REJECTED = "rejected"
    BUDGET_REFUSED = "budget-refused"
    BREAKER_TRANSITION = "breaker-transition"
    FALLBACK_CHOSEN = "fallback-chosen"
    RATE_LIMIT_WAIT = "rate-limit-wait"
    KEY_EVICTED = "key-evicted"
    CALL_EVICTED = "call-evicted"
    PERMIT_EXPIRED = "permit-expired"
    HEDGE_STARTED = "hedge-started"
    #: every key holds protection: a new key was decided against the shared entry
    #: `levee:overflow` (`key`); `name` is the caller's key (docs/policy.md, "Keys")
    KEY_OVERFLOW = "key-overflow"
    ENGINE_FAULT = "engine-fault"


@dataclass(frozen=True, slots=True)
class Event:
    """One engine event. `policy` is the policy's name (`policy_index` its index).

    Times (`at`) are on the host's monotonic clock in ns; `duration` is in ns.
    For `ENGINE_FAULT`, `name` holds the error message and `fault` what sent the call down the
    recovery path (`trap`, `contract` or `invalid`, docs/hosts.md).
    """

    at: int
    kind: EventKind
    policy: str
    policy_index: int
    key: str
    call: int
    attempt: int
    reason: Reason
    duration: int
    state_from: BreakerState
    state_to: BreakerState
    name: str
    value: int
    fault: str = ""


@dataclass(frozen=True, slots=True)
class LoadError:
    """An error in a policy document or in imported state: where (`path`) and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """What the host needs to know of a policy (times in ns; 0 means none)."""

    name: str
    max_attempts: int
    attempt_timeout: int
    deadline: int
    fallbacks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the engine knows of a live call."""

    policy: int
    key: str
    attempts: int
    deadline: int
    last_reason: Reason
    in_flight: bool


@dataclass(frozen=True, slots=True)
class Analysis:
    """Worst cases of a policy (see `Engine.analyze`)."""

    worst_attempts: int
    worst_latency: int | None
    amplification: float
    amplification_with_budget: float


class VerdictKind(enum.IntEnum):
    """The kind nibble of a packed verdict."""

    ATTEMPT = 0
    WAIT = 1
    DONE = 2
    RETRY = 3
    FALLBACK = 4
    FAIL = 5
    INVALID = 6
    HEDGE = 7

    @property
    def wit(self) -> str:
        return self.name.lower()


class Verdict(NamedTuple):
    """A decoded packed verdict (layout in `wit/levee.wit`)."""

    kind: VerdictKind | int
    events_pending: bool
    detail: int
    payload: int

    @classmethod
    def unpack(cls, packed: int) -> Verdict:
        k = packed & 0xF
        kind: VerdictKind | int = VerdictKind(k) if k <= 7 else k
        return cls(kind, bool(packed & 0x10), (packed >> 8) & 0xFF, packed >> 16)

    def __str__(self) -> str:
        kind = self.kind.wit if isinstance(self.kind, VerdictKind) else f"kind-{self.kind}"
        if self.kind in (VerdictKind.WAIT, VerdictKind.RETRY, VerdictKind.FAIL):
            return f"{kind}(reason={Reason.from_code(self.detail).wit}, ns={self.payload})"
        if self.kind == VerdictKind.ATTEMPT:
            return f"attempt(n={self.detail}, timeout_ns={self.payload})"
        if self.kind == VerdictKind.HEDGE:
            return f"hedge(n={self.detail}, timeout_ns={self.payload})"
        if self.kind == VerdictKind.FALLBACK:
            return f"fallback(index={self.payload}, reason={Reason.from_code(self.detail).wit})"
        if self.kind == VerdictKind.INVALID:
            return f"invalid(code={self.detail})"
        return kind


class DurableAction(enum.Enum):
    """What a host does next with a durable call (WIT `durable-action`)."""

    RUN = "run"
    WAIT = "wait"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"


class DurableReason(enum.Enum):
    """Why a durable call ended (WIT `durable-reason`)."""

    NONE = "none"
    DEADLINE = "deadline"
    RETRIES_EXHAUSTED = "retries-exhausted"
    NON_RETRYABLE = "non-retryable"
    NON_IDEMPOTENT = "non-idempotent"
    RETRY_AFTER_TOO_LONG = "retry-after-too-long"
    PUSHBACK = "pushback"
    CANCELLED = "cancelled"
    UNKNOWN_OUTCOME = "unknown-outcome"
    CRASH_LIMIT = "crash-limit"


@dataclass(frozen=True, slots=True)
class DurableStep:
    """The core's answer to a durable operation, with the record bytes to persist."""

    action: DurableAction
    attempt: int
    wait: int
    timeout: int
    next_at: int
    lease_until: int
    reason: DurableReason
    policy_changed: bool
    record: bytes


# The durable executor's machine (WIT `resource executor`, docs/durable.md "The executor"): its
# configuration, the events a host feeds it and the commands it answers. Times are ns.


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """WIT `executor-config`: a zero takes the core's default."""

    owner: str
    concurrency: int = 0
    poll: int = 0
    claim_hold: int = 0
    until_idle: bool = False


@dataclass(frozen=True, slots=True)
class ClaimedCall:
    """WIT `claimed-call`: a row the store's `claim` returned."""

    id: int
    handler: str
    record: bytes
    db_now: int


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """WIT `write-result.failed`: the store failed a write, with its error."""

    error: str


#: WIT `write-result`: the row was written (`"applied"`), the fence refused it (`"lost"`), or
#: the store failed (`WriteFailed`).
WriteResult = Literal["applied", "lost"] | WriteFailed


@dataclass(frozen=True, slots=True)
class ExecPoll:
    """Event `poll`: look at the store (starting, woken, a `sleep` ended)."""


@dataclass(frozen=True, slots=True)
class ExecClaimed:
    """Event `claimed`: the claim returned these rows."""

    rows: tuple[ClaimedCall, ...]


@dataclass(frozen=True, slots=True)
class ExecClaimFailed:
    """Event `claim-failed`: the claim failed with the store's error."""

    error: str


@dataclass(frozen=True, slots=True)
class ExecDueIn:
    """Event `next-due`: the store's answer to `ExecNextDue` (None: no call is pending)."""

    due_in: int | None


@dataclass(frozen=True, slots=True)
class ExecWritten:
    """Event `written`: call `id`'s write came to `result`."""

    id: int
    result: WriteResult


@dataclass(frozen=True, slots=True)
class ExecRenew:
    """Event `renew`: call `id`'s renewal timer fired."""

    id: int


@dataclass(frozen=True, slots=True)
class ExecFinished:
    """Event `finished`: call `id`'s handler ended (as for `engine.report`; `message` the
    error's text, empty for a timeout; `flags` bit 0: overloaded)."""

    id: int
    kind: OutcomeKind
    code: int = 0
    text: str = ""
    message: str = ""
    flags: int = 0


ExecEvent = ExecPoll | ExecClaimed | ExecClaimFailed | ExecDueIn | ExecWritten | ExecRenew | ExecFinished


@dataclass(frozen=True, slots=True)
class ExecClaim:
    """Command `claim`: run the store's `claim` for up to `limit` calls held `hold` ns."""

    limit: int
    hold: int


@dataclass(frozen=True, slots=True)
class RowWrite:
    """WIT `row-write` (command `write`, and an operator's answer): a row to write."""

    id: int
    status: str
    next_at: int
    attempts: int
    record: bytes
    lease: bool
    keep_result: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class ExecRun:
    """Command `run`: attempt `attempt` of call `id`, cancelled after `timeout` ns (0: none),
    renewed every `renew_every` ns."""

    id: int
    attempt: int
    timeout: int
    renew_every: int


@dataclass(frozen=True, slots=True)
class ExecAbandon:
    """Command `abandon`: cancel call `id`'s handler and forget it; nothing is recorded."""

    id: int


@dataclass(frozen=True, slots=True)
class ExecQuarantine:
    """Command `quarantine`: set call `id`'s row aside with `error`."""

    id: int
    error: str


@dataclass(frozen=True, slots=True)
class ExecNextDue:
    """Command `next-due`: ask the store when the next call is due."""


@dataclass(frozen=True, slots=True)
class ExecSleep:
    """Command `sleep`: until `until` on the host's monotonic clock, or until woken."""

    until: int


@dataclass(frozen=True, slots=True)
class ExecIdle:
    """Command `idle`: nothing is pending or running (run until idle): stop."""


@dataclass(frozen=True, slots=True)
class ExecLog:
    """Command `log`: `level` is `warn` (tried again by itself) or `error`; `id` 0 for none."""

    level: str
    id: int
    text: str


ExecCommand = (
    ExecClaim | RowWrite | ExecRun | ExecAbandon | ExecQuarantine | ExecNextDue | ExecSleep | ExecIdle | ExecLog
)
