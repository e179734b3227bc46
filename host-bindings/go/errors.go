package levee

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Sentinels, one per reason a call can end without success. A *Error matches
// the sentinel of its Reason with errors.Is.
var (
	ErrDeadline          = errors.New("levee: deadline passed")
	ErrRetriesExhausted  = errors.New("levee: retries exhausted")
	ErrNonRetryable      = errors.New("levee: outcome not retryable")
	ErrBudget            = errors.New("levee: retry budget spent")
	ErrBreakerOpen       = errors.New("levee: circuit breaker open")
	ErrRateLimited       = errors.New("levee: rate limited")
	ErrBulkheadFull      = errors.New("levee: concurrency limit full")
	ErrNonIdempotent     = errors.New("levee: not idempotent, not retried")
	ErrRetryAfterTooLong = errors.New("levee: Retry-After above the policy's cap")
	ErrPushback          = errors.New("levee: server pushback says do not retry")
	ErrCancelled         = errors.New("levee: call cancelled")
	ErrFallbacksFailed   = errors.New("levee: every fallback failed")
)

var reasonSentinels = [...]error{
	ReasonDeadline:          ErrDeadline,
	ReasonRetriesExhausted:  ErrRetriesExhausted,
	ReasonNonRetryable:      ErrNonRetryable,
	ReasonBudget:            ErrBudget,
	ReasonBreakerOpen:       ErrBreakerOpen,
	ReasonRateLimited:       ErrRateLimited,
	ReasonBulkheadFull:      ErrBulkheadFull,
	ReasonNonIdempotent:     ErrNonIdempotent,
	ReasonRetryAfterTooLong: ErrRetryAfterTooLong,
	ReasonPushback:          ErrPushback,
	ReasonCancelled:         ErrCancelled,
	ReasonFallbacksFailed:   ErrFallbacksFailed,
}

// SentinelFor returns the sentinel error of a reason (nil for ReasonNone or an unknown one).
func SentinelFor(r Reason) error {
	if int(r) < len(reasonSentinels) {
		return reasonSentinels[r]
	}
	return nil
}

// Error is how a call under a policy ends without success.
type Error struct {
	Policy string
	Reason Reason
	// Attempts made (0 when the first attempt was rejected).
	Attempts int
	// RetryAfter is the core's hint when it rejected the call (0 = none).
	RetryAfter time.Duration
	// Last is the error of the last attempt (nil when no attempt failed with an error).
	Last error
	// FallbackErr is the error of the last fallback that failed, if any.
	FallbackErr error
	// Unregistered names the fallbacks the policy's chain named that no function was
	// registered for (they count as failed).
	Unregistered []string
	// Ctx is the context's error when the call was cancelled.
	Ctx error
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "levee: policy %q: %s after %d attempt(s)", e.Policy, e.Reason, e.Attempts)
	if e.RetryAfter > 0 {
		fmt.Fprintf(&b, " (retry after %s)", e.RetryAfter)
	}
	if e.Last != nil {
		fmt.Fprintf(&b, ": %v", e.Last)
	}
	if e.FallbackErr != nil {
		fmt.Fprintf(&b, "; fallback: %v", e.FallbackErr)
	}
	if len(e.Unregistered) > 0 {
		b.WriteString("; " + unregisteredMessage(e.Unregistered))
	}
	if e.Ctx != nil && e.Ctx != e.Last {
		fmt.Fprintf(&b, "; %v", e.Ctx)
	}
	return b.String()
}

// Is matches the sentinel of the error's reason.
func (e *Error) Is(target error) bool {
	s := SentinelFor(e.Reason)
	return s != nil && target == s
}

// Timeout says whether the call ended because a deadline passed: the policy's
// (ReasonDeadline) or the caller's context deadline (a cancelled call whose Ctx is
// context.DeadlineExceeded). So a *Error is a timeout for os.IsTimeout and for
// url.Error.Timeout, whichever of an http.Client's two timeout signals cut the call.
func (e *Error) Timeout() bool {
	return e.Reason == ReasonDeadline || (e.Reason == ReasonCancelled && errors.Is(e.Ctx, context.DeadlineExceeded))
}

