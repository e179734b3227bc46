//! The contract's vocabulary: reasons, outcomes, breaker states, events and packed verdicts.
//! Numbering follows `wit/levee.wit` (declaration order) and is part of the contract.

macro_rules! wit_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[repr(u8)]
        pub enum $name { $($(#[$vm])* $variant,)* }

        impl $name {
            /// Every value, in contract order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];
            /// The kebab-case name used in the WIT, policy documents and vectors.
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text,)* }
            }
            /// Parse the kebab-case name.
            pub fn from_name(text: &str) -> Option<Self> {
                match text { $($text => Some($name::$variant),)* _ => None }
            }
            /// The value with this contract number.
            pub fn from_index(index: u32) -> Option<Self> {
                Self::ALL.get(index as usize).copied()
            }
        }

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

wit_enum! {
    /// Why the core refused an attempt, stopped retrying, or chose a fallback.
    Reason {
        /// Nothing to report.
        None = "none",
        /// The deadline passed, or the next retry could not start before it.
        Deadline = "deadline",
        /// The last allowed attempt failed.
        RetriesExhausted = "retries-exhausted",
        /// The outcome is never retried.
        NonRetryable = "non-retryable",
        /// The retry budget refused the retry.
        Budget = "budget",
        /// The circuit breaker refused the attempt.
        BreakerOpen = "breaker-open",
        /// The rate limiter refused the attempt.
        RateLimited = "rate-limited",
        /// The concurrency limit is full.
        BulkheadFull = "bulkhead-full",
        /// Retryable, but the operation is not idempotent and has no idempotency key.
        NonIdempotent = "non-idempotent",
        /// The server asked for a wait above the policy's cap.
        RetryAfterTooLong = "retry-after-too-long",
        /// gRPC pushback said not to retry.
        Pushback = "pushback",
        /// The host cancelled the call.
        Cancelled = "cancelled",
        /// Every fallback failed.
        FallbacksFailed = "fallbacks-failed",
    }
}

wit_enum! {
    /// What the host observed for one attempt.
    OutcomeKind {
        /// Success.
        Success = "success",
        /// The per-attempt timeout fired.
        Timeout = "timeout",
        /// The connection failed.
        ConnectionError = "connection-error",
        /// An HTTP status (`code`), with the raw Retry-After (`text`).
        HttpStatus = "http-status",
        /// A gRPC status (`code`), with the raw pushback (`text`).
        GrpcStatus = "grpc-status",
        /// An error of a named class (`text`).
        ErrorClass = "error-class",
    }
}

wit_enum! {
    /// Circuit breaker states.
    BreakerState {
        /// Calls flow; outcomes are recorded.
        Closed = "closed",
        /// Calls are rejected until the open duration has passed.
        Open = "open",
        /// A few trial calls decide between closed and open.
        HalfOpen = "half-open",
        /// Forced by an operator: every call is rejected.
        ForcedOpen = "forced-open",
        /// Forced by an operator: every call passes; outcomes are still recorded, no transition.
        ForcedClosed = "forced-closed",
        /// Forced by an operator: every call passes, nothing is recorded.
        Disabled = "disabled",
    }
}

wit_enum! {
    /// Kinds of event.
    EventKind {
        /// A retry was scheduled.
        RetryScheduled = "retry-scheduled",
        /// The call stopped retrying without success.
        GaveUp = "gave-up",
        /// An attempt was rejected before it ran.
        Rejected = "rejected",
        /// The retry budget refused a retry.
        BudgetRefused = "budget-refused",
        /// The breaker changed state.
        BreakerTransition = "breaker-transition",
        /// A fallback was chosen.
        FallbackChosen = "fallback-chosen",
        /// The rate limiter asked the caller to wait.
        RateLimitWait = "rate-limit-wait",
        /// A key's state was evicted.
        KeyEvicted = "key-evicted",
        /// An unfinished call was evicted from the call table.
        CallEvicted = "call-evicted",
        /// A half-open permit expired unreported.
        PermitExpired = "permit-expired",
        /// A hedged call started another attempt (`attempt`, 2 for the first hedge).
        HedgeStarted = "hedge-started",
        /// A new key found the table full of keys holding protection: it is decided against
        /// the shared overflow entry (`key` is that entry's, `name` the new key).
        KeyOverflow = "key-overflow",
    }
}

