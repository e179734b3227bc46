// Command bench measures the CPU time per unary gRPC call of a client with no interceptor,
// with Levee's interceptor (leveegrpc), with failsafe-go's failsafegrpc interceptor, and with
// grpc's built-in retry configured through the service config: the same retry (3 attempts,
// UNAVAILABLE retried, exponential backoff) in the last three, every call a success, one
// goroutine, over a local connection to the Flaky server, which runs in a child process so
// that the figure is the client's alone. CPU time is the process's user + system time
// (getrusage) over a round, divided by its calls; the contenders take turns, round after
// round, in one run, and the table gives each one's median round.
//
//	go run .                       # 21 rounds of 5,000 calls each
//	go run . -rounds 3 -calls 2000 # a quick look
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/failsafe-go/failsafe-go/failsafegrpc"
	levee "github.com/levee-dev/levee/host-bindings/go"
	leveegrpc "github.com/levee-dev/levee/host-bindings/go/grpc"
	pb "github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakypb"
	"github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakyserver"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const doc = `
policies:
  api:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 5s, jitter: full }
`

// serviceConfig is the same retry as gRPC's service config (docs/grpc.md).
const serviceConfig = `{"methodConfig": [{"name": [{"service": "levee.flaky.v1.Flaky"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "5s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`

func cpu() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}

// serve runs the Flaky server until stdin closes (the child process).
func serve() {
	s, err := flakyserver.Start()
	if err != nil {
		fail(err)
	}
	fmt.Println(s.Addr)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	s.Stop()
}

type contender struct {
	name   string
	client pb.FlakyClient
	cpu    []time.Duration // per call, one per round
	allocs []float64
}

func main() {
	rounds := flag.Int("rounds", 21, "rounds (each contender once per round)")
	calls := flag.Int("calls", 5000, "calls per contender per round")
	warm := flag.Int("warm", 500, "calls of each contender before the rounds")
	child := flag.Bool("serve", false, "run the server, print its address, stop when stdin closes")
	server := flag.String("addr", "", "the address of a server started with -serve (default: start one)")
	only := flag.String("only", "", "run only the contenders whose name has this prefix")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the rounds to this file")
	flag.Parse()
	if *child {
		serve()
		return
	}
	addr := *server
	if addr == "" {
		self, err := os.Executable()
		if err != nil {
			fail(err)
		}
		cmd := exec.Command(self, "-serve")
		cmd.Stderr = os.Stderr
		stdin, _ := cmd.StdinPipe()
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			fail(err)
		}
		_ = stdin // the server stops when this process exits and its stdin closes
		if addr, err = bufio.NewReader(stdout).ReadString('\n'); err != nil {
			fail(err)
		}
	}
	addr = strings.TrimSpace(addr)

	ctx := context.Background()
	eng, err := levee.Load(ctx, doc, levee.WithSeed(1))
	if err != nil {
		fail(err)
	}
	p, err := eng.Policy("api")
	if err != nil {
		fail(err)
	}
	rp := failsafegrpc.NewRetryPolicyBuilder[*pb.Reply]().WithMaxAttempts(3).
		WithBackoff(100*time.Millisecond, 5*time.Second).WithJitterFactor(1).Build()
	dial := func(opts ...grpc.DialOption) pb.FlakyClient {
		cc, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
		if err != nil {
			fail(err)
		}
		return pb.NewFlakyClient(cc)
	}
	cs := []*contender{
		{name: "no interceptor", client: dial(grpc.WithDisableRetry())},
		{name: "Levee (leveegrpc)", client: dial(grpc.WithDisableRetry(), grpc.WithUnaryInterceptor(leveegrpc.UnaryClientInterceptor(p)))},
		{name: "failsafe-go (failsafegrpc)", client: dial(grpc.WithDisableRetry(), grpc.WithUnaryInterceptor(failsafegrpc.NewUnaryClientInterceptor[*pb.Reply](rp)))},
		{name: "grpc built-in retry (service config)", client: dial(grpc.WithDefaultServiceConfig(serviceConfig))},
	}
	if *only != "" {
		cs = slices.DeleteFunc(cs, func(c *contender) bool { return !strings.HasPrefix(c.name, *only) })
		if len(cs) == 0 {
			fail(fmt.Errorf("no contender named %q...", *only))
		}
	}
	req := &pb.Request{Script: "bench", Payload: []byte("0123456789abcdef")}
	run := func(c *contender, n int) {
		for range n {
			if _, err := c.client.Unary(ctx, req); err != nil {
				fail(fmt.Errorf("%s: %w", c.name, err))
			}
		}
	}
	for _, c := range cs {
		run(c, *warm) // warm: connections, caches
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
	var ms runtime.MemStats
	for range *rounds {
		for _, c := range cs {
			runtime.GC()
			runtime.ReadMemStats(&ms)
			m0, t0 := ms.Mallocs, cpu()
			pprof.Do(ctx, pprof.Labels("contender", c.name), func(context.Context) { run(c, *calls) })
			t1 := cpu()
			runtime.ReadMemStats(&ms)
			c.cpu = append(c.cpu, (t1-t0)/time.Duration(*calls))
			c.allocs = append(c.allocs, float64(ms.Mallocs-m0)/float64(*calls))
		}
	}
	base := median(cs[0].cpu)
	fmt.Printf("CPU per unary call (client process, user+system), median of %d rounds of %d calls; GOMAXPROCS=%d\n\n",
		*rounds, *calls, runtime.GOMAXPROCS(0))
	fmt.Println("| client | CPU per call | over no interceptor | allocations per call |")
	fmt.Println("| --- | --- | --- | --- |")
	for _, c := range cs {
		m := median(c.cpu)
		fmt.Printf("| %s | %.1f us | %+.1f us (%.2fx) | %.0f |\n", c.name, us(m), us(m-base), float64(m)/float64(base), medianF(c.allocs))
	}
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

func median(v []time.Duration) time.Duration {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func medianF(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