// Unwrap gives the last attempt's error, the fallback's error and the context's error.
func (e *Error) Unwrap() []error {
	out := make([]error, 0, 3)
	for _, err := range []error{e.Last, e.FallbackErr, e.Ctx} {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

// Outcome is what the host observed for one attempt, as the core's `report` takes it.
type Outcome struct {
	Kind OutcomeKind
	Code int32
	// Text is the raw Retry-After (http-status), the raw grpc-retry-pushback-ms
	// (grpc-status), or the error class name (error-class).
	Text string
	// Overloaded marks a response carrying x-envoy-overloaded.
	Overloaded bool
}

// OutcomeError is an error that says which outcome it stands for. Do reports
// such an error's outcome as it is; see Classify for the others.
type OutcomeError interface {
	error
	LeveeOutcome() Outcome
}

type outcomeError struct {
	o   Outcome
	err error
}

func (e *outcomeError) Error() string {
	s := fmt.Sprintf("%s %d", e.o.Kind, e.o.Code)
	if e.o.Kind == OutcomeErrorClass {
		s = e.o.Text
	}
	if e.err != nil {
		return s + ": " + e.err.Error()
	}
	return s
}
func (e *outcomeError) LeveeOutcome() Outcome { return e.o }
func (e *outcomeError) Unwrap() error         { return e.err }

// HTTPStatusError is an error for an HTTP response of this status, with its
// raw Retry-After header ("" if absent).
func HTTPStatusError(code int, retryAfter string) error {
	return &outcomeError{o: Outcome{Kind: OutcomeHTTPStatus, Code: int32(code), Text: retryAfter}}
}

// TrailerPushback is the gRPC trailing-metadata key whose raw value GRPCStatusError takes
// (grpc-retry-pushback-ms; the core parses it).
const TrailerPushback = cHttpPushbackTrailer

// GRPCAttemptHeader is HeaderAttempt as gRPC metadata (lower case): every attempt's number.
const GRPCAttemptHeader = cHttpAttemptHeader

// GRPCPreviousAttemptsHeader is gRPC A6's metadata of every attempt after the first: the
// number of attempts already sent for the call (wit/constants.json, docs/grpc.md).
const GRPCPreviousAttemptsHeader = cGrpcPreviousAttemptsHeader

// GRPCRejectedStatus is the gRPC status code of a call the core ended with reason r and no
// attempt's status to give back: RESOURCE_EXHAUSTED for a rate limit, a full bulkhead or a
// spent budget, UNAVAILABLE for an open breaker, DEADLINE_EXCEEDED for the policy's deadline,
// CANCELLED, and UNKNOWN for any other reason (wit/constants.json, the same in every host).
func GRPCRejectedStatus(r Reason) uint32 {
	if code, ok := cGrpcRejectedStatus[r.String()]; ok {
		return code
	}
	return cGrpcRejectedStatusOther
}

// GRPCStatusError is an error for a gRPC status, with the raw grpc-retry-pushback-ms ("" if absent).
func GRPCStatusError(code int, pushback string) error {
	return &outcomeError{o: Outcome{Kind: OutcomeGRPCStatus, Code: int32(code), Text: pushback}}
}

// ClassError names the class of err for the policy's classification.
func ClassError(class string, err error) error {
	return &outcomeError{o: Outcome{Kind: OutcomeErrorClass, Text: class}, err: err}
}

// unregisteredMessage is what every host says of fallbacks named by a policy but
// never registered.
func unregisteredMessage(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = "'" + n + "'"
	}
	if len(names) == 1 {
		return "fallback " + q[0] + " is named by the policy but not registered"
	}
	return "fallbacks " + strings.Join(q, ", ") + " are named by the policy but not registered"
}

// ErrNilArgument is wrapped by the error for a nil argument of the public API (a
// context, a function, a fallback, a listener, a request): the error names it.
var ErrNilArgument = errors.New("levee: nil argument")

func nilArg(what string) error { return fmt.Errorf("%w: %s", ErrNilArgument, what) }

var errNilEngine = nilArg("the engine is nil (Load failed?)")

// ErrUnknownPolicy is matched (errors.Is) by the error of Engine.Policy for a name
// the document does not have.
var ErrUnknownPolicy = errors.New("levee: unknown policy")

// UnknownPolicyError is the error of Engine.Policy for a name the document does not
// have: it lists the document's policies (the first 20) and the closest name.
type UnknownPolicyError struct {
	Name  string
	Known []string
}

func (e *UnknownPolicyError) Is(target error) bool { return target == ErrUnknownPolicy }

func (e *UnknownPolicyError) Error() string {
	msg := "levee: no policy named '" + e.Name + "'"
	if c, ok := closest(e.Name, e.Known); ok {
		msg += " (did you mean '" + c + "'?)"
	}
	if len(e.Known) == 0 {
		return msg + "; the document has no policies"
	}
	shown := e.Known
	if len(shown) > 20 {
		shown = shown[:20]
	}
	q := make([]string, len(shown))
	for i, n := range shown {
		q[i] = "'" + n + "'"
	}
	msg += "; the document's policies: " + strings.Join(q, ", ")
	if len(e.Known) > 20 {
		msg += fmt.Sprintf(" and %d more", len(e.Known)-20)
	}
	return msg
}

// closest is the known name nearest to name by edit distance, within a third of
// its length (at least 2).
func closest(name string, known []string) (string, bool) {
	best, bestD := "", max(2, len(name)/3)+1
	for _, k := range known {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best, best != ""
}

func editDistance(a, b string) int {
	if len(a)-len(b) > 8 || len(b)-len(a) > 8 {
		return 1 << 30
	}
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := 1
			if a[i-1] == b[j-1] {
				c = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+c)
		}
		prev = cur
	}
	return prev[len(b)]
}
