package levee

import "fmt"

// Go forms of the types of the WIT interface `levee:policy/types@0.1.0`.
// Enums keep the WIT's declaration order: their numeric values are the
// Canonical ABI discriminants (and, for Reason, the detail byte of a verdict).

// Reason says why the core refused an attempt, stopped retrying, or chose a fallback.
type Reason uint8

// The cases of the WIT enum `reason`.
const (
	ReasonNone Reason = iota
	ReasonDeadline
	ReasonRetriesExhausted
	ReasonNonRetryable
	ReasonBudget
	ReasonBreakerOpen
	ReasonRateLimited
	ReasonBulkheadFull
	ReasonNonIdempotent
	ReasonRetryAfterTooLong
	ReasonPushback
	ReasonCancelled
	ReasonFallbacksFailed
)

var reasonNames = []string{"none", "deadline", "retries-exhausted", "non-retryable", "budget",
	"breaker-open", "rate-limited", "bulkhead-full", "non-idempotent", "retry-after-too-long",
	"pushback", "cancelled", "fallbacks-failed"}

func (r Reason) String() string { return enumName(reasonNames, int(r)) }

// OutcomeKind is what the host observed for one attempt.
type OutcomeKind uint8

// The cases of the WIT enum `outcome-kind`.
const (
	OutcomeSuccess OutcomeKind = iota
	OutcomeTimeout
	OutcomeConnectionError
	OutcomeHTTPStatus
	OutcomeGRPCStatus
	OutcomeErrorClass
)

var outcomeKindNames = []string{"success", "timeout", "connection-error", "http-status", "grpc-status", "error-class"}

func (k OutcomeKind) String() string { return enumName(outcomeKindNames, int(k)) }

// BreakerState is a circuit breaker state.
type BreakerState uint8

// The cases of the WIT enum `breaker-state`.
const (
	BreakerClosed BreakerState = iota
	BreakerOpen
	BreakerHalfOpen
	BreakerForcedOpen
	BreakerForcedClosed
	BreakerDisabled
)

var breakerStateNames = []string{"closed", "open", "half-open", "forced-open", "forced-closed", "disabled"}

func (s BreakerState) String() string { return enumName(breakerStateNames, int(s)) }

// EventKind is the kind of an engine event.
type EventKind uint8

// The cases of the WIT enum `event-kind`.
const (
	EventRetryScheduled EventKind = iota
	EventGaveUp
	EventRejected
	EventBudgetRefused
	EventBreakerTransition
	EventFallbackChosen
	EventRateLimitWait
	EventKeyEvicted
	EventCallEvicted
	EventPermitExpired
	// EventEngineFault is not a WIT case: the Go host reports with it that the
	// guest trapped (or broke the Canonical ABI) and was re-instantiated.
	EventEngineFault EventKind = 255
)

var eventKindNames = []string{"retry-scheduled", "gave-up", "rejected", "budget-refused",
	"breaker-transition", "fallback-chosen", "rate-limit-wait", "key-evicted", "call-evicted", "permit-expired"}

func (k EventKind) String() string {
	if k == EventEngineFault {
		return "engine-fault"
	}
	return enumName(eventKindNames, int(k))
}

func enumName(names []string, i int) string {
	if i >= 0 && i < len(names) {
		return names[i]
	}
	return fmt.Sprintf("unknown(%d)", i)
}

func enumIndex(names []string, s string) (int, bool) {
	for i, n := range names {
		if n == s {
			return i, true
		}
	}
	return 0, false
}

// ParseReason, ParseOutcomeKind, ParseBreakerState and ParseEventKind read the WIT's kebab-case names.
func ParseReason(s string) (Reason, bool) { i, ok := enumIndex(reasonNames, s); return Reason(i), ok }

// ParseOutcomeKind reads an outcome-kind name.
func ParseOutcomeKind(s string) (OutcomeKind, bool) {
	i, ok := enumIndex(outcomeKindNames, s)
	return OutcomeKind(i), ok
}

// ParseBreakerState reads a breaker-state name.
func ParseBreakerState(s string) (BreakerState, bool) {
	i, ok := enumIndex(breakerStateNames, s)
	return BreakerState(i), ok
}

// ParseEventKind reads an event-kind name.
func ParseEventKind(s string) (EventKind, bool) {
	i, ok := enumIndex(eventKindNames, s)
	return EventKind(i), ok
}

// Event is one event the engine recorded. Fields that do not apply to a kind are zero.
type Event struct {
	At        uint64 // host monotonic ns
	Kind      EventKind
	Policy    uint32
	Key       string
	Call      uint64
	Attempt   uint32
	Reason    Reason
	Duration  uint64
	StateFrom BreakerState
	StateTo   BreakerState
	Name      string
	Value     int64
	// Err is set only on EventEngineFault: what the guest did.
	Err error
}

// LoadError is an error in a policy document or in imported state.
type LoadError struct {
	Path    string `json:"path"`
	Message string `json:"message"`
}

func (e LoadError) Error() string {
	if e.Path == "" {
		return e.Message
	}
	return e.Path + ": " + e.Message
}

