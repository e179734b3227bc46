package leveegrpc

import (
	"errors"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is how a call that Levee ended reaches the caller: a gRPC status (status.Code and
// status.FromError read it) whose cause is the *levee.Error (errors.As, and errors.Is with
// levee.ErrRateLimited and the other sentinels).
//
// The status is the last attempt's when it had one (its code, message and details, as a
// call without Levee would have returned it); a call the caller cancelled ends with CANCELED
// or DEADLINE_EXCEEDED, as grpc ends it; a call refused before any attempt answered ends with
// RESOURCE_EXHAUSTED for a rate limit or a full bulkhead, UNAVAILABLE for an open breaker,
// DEADLINE_EXCEEDED for the policy's deadline, and UNKNOWN otherwise.
type Error struct {
	st    *status.Status
	cause *levee.Error
}

func (e *Error) Error() string { return e.st.Err().Error() }

// GRPCStatus is the call's status.
func (e *Error) GRPCStatus() *status.Status { return e.st }

// Unwrap is the *levee.Error.
func (e *Error) Unwrap() error { return e.cause }

// grpcStatus is the status carried by err's chain, if any.
func grpcStatus(err error) (*status.Status, bool) {
	var gs interface{ GRPCStatus() *status.Status }
	if err == nil || !errors.As(err, &gs) {
		return nil, false
	}
	st := gs.GRPCStatus()
	return st, st != nil
}

// statusError is the error a call ending with err returns to the caller.
func statusError(err error) error {
	var le *levee.Error
	if !errors.As(err, &le) {
		if _, ok := grpcStatus(err); ok {
			return unwrapOutcome(err) // an attempt's own error (the recovery path)
		}
		return err
	}
	if le.Reason == levee.ReasonCancelled && le.Ctx != nil {
		// CANCELED or DEADLINE_EXCEEDED, as grpc ends a call whose context is done
		return &Error{st: status.New(status.FromContextError(le.Ctx).Code(), le.Error()), cause: le}
	}
	if st, ok := grpcStatus(le.Last); ok {
		return &Error{st: st, cause: le}
	}
	if st, ok := grpcStatus(le.FallbackErr); ok {
		return &Error{st: st, cause: le}
	}
	// The status of a refusal is the contract's (levee.GRPCRejectedStatus), the same in every host.
	return &Error{st: status.New(codes.Code(levee.GRPCRejectedStatus(le.Reason)), le.Error()), cause: le}
}

// unwrapOutcome is the gRPC error under an attempt's outcomeError.
func unwrapOutcome(err error) error {
	if ce, ok := err.(*committedError); ok {
		err = ce.err
	}
	if oe, ok := err.(*outcomeError); ok {
		return oe.err
	}
	return err
}
