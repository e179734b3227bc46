// Package bench compares the per-call overhead of the Go host of Levee with
// failsafe-go and with gobreaker + cenkalti/backoff, for a function that
// succeeds the first time under an equivalent retry + circuit breaker policy:
// 3 attempts, exponential backoff 100 ms x2 capped at 5 s with jitter, a breaker
// over a count window of 100 calls opening at a 50% failure rate after 100
// calls, open for 60 s.
package bench

import (
	"context"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/failsafe-go/failsafe-go"
	"github.com/failsafe-go/failsafe-go/circuitbreaker"
	"github.com/failsafe-go/failsafe-go/retrypolicy"
	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/sony/gobreaker/v2"
)

const doc = `
policies:
  api:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 5s, jitter: full }
    breaker:
      window: { kind: count, size: 100 }
      failure-rate: 50
      minimum-calls: 100
      open-duration: 60s
`

var sink int

func work(context.Context) error { sink++; return nil }

func leveePolicy(b *testing.B, opts ...levee.Option) *levee.Policy {
	e, err := levee.Load(context.Background(), doc, append([]levee.Option{levee.WithSeed(1)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = e.Close(context.Background()) })
	p, err := e.Policy("api")
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func BenchmarkBare(b *testing.B) {
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		_ = work(ctx)
	}
}

func BenchmarkLevee(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, work); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLeveeUnbounded turns the guest-call bound off (WithGuestCallLimit(0)).
func BenchmarkLeveeUnbounded(b *testing.B) {
	p := leveePolicy(b, levee.WithGuestCallLimit(0))
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, work); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLeveeKeyed(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	key := levee.WithKey("api.example.com")
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, work, key); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLeveeParallel(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := levee.Do(ctx, p, work); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func failsafeExecutor() failsafe.Executor[any] {
	rp := retrypolicy.NewBuilder[any]().WithMaxAttempts(3).WithBackoffFactor(100*time.Millisecond, 5*time.Second, 2).
		WithJitterFactor(0.5).Build()
	cb := circuitbreaker.NewBuilder[any]().WithFailureThresholdRatio(50, 100).WithDelay(60 * time.Second).Build()
	return failsafe.With[any](rp, cb)
}

func BenchmarkFailsafeGo(b *testing.B) {
	ex := failsafeExecutor()
	ctx := context.Background()
	fn := func() error { return work(ctx) }
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := ex.Run(fn); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFailsafeGoParallel(b *testing.B) {
	ex := failsafeExecutor()
	ctx := context.Background()
	fn := func() error { return work(ctx) }
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := ex.Run(fn); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func gobreakerCB() *gobreaker.CircuitBreaker[any] {
	return gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:    "api",
		Timeout: 60 * time.Second,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.Requests >= 100 && c.TotalFailures*2 >= c.Requests
		},
	})
}

func gobreakerCall(ctx context.Context, cb *gobreaker.CircuitBreaker[any]) error {
	eb := backoff.NewExponentialBackOff()
	eb.InitialInterval, eb.Multiplier, eb.MaxInterval, eb.RandomizationFactor = 100*time.Millisecond, 2, 5*time.Second, 0.5
	_, err := backoff.Retry(ctx, func() (any, error) {
		return cb.Execute(func() (any, error) { return nil, work(ctx) })
	}, backoff.WithBackOff(eb), backoff.WithMaxTries(3))
	return err
}

func BenchmarkGobreakerBackoff(b *testing.B) {
	cb := gobreakerCB()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := gobreakerCall(ctx, cb); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkGobreakerBackoffParallel(b *testing.B) {
	cb := gobreakerCB()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := gobreakerCall(ctx, cb); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
