package levee

import (
	"context"
	"testing"
	"time"
)

// Costs of single guest calls, with and without the guest-call bound
// (the instrumented module and its watchdog), for docs/perf/go.md.
func BenchmarkGuestCalls(b *testing.B) {
	const doc = "policies:\n  api:\n    attempts: 3\n"
	for _, limit := range []time.Duration{time.Second, 0} {
		name := "bounded"
		if limit == 0 {
			name = "unbounded"
		}
		e, err := Load(context.Background(), doc, WithGuestCallLimit(limit), WithSeed(1))
		if err != nil {
			b.Fatal(err)
		}
		b.Run(name+"/policy-count", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := e.PolicyCount(); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/start-settling-previous", func(b *testing.B) {
			prev := uint64(0)
			for i := 0; i < b.N; i++ {
				c := e.NewCallID()
				now := e.Now()
				if _, err := e.Start(c, 0, "", 0, now, prev, now, 1); err != nil {
					b.Fatal(err)
				}
				prev = c
			}
		})
		_ = e.Close(context.Background())
	}
}
