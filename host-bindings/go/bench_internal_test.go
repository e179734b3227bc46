package levee

import (
	"context"
	"os"
	"testing"
	"time"
)

// Costs of single guest calls, with and without the guest-call bound
// (the instrumented module and its watchdog), for docs/perf/go.md:
// a bare crossing, and `start` settling the previous call's success (the
// whole guest work of a call that succeeds first time) under a retry-only
// policy and under the retry + breaker policy of the bench/ comparison.
func BenchmarkGuestCalls(b *testing.B) {
	docs := []struct{ name, doc string }{
		{"retry", "policies:\n  api:\n    attempts: 3\n"},
		{"retry+breaker", readBenchDoc(b)},
	}
	for _, limit := range []time.Duration{time.Second, 0} {
		name := "bounded"
		if limit == 0 {
			name = "unbounded"
		}
		for _, d := range docs {
			e, err := Load(context.Background(), d.doc, WithGuestCallLimit(limit), WithSeed(1))
			if err != nil {
				b.Fatal(err)
			}
			if d.name == "retry" {
				b.Run(name+"/policy-count", func(b *testing.B) {
					for i := 0; i < b.N; i++ {
						if _, err := e.PolicyCount(); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
			b.Run(name+"/start-settling-previous/"+d.name, func(b *testing.B) {
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
			// The crossing alone: the instance's start with a synthetic clock, no
			// lock, no clock reading, no bookkeeping (what the host adds is
			// Do's time minus this).
			b.Run(name+"/start-crossing-only/"+d.name, func(b *testing.B) {
				e.mu.Lock()
				defer e.mu.Unlock()
				prev, now := uint64(0), e.Now()
				ctx := context.Background()
				for i := 0; i < b.N; i++ {
					c := e.NewCallID()
					now += 1000
					if _, err := e.in.start(ctx, e.rep, c, 0, "", 0, now, prev, now, 1); err != nil {
						b.Fatal(err)
					}
					prev = c
				}
				if prev != 0 {
					if _, err := e.in.report(ctx, e.rep, prev, now, 1, OutcomeSuccess, 0, "", 0, 0); err != nil {
						b.Fatal(err)
					}
				}
			})
			_ = e.Close(context.Background())
		}
	}
}

// readBenchDoc is the policy of bench/ (retry + breaker), read from the file its
// benchmarks embed.
func readBenchDoc(tb testing.TB) string {
	doc, err := os.ReadFile("bench/policy.yaml")
	if err != nil {
		tb.Fatal(err)
	}
	return string(doc)
}
