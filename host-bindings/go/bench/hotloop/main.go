// Command hotloop runs one contender of the bench/ comparison n times (after
// 2,000 calls of warm-up) on the main thread, for instructions.sh to count
// under callgrind. Levee runs with snapshots off (WithSnapshotInterval(0)):
// under valgrind the clock is slow, so the once-a-second state export would
// be charged to far fewer calls than in a real run.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/bench"
)

func init() { runtime.LockOSThread() } // main runs on the main thread: callgrind's thread 1

func main() {
	which := flag.String("which", "levee", "levee | levee-unbounded | levee-keyed | failsafe-go | gobreaker-backoff | bare")
	n := flag.Int("n", 10000, "calls after the warm-up")
	flag.Parse()
	ctx := context.Background()
	var f func() error
	switch *which {
	case "levee", "levee-unbounded", "levee-keyed":
		opts := []levee.Option{levee.WithSeed(1), levee.WithSnapshotInterval(0)}
		if *which == "levee-unbounded" {
			opts = append(opts, levee.WithGuestCallLimit(0))
		}
		e, err := levee.Load(ctx, bench.Doc, opts...)
		if err != nil {
			fail(err)
		}
		p, err := e.Policy("api")
		if err != nil {
			fail(err)
		}
		var co []levee.CallOption
		if *which == "levee-keyed" {
			co = append(co, levee.WithKey("api.example.com"))
		}
		f = func() error { return levee.Do(ctx, p, bench.Work, co...) }
	case "failsafe-go":
		ex := bench.FailsafeExecutor()
		fn := func() error { return bench.Work(ctx) }
		f = func() error { return ex.Run(fn) }
	case "gobreaker-backoff":
		cb := bench.GobreakerCB()
		f = func() error { return bench.GobreakerCall(ctx, cb) }
	case "bare": // the function under no policy
		f = func() error { return bench.Work(ctx) }
	default:
		fail(fmt.Errorf("unknown -which %q", *which))
	}
	loop(f, 2000)
	loop(f, *n)
}

//go:noinline
func loop(f func() error, n int) {
	for i := 0; i < n; i++ {
		if err := f(); err != nil {
			fail(err)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "hotloop:", err)
	os.Exit(1)
}