// PolicyInfo is what a host needs to know of a policy.
type PolicyInfo struct {
	Name           string
	MaxAttempts    uint32
	AttemptTimeout uint64 // ns, 0 = none
	Deadline       uint64 // ns, 0 = none
	Fallbacks      []string
}

// CallInfo is what the engine knows of a live call.
type CallInfo struct {
	Policy     uint32
	Key        string
	Attempts   uint32
	Deadline   uint64
	LastReason Reason
	InFlight   bool
}

// Analysis is the worst case of a policy.
type Analysis struct {
	WorstAttempts           uint32
	WorstLatency            *uint64 // nil when nothing bounds it
	Amplification           float64
	AmplificationWithBudget float64
}

// VerdictKind is the kind of a packed verdict (bits 0-3).
type VerdictKind uint8

// The verdict kinds of the packed u64.
const (
	VerdictAttempt VerdictKind = iota
	VerdictWait
	VerdictDone
	VerdictRetry
	VerdictFallback
	VerdictFail
	VerdictInvalid
)

var verdictKindNames = []string{"attempt", "wait", "done", "retry", "fallback", "fail", "invalid"}

func (k VerdictKind) String() string { return enumName(verdictKindNames, int(k)) }

// ParseVerdictKind reads a verdict kind name.
func ParseVerdictKind(s string) (VerdictKind, bool) {
	i, ok := enumIndex(verdictKindNames, s)
	return VerdictKind(i), ok
}

// Verdict is the packed u64 answer of start, acquire, report and report-fallback.
type Verdict uint64

// Kind is bits 0-3.
func (v Verdict) Kind() VerdictKind { return VerdictKind(v & 0xf) }

// EventsPending is bit 4: events wait in drain-events.
func (v Verdict) EventsPending() bool { return v&0x10 != 0 }

// Detail is bits 8-15: the attempt number, a Reason, or an invalid code.
func (v Verdict) Detail() uint8 { return uint8(v >> 8) }

// Payload is bits 16-63: ns (timeout, delay, hint) or a fallback index.
func (v Verdict) Payload() uint64 { return uint64(v) >> 16 }

// Reason reads the detail byte as a Reason (wait, retry, fallback, fail).
func (v Verdict) Reason() Reason { return Reason(v.Detail()) }

func (v Verdict) String() string {
	return fmt.Sprintf("%s(detail=%d payload=%d events=%v)", v.Kind(), v.Detail(), v.Payload(), v.EventsPending())
}

// Invalid codes (detail of an invalid verdict).
const (
	InvalidUnknownCall   = 1
	InvalidDuplicateCall = 2
	InvalidUnknownPolicy = 3
	InvalidWrongStep     = 4
	InvalidUnknownEngine = 5 // start-unkeyed with an id that names no live engine
)

// Call flags for start.
const (
	FlagNotIdempotent    uint32 = 1 << 0
	FlagIdempotencyKey   uint32 = 1 << 1
	flagMethodShift             = 8
	ReportFlagOverloaded uint32 = 1 << 0
)

// MethodFlag encodes an HTTP method into bits 8-11 of start's flags.
func MethodFlag(method string) uint32 {
	var m uint32
	switch method {
	case "":
		m = 0
	case "GET":
		m = 1
	case "HEAD":
		m = 2
	case "POST":
		m = 3
	case "PUT":
		m = 4
	case "DELETE":
		m = 5
	case "PATCH":
		m = 6
	case "OPTIONS":
		m = 7
	case "TRACE":
		m = 8
	case "CONNECT":
		m = 9
	default:
		m = 15
	}
	return m << flagMethodShift
}

// DurableAction is what a host does next with a durable call (WIT `durable-action`).
type DurableAction uint8

// The durable actions, in WIT order.
const (
	DurableRun DurableAction = iota
	DurableWait
	DurableDone
	DurableDead
	DurableCancelled
)

var durableActionNames = []string{"run", "wait", "done", "dead", "cancelled"}

func (a DurableAction) String() string { return enumName(durableActionNames, int(a)) }

// DurableReason is why a durable call ended (WIT `durable-reason`).
type DurableReason uint8

// The durable reasons, in WIT order.
const (
	DurableReasonNone DurableReason = iota
	DurableReasonDeadline
	DurableReasonRetriesExhausted
	DurableReasonNonRetryable
	DurableReasonNonIdempotent
	DurableReasonRetryAfterTooLong
	DurableReasonPushback
	DurableReasonCancelled
	DurableReasonUnknownOutcome
	DurableReasonCrashLimit
)

var durableReasonNames = []string{"none", "deadline", "retries-exhausted", "non-retryable", "non-idempotent",
	"retry-after-too-long", "pushback", "cancelled", "unknown-outcome", "crash-limit"}

func (r DurableReason) String() string { return enumName(durableReasonNames, int(r)) }

// DurableStep is the core's answer to a durable operation, with the record bytes to persist.
type DurableStep struct {
	Action        DurableAction
	Attempt       uint32
	Wait          uint64
	Timeout       uint64
	NextAt        uint64
	LeaseUntil    uint64
	Reason        DurableReason
	PolicyChanged bool
	Record        []byte
}