wit_enum! {
    /// Why a verdict is `invalid` (a host bug, never a policy decision).
    InvalidCode {
        /// Not an error.
        Ok = "ok",
        /// The call id is not live.
        UnknownCall = "unknown-call",
        /// The call id is zero or already live.
        DuplicateCall = "duplicate-call",
        /// The policy index does not exist.
        UnknownPolicy = "unknown-policy",
        /// The call is not at a step where this operation is allowed.
        WrongStep = "wrong-step",
        /// No live engine has this id (`start-unkeyed`; answered by the component, whose
        /// engines have ids, never by `Engine` itself).
        UnknownEngine = "unknown-engine",
    }
}

/// One event, as in the WIT `event` record. Fields that do not apply are zero or empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// When (host monotonic ns).
    pub at: u64,
    /// What happened.
    pub kind: EventKind,
    /// Policy index.
    pub policy: u32,
    /// Key ("" for none).
    pub key: String,
    /// Call id (0 when not about one call).
    pub call: u64,
    /// Attempt number.
    pub attempt: u32,
    /// Reason.
    pub reason: Reason,
    /// A duration in ns (delay, wait, hint).
    pub duration: u64,
    /// Breaker state before a transition.
    pub state_from: BreakerState,
    /// Breaker state after a transition.
    pub state_to: BreakerState,
    /// A name (fallback, key).
    pub name: String,
    /// A level (budget tokens).
    pub value: i64,
}

impl Event {
    /// An event with every optional field empty.
    pub fn new(at: u64, kind: EventKind, policy: u32, key: &str) -> Self {
        Event {
            at,
            kind,
            policy,
            key: key.to_string(),
            call: 0,
            attempt: 0,
            reason: Reason::None,
            duration: 0,
            state_from: BreakerState::Closed,
            state_to: BreakerState::Closed,
            name: String::new(),
            value: 0,
        }
    }
}

/// Kinds of packed verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum VerdictKind {
    /// Run an attempt (detail: attempt number; payload: per-attempt timeout, 0 = none).
    Attempt = 0,
    /// Sleep `payload` then acquire again (detail: reason).
    Wait = 1,
    /// The call succeeded.
    Done = 2,
    /// Sleep `payload` holding nothing, then acquire (detail: reason of the failure).
    Retry = 3,
    /// Run fallback number `payload` (detail: the reason that triggered it).
    Fallback = 4,
    /// The call failed (detail: reason; payload: retry-after hint, 0 = none).
    Fail = 5,
    /// The host made a protocol error (detail: [`InvalidCode`]).
    Invalid = 6,
    /// Run the first attempt of a hedged call (detail: 1; payload: its timeout, 0 = none),
    /// then drive the call with `hedge-step` and `report-attempt`.
    Hedge = 7,
}

impl VerdictKind {
    /// Name used in vectors.
    pub fn name(self) -> &'static str {
        match self {
            VerdictKind::Attempt => "attempt",
            VerdictKind::Wait => "wait",
            VerdictKind::Done => "done",
            VerdictKind::Retry => "retry",
            VerdictKind::Fallback => "fallback",
            VerdictKind::Fail => "fail",
            VerdictKind::Invalid => "invalid",
            VerdictKind::Hedge => "hedge",
        }
    }

    fn from_bits(bits: u64) -> Option<Self> {
        Some(match bits {
            0 => VerdictKind::Attempt,
            1 => VerdictKind::Wait,
            2 => VerdictKind::Done,
            3 => VerdictKind::Retry,
            4 => VerdictKind::Fallback,
            5 => VerdictKind::Fail,
            6 => VerdictKind::Invalid,
            7 => VerdictKind::Hedge,
            _ => return None,
        })
    }
}

