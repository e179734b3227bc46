// Command snapshot measures what the recovery snapshot costs the call path at many keys
// (issue 41; docs/performance.md, "Snapshots at many keys"). For each N it loads a fresh
// engine on the real clock (the snapshot is due at most once per second of it), fills N
// keys k0..k{N-1} with successful calls, opens the breaker of key "open" (so a snapshot is
// due), then one caller cycles over k0..k999 for -t, counting calls and the slowest call.
//
//	go run ./snapshot                      # N = 1, 100000, 1000000; T = 3s
//	go run ./snapshot -n 1000,20000 -t 500ms
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

const doc = `policies:
  p:
    attempts: 1
    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }
    keys: { max: 1000000 }
`

var errDown = errors.New("down")

type result struct {
	n       int
	fill    time.Duration
	calls   int
	slowest time.Duration
	faults  int64
}

func run(ctx context.Context, n int, dur time.Duration) (result, error) {
	r := result{n: n}
	var faults atomic.Int64
	e, err := levee.Load(ctx, doc, levee.WithListener(func(ev levee.Event) {
		if ev.Kind == levee.EventEngineFault {
			faults.Add(1)
		}
	}))
	if err != nil {
		return r, err
	}
	defer func() { _ = e.Close(ctx) }()
	p, err := e.Policy("p")
	if err != nil {
		return r, err
	}
	ok := func(context.Context) error { return nil }
	keys := make([]string, max(n, 1000))
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	start := time.Now()
	for i := 0; i < n; i++ {
		if err := p.Do(ctx, ok, levee.WithKey(keys[i])); err != nil {
			return r, fmt.Errorf("fill, key %d: %w", i, err)
		}
	}
	r.fill = time.Since(start)
	for i := 0; i < 2; i++ {
		_ = p.Do(ctx, func(context.Context) error { return errDown }, levee.WithKey("open"))
	}
	if err := p.Do(ctx, ok, levee.WithKey("open")); !errors.Is(err, levee.ErrBreakerOpen) {
		return r, fmt.Errorf("the breaker of key open is not open: %v", err)
	}
	runtime.GC()
	start = time.Now()
	for i := 0; ; i++ {
		t0 := time.Now()
		if err := p.Do(ctx, ok, levee.WithKey(keys[i%1000])); err != nil {
			return r, fmt.Errorf("call %d: %w", i, err)
		}
		t1 := time.Now()
		r.calls++
		r.slowest = max(r.slowest, t1.Sub(t0))
		if t1.Sub(start) >= dur {
			break
		}
	}
	r.faults = faults.Load()
	return r, nil
}

func main() {
	ns := flag.String("n", "1,100000,1000000", "the numbers of keys, comma-separated")
	dur := flag.Duration("t", 3*time.Second, "how long the caller cycles over k0..k999")
	flag.Parse()
	ctx := context.Background()
	fmt.Printf("%10s %10s %10s %10s %8s %10s %7s\n", "keys", "fill", "calls", "calls/s", "ratio", "slowest", "faults")
	var base float64
	for _, s := range strings.Split(*ns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 0 {
			fmt.Fprintf(os.Stderr, "snapshot: -n: %q is not a number of keys\n", s)
			os.Exit(2)
		}
		r, err := run(ctx, n, *dur)
		if err != nil {
			fmt.Fprintf(os.Stderr, "snapshot: N=%d: %v\n", n, err)
			os.Exit(1)
		}
		rate := float64(r.calls) / dur.Seconds()
		if base == 0 {
			base = rate
		}
		fmt.Printf("%10d %10s %10d %10.0f %8.2f %10s %7d\n", n, r.fill.Round(time.Millisecond), r.calls, rate, rate/base,
			r.slowest.Round(10*time.Microsecond), r.faults)
	}
}
