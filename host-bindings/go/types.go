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

var reasonNames = cReasons[:]

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

var outcomeKindNames = cOutcomeKinds[:]

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

var breakerStateNames = cBreakerStates[:]

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
	// EventHedgeStarted: a hedged call started another attempt (Attempt is its number, 2 for the first hedge).
	EventHedgeStarted
	// EventKeyOverflow: every key held protection, so this call's key (Name) got no
	// state of its own and was decided against the shared overflow entry (Key is
	// "levee:overflow"; docs/policy.md, Keys).
	EventKeyOverflow
	// EventEngineFault is not a WIT case: the Go host reports with it that the
	// guest trapped (or broke the Canonical ABI) and was re-instantiated.
	EventEngineFault EventKind = 255
)

var eventKindNames = cEventKinds[:]

func (k EventKind) String() string {
	if k == EventEngineFault {
		return cEventEngineFault
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
	// Fault is set only on EventEngineFault: "trap", "contract" or "invalid" (docs/hosts.md, section 3).
	Fault string
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
	// VerdictHedge: run attempt 1 of a hedged call (detail 1, payload its timeout), then HedgeStep.
	VerdictHedge
)

var verdictKindNames = cVerdictKinds[:]

func (k VerdictKind) String() string { return enumName(verdictKindNames, int(k)) }

// ParseVerdictKind reads a verdict kind name.
func ParseVerdictKind(s string) (VerdictKind, bool) {
	i, ok := enumIndex(verdictKindNames, s)
	return VerdictKind(i), ok
}

// Verdict is the packed u64 answer of start, acquire, report and report-fallback.
type Verdict uint64

// Kind is bits 0-3.
func (v Verdict) Kind() VerdictKind { return VerdictKind(v & cVerdictKindMask) }

// EventsPending is bit 4: events wait in drain-events.
func (v Verdict) EventsPending() bool { return v&cVerdictEventsBit != 0 }

// WakesPending is bit 5: calls granted a bulkhead slot wait in take-wakes.
func (v Verdict) WakesPending() bool { return v&cVerdictWakesBit != 0 }

// Detail is bits 8-15: the attempt number, a Reason, or an invalid code.
func (v Verdict) Detail() uint8 { return uint8(v >> cVerdictDetailShift) }

// Payload is bits 16-63: ns (timeout, delay, hint) or a fallback index.
func (v Verdict) Payload() uint64 { return uint64(v) >> cVerdictPayloadShift }

// Reason reads the detail byte as a Reason (wait, retry, fallback, fail).
func (v Verdict) Reason() Reason { return Reason(v.Detail()) }

func (v Verdict) String() string {
	return fmt.Sprintf("%s(detail=%d payload=%d events=%v)", v.Kind(), v.Detail(), v.Payload(), v.EventsPending())
}

// HedgeCommandKind is the case of a WIT `hedge-command`.
type HedgeCommandKind uint8

// The cases of the WIT variant `hedge-command`, in WIT order.
const (
	// HedgeStart: run attempt Attempt concurrently, under Timeout (0: none).
	HedgeStart HedgeCommandKind = iota
	// HedgeCancel: abort attempt Attempt; ReportAttempt it once it has closed.
	HedgeCancel
	// HedgeWait: nothing to do for Delay ns, unless an attempt ends first; then HedgeStep.
	HedgeWait
	// HedgeEnd: the call is over with Verdict (done, fail, fallback or invalid), about attempt Attempt.
	HedgeEnd
)

var hedgeCommandNames = [...]string{"start", "cancel", "wait", "end"}

func (k HedgeCommandKind) String() string { return enumName(hedgeCommandNames[:], int(k)) }

// HedgeCommand is one command of a hedged call (docs/policy.md, "Hedging"): the fields
// that do not apply to its kind are zero.
type HedgeCommand struct {
	Kind    HedgeCommandKind
	Attempt uint32  // start, cancel, end
	Timeout uint64  // start: ns, 0 = none
	Delay   uint64  // wait: ns
	Verdict Verdict // end: the packed verdict, as report answers it
}

func (c HedgeCommand) String() string {
	switch c.Kind {
	case HedgeStart:
		return fmt.Sprintf("start(attempt=%d timeout=%d)", c.Attempt, c.Timeout)
	case HedgeCancel:
		return fmt.Sprintf("cancel(%d)", c.Attempt)
	case HedgeWait:
		return fmt.Sprintf("wait(%d)", c.Delay)
	default:
		return fmt.Sprintf("end(attempt=%d %v)", c.Attempt, c.Verdict)
	}
}

// HedgeAnswer is what HedgeStep and ReportAttempt answer: the commands, in order, and
// whether events wait to be drained.
type HedgeAnswer struct {
	Commands      []HedgeCommand
	EventsPending bool
}

// Invalid codes (detail of an invalid verdict).
const (
	InvalidUnknownCall   = cInvalidUnknownCall
	InvalidDuplicateCall = cInvalidDuplicateCall
	InvalidUnknownPolicy = cInvalidUnknownPolicy
	InvalidWrongStep     = cInvalidWrongStep
	InvalidUnknownEngine = cInvalidUnknownEngine // start-unkeyed with an id that names no live engine
)

// Call flags for start.
const (
	FlagNotIdempotent    uint32 = cStartNonIdempotent
	FlagIdempotencyKey   uint32 = cStartIdempotencyKey
	flagMethodShift             = cStartMethodShift
	ReportFlagOverloaded uint32 = cReportOverloaded
)

// MethodFlag encodes an HTTP method into bits 8-11 of start's flags. Methods are
// case-sensitive (RFC 9110, docs/hosts.md): the nine registered tokens have
// their codes, "" is none, and any other token (lower-case "get" included) is
// "other", which no default treats as idempotent.
func MethodFlag(method string) uint32 {
	if method == "" {
		return cMethodNone << flagMethodShift
	}
	m, ok := cMethods[method]
	if !ok {
		m = cMethodOther
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

var durableActionNames = cDurableActions[:]

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

var durableReasonNames = cDurableReasons[:]

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
