// Command load measures the CPU time per call of Levee's Go host against
// failsafe-go and gobreaker + cenkalti/backoff at production load: N
// goroutines share one engine (one executor, one breaker) and each makes
// -rounds calls of a function that waits 5 ms, so about N calls are in flight
// at any time. CPU time is the process's user + system time (getrusage)
// across the whole level, divided by the calls made; every contender runs at
// every level in the same process, so the ratios of one run are comparable.
// The contender "bare" calls the function under no policy: what every
// contender pays anyway (the goroutine, the wait's timer, the scheduler), so a
// library's own cost per call is its figure less bare's.
//
//	go run ./load                                   # 1, 1,000, 10,000, 40,000 in flight
//	go run ./load -levels 1,100 -rounds 5 -single 20  # the CI smoke run
//
// With -parallel the same program measures the engine shared by goroutines
// running flat out (no wait in the function) on GOMAXPROCS threads: see
// docs/scaling.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/bench"
)

func cpu() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

type contender struct {
	name string
	call func(ctx context.Context, work func(context.Context) error) error
}

func contenders(ctx context.Context) ([]contender, func()) {
	e, err := levee.Load(ctx, bench.Doc, levee.WithSeed(1))
	if err != nil {
		fail(err)
	}
	p, err := e.Policy("api")
	if err != nil {
		fail(err)
	}
	fs := bench.FailsafeExecutor()
	cb := bench.GobreakerCB()
	return []contender{
			{"levee", func(ctx context.Context, w func(context.Context) error) error { return levee.Do(ctx, p, w) }},
			{"failsafe-go", func(ctx context.Context, w func(context.Context) error) error {
				return fs.WithContext(ctx).Run(func() error { return w(ctx) })
			}},
			{"gobreaker+backoff", func(ctx context.Context, w func(context.Context) error) error {
				return bench.GobreakerCallWith(ctx, cb, w)
			}},
			{"bare", func(ctx context.Context, w func(context.Context) error) error { return w(ctx) }},
		}, func() {
			_ = e.Close(ctx)
		}
}

// level runs n callers of c, each making rounds calls, and returns the CPU
// time per call and the wall time.
func level(ctx context.Context, c contender, n, rounds int, work func(context.Context) error) (time.Duration, time.Duration) {
	runtime.GC()
	var wg sync.WaitGroup
	start := make(chan struct{})
	wg.Add(n)
	c0, w0 := cpu(), time.Now()
	for i := 0; i < n; i++ {
		go func() {
			defer wg.Done()
			<-start
			for r := 0; r < rounds; r++ {
				if err := c.call(ctx, work); err != nil {
					fail(fmt.Errorf("%s: %w", c.name, err))
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	return (cpu() - c0) / time.Duration(n*rounds), time.Since(w0)
}

func main() {
	levels := flag.String("levels", "1,1000,10000,40000", "callers in flight, comma-separated")
	rounds := flag.Int("rounds", 20, "calls per caller (levels above 1)")
	single := flag.Int("single", 400, "calls of the single caller (level 1)")
	wait := flag.Duration("wait", 5*time.Millisecond, "how long the function waits")
	profile := flag.String("cpuprofile", "", "write a CPU profile of levee's runs to this file")
	only := flag.String("only", "", "run only this contender")
	parallel := flag.Int("parallel", 0, "instead: this many goroutines calling flat out, each this many calls (-rounds)")
	flag.Parse()
	ctx := context.Background()
	debug.SetGCPercent(100)
	cs, closeAll := contenders(ctx)
	defer closeAll()
	if *only != "" {
		for _, c := range cs {
			if c.name == *only {
				cs = []contender{c}
			}
		}
		if len(cs) != 1 {
			fail(fmt.Errorf("no contender %q", *only))
		}
	}
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			fail(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fail(err)
		}
		defer pprof.StopCPUProfile()
	}
	work := func(context.Context) error { time.Sleep(*wait); return nil }
	if *parallel > 0 {
		work = bench.Work
	}
	// warm up every contender
	for _, c := range cs {
		level(ctx, c, 10, 10, bench.Work)
	}
	if *parallel > 0 {
		fmt.Printf("# Go %s, GOMAXPROCS %d, no wait (flat out), time per call\n", runtime.Version(), runtime.GOMAXPROCS(0))
		fmt.Printf("%-18s %8s %14s %14s\n", "contender", "threads", "wall ns/call", "CPU ns/call")
		for _, c := range cs {
			cpuPer, wall := level(ctx, c, *parallel, *rounds, work)
			fmt.Printf("%-18s %8d %14.0f %14.0f\n", c.name, *parallel, float64(wall.Nanoseconds())/float64(*parallel**rounds), float64(cpuPer.Nanoseconds()))
		}
		return
	}
	fmt.Printf("# Go %s, GOMAXPROCS %d, %s wait, CPU time (user+system) per call\n", runtime.Version(), runtime.GOMAXPROCS(0), *wait)
	fmt.Printf("%-10s %-18s %10s %10s %12s %8s\n", "in flight", "contender", "calls", "wall", "CPU us/call", "levee/this")
	for _, s := range strings.Split(*levels, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			fail(fmt.Errorf("bad level %q", s))
		}
		// One caller is mostly an idle process whose CPU per call is the runtime's
		// wake-ups, which drift with whatever else the machine runs: level 1 runs
		// in blocks, the contenders taking turns (a b c, c b a, ...), each figure
		// over all of its blocks.
		r, blocks := *rounds, 1
		if n == 1 {
			blocks = 4
			r = max(1, *single/blocks)
		}
		cpuTotal := make([]time.Duration, len(cs))
		wallTotal := make([]time.Duration, len(cs))
		for b := 0; b < blocks; b++ {
			for j := range cs {
				i := j
				if b%2 == 1 {
					i = len(cs) - 1 - j
				}
				per, wall := level(ctx, cs[i], n, r, work)
				cpuTotal[i] += per * time.Duration(n*r)
				wallTotal[i] += wall
			}
		}
		calls := n * r * blocks
		first := cpuTotal[0] / time.Duration(calls)
		for i, c := range cs {
			per := cpuTotal[i] / time.Duration(calls)
			fmt.Printf("%-10d %-18s %10d %10s %12.2f %8.2f\n", n, c.name, calls, wallTotal[i].Round(time.Millisecond), float64(per.Nanoseconds())/1e3, float64(first)/float64(per))
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "load:", err)
	os.Exit(1)
}
