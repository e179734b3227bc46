// Package bench compares the per-call overhead of the Go host of Levee with
// failsafe-go and with gobreaker + cenkalti/backoff, for a function that
// succeeds the first time under an equivalent retry + circuit breaker policy:
// 3 attempts, exponential backoff 100 ms x2 capped at 5 s with jitter, a breaker
// over a count window of 100 calls opening at a 50% failure rate after 100
// calls, open for 60 s. The benchmarks (bench_test.go) time it; hotloop/ and
// instructions.sh count its instructions under callgrind.
package bench

import (
	"context"
	_ "embed"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/failsafe-go/failsafe-go"
	"github.com/failsafe-go/failsafe-go/circuitbreaker"
	"github.com/failsafe-go/failsafe-go/retrypolicy"
	"github.com/sony/gobreaker/v2"
)

// Doc is the Levee policy document (policy.yaml, which the host's own guest-call
// benchmark reads too); its policy is "api".
//
//go:embed policy.yaml
var Doc string

var sink int

// Work is the function under every policy: it increments a counter and succeeds.
func Work(context.Context) error { sink++; return nil }

// FailsafeExecutor is the failsafe-go equivalent of Doc.
func FailsafeExecutor() failsafe.Executor[any] {
	rp := retrypolicy.NewBuilder[any]().WithMaxAttempts(3).WithBackoffFactor(100*time.Millisecond, 5*time.Second, 2).
		WithJitterFactor(0.5).Build()
	cb := circuitbreaker.NewBuilder[any]().WithFailureThresholdRatio(50, 100).WithDelay(60 * time.Second).Build()
	return failsafe.With[any](rp, cb)
}

// GobreakerCB is the gobreaker breaker of Doc (GobreakerCall adds the retries).
func GobreakerCB() *gobreaker.CircuitBreaker[any] {
	return gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:    "api",
		Timeout: 60 * time.Second,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.Requests >= 100 && c.TotalFailures*2 >= c.Requests
		},
	})
}

// GobreakerCall runs Work under cb with cenkalti/backoff's retries.
func GobreakerCall(ctx context.Context, cb *gobreaker.CircuitBreaker[any]) error {
	return GobreakerCallWith(ctx, cb, Work)
}

// GobreakerCallWith runs work under cb with cenkalti/backoff's retries.
func GobreakerCallWith(ctx context.Context, cb *gobreaker.CircuitBreaker[any], work func(context.Context) error) error {
	eb := backoff.NewExponentialBackOff()
	eb.InitialInterval, eb.Multiplier, eb.MaxInterval, eb.RandomizationFactor = 100*time.Millisecond, 2, 5*time.Second, 0.5
	_, err := backoff.Retry(ctx, func() (any, error) {
		return cb.Execute(func() (any, error) { return nil, work(ctx) })
	}, backoff.WithBackOff(eb), backoff.WithMaxTries(3))
	return err
}