/// A packed verdict: `kind | events_pending << 4 | wakes_pending << 5 | detail << 8 | payload << 16`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Verdict(pub u64);

/// Largest payload (nanoseconds) a verdict carries; larger values saturate to it (about 78 hours).
pub const PAYLOAD_MAX: u64 = (1 << 48) - 1;

impl Verdict {
    /// Pack a verdict; the payload saturates at [`PAYLOAD_MAX`].
    pub fn new(kind: VerdictKind, detail: u8, payload: u64) -> Self {
        Verdict(kind as u64 | (u64::from(detail) << 8) | (payload.min(PAYLOAD_MAX) << 16))
    }
    /// An attempt verdict.
    pub fn attempt(number: u32, timeout: u64) -> Self {
        Verdict::new(VerdictKind::Attempt, number.min(255) as u8, timeout)
    }
    /// An invalid verdict.
    pub fn invalid(code: InvalidCode) -> Self {
        Verdict::new(VerdictKind::Invalid, code as u8, 0)
    }
    /// Set the events-pending bit.
    pub fn with_events(self, pending: bool) -> Self {
        if pending {
            Verdict(self.0 | 1 << 4)
        } else {
            Verdict(self.0 & !(1 << 4))
        }
    }
    /// Set the wakes-pending bit (bit 5): calls were granted a bulkhead slot, `take-wakes`.
    pub fn with_wakes(self, pending: bool) -> Self {
        if pending {
            Verdict(self.0 | 1 << 5)
        } else {
            Verdict(self.0 & !(1 << 5))
        }
    }
    /// Whether granted calls wait to be woken (`take-wakes`).
    pub fn wakes_pending(self) -> bool {
        self.0 & (1 << 5) != 0
    }
    /// The kind (`None` only for a value that was not made by this crate).
    pub fn kind(self) -> Option<VerdictKind> {
        VerdictKind::from_bits(self.0 & 0xF)
    }
    /// Whether events are waiting to be drained.
    pub fn events_pending(self) -> bool {
        self.0 & (1 << 4) != 0
    }
    /// The detail byte.
    pub fn detail(self) -> u8 {
        ((self.0 >> 8) & 0xFF) as u8
    }
    /// The payload.
    pub fn payload(self) -> u64 {
        self.0 >> 16
    }
    /// The detail as a reason (for wait, retry, fallback and fail).
    pub fn reason(self) -> Reason {
        Reason::from_index(u32::from(self.detail())).unwrap_or(Reason::None)
    }
}

impl core::fmt::Debug for Verdict {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let kind = self.kind().map(VerdictKind::name).unwrap_or("?");
        write!(f, "{kind}(detail={}, payload={}{})", self.detail(), self.payload(), if self.events_pending() { ", events" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_packing_round_trips_and_saturates() {
        let v = Verdict::new(VerdictKind::Retry, Reason::Budget as u8, 1_500).with_events(true);
        assert_eq!(v.kind(), Some(VerdictKind::Retry));
        assert_eq!(v.reason(), Reason::Budget);
        assert_eq!(v.payload(), 1_500);
        assert!(v.events_pending());
        assert!(!v.with_events(false).events_pending());
        let w = v.with_wakes(true);
        assert!(w.wakes_pending() && w.events_pending() && w.kind() == v.kind() && w.detail() == v.detail() && w.payload() == v.payload());
        assert!(!w.with_wakes(false).wakes_pending());
        assert_eq!(Verdict::new(VerdictKind::Wait, 0, u64::MAX).payload(), PAYLOAD_MAX);
        assert_eq!(Verdict::attempt(1000, 5).detail(), 255);
    }

    #[test]
    fn enum_names_round_trip() {
        for r in Reason::ALL {
            assert_eq!(Reason::from_name(r.name()), Some(*r));
        }
        assert_eq!(Reason::from_index(12), Some(Reason::FallbacksFailed));
        assert_eq!(Reason::from_index(13), None);
        assert_eq!(BreakerState::from_name("half-open"), Some(BreakerState::HalfOpen));
    }
}
