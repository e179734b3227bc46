package levee_test

// Hedged calls through the public API (Do, DoValue, the Transport) on a virtual clock:
// the A6 example, the caller's cancel, a cancelled attempt that holds its bulkhead slot
// until it has closed, a fallback after every hedge failed, a hedged HTTP call against a
// loopback server (each attempt its own request, the loser cancelled), a stream body
// never hedged, and the contract checks of hedge-answers (the recovery path).

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

const ms = time.Millisecond

// hedgeLog records what each attempt did, by its number (x-levee-attempt, or its order).
type hedgeLog struct {
	mu     sync.Mutex
	clk    *leveetest.VirtualClock
	start  time.Time
	starts map[int]time.Duration
	ends   map[int]time.Duration
	errs   map[int]error
}

func newHedgeLog(clk *leveetest.VirtualClock) *hedgeLog {
	return &hedgeLog{clk: clk, start: clk.Now(), starts: map[int]time.Duration{}, ends: map[int]time.Duration{}, errs: map[int]error{}}
}

func (l *hedgeLog) begin(n int) {
	l.mu.Lock()
	l.starts[n] = l.clk.Since(l.start)
	l.mu.Unlock()
}

func (l *hedgeLog) end(n int, err error) {
	l.mu.Lock()
	l.ends[n] = l.clk.Since(l.start)
	l.errs[n] = err
	l.mu.Unlock()
}

func (l *hedgeLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for n := 1; n <= 11; n++ {
		if s, ok := l.starts[n]; ok {
			e, ended := l.ends[n]
			if ended {
				fmt.Fprintf(&b, "#%d %v-%v %v; ", n, s, e, l.errs[n])
			} else {
				fmt.Fprintf(&b, "#%d %v-open; ", n, s)
			}
		}
	}
	return b.String()
}

// waitPending blocks until exactly want timers wait on clk (the call's goroutines have
// settled), failing after 10 s of real time.
func waitPending(t *testing.T, clk *leveetest.VirtualClock, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for clk.Pending() != want {
		if time.Now().After(deadline) {
			t.Fatalf("%d timers pending, want %d", clk.Pending(), want)
		}
		time.Sleep(200 * time.Microsecond)
	}
	time.Sleep(2 * ms) // nothing else moves: the goroutines are blocked on the clock
	if n := clk.Pending(); n != want {
		t.Fatalf("%d timers pending, want %d", n, want)
	}
}

type listener struct {
	mu  sync.Mutex
	evs []levee.Event
}

func (l *listener) listen(ev levee.Event) { l.mu.Lock(); l.evs = append(l.evs, ev); l.mu.Unlock() }
func (l *listener) kinds() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, ev := range l.evs {
		s := ev.Kind.String()
		if ev.Kind == levee.EventHedgeStarted {
			s += "#" + strconv.Itoa(int(ev.Attempt))
		}
		if ev.Kind == levee.EventEngineFault {
			s += ":" + ev.Fault
		}
		out = append(out, s)
	}
	return out
}

// The A6 example through DoValue: #1 at 0, #2 at 500 ms, #1 fails UNAVAILABLE at 700 so #3
// starts at once, #2's OK at 900 wins and cancels #3, #4 never starts.
func TestHedgeA6ThroughDoValue(t *testing.T) {
	ctx := context.Background()
	clk := leveetest.NewVirtualClock()
	rec := leveetest.NewRecorder()
	ls := &listener{}
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 4, delay: 500ms, non-fatal: [\"grpc:unavailable\"] }\n",
		levee.WithClock(clk), levee.WithSeed(1), levee.WithTelemetry(rec), levee.WithListener(ls.listen))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	log := newHedgeLog(clk)
	var order atomic.Int32
	plays := map[int]func(ctx context.Context) (string, error){
		1: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, 700*ms); err != nil {
				return "", err
			}
			return "", levee.GRPCStatusError(14, "")
		},
		2: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, 400*ms); err != nil {
				return "", err
			}
			return "two", nil
		},
		3: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, time.Second); err != nil {
				return "", err
			}
			return "three", nil
		},
	}
	type res struct {
		v   string
		err error
	}
	done := make(chan res, 1)
	go func() {
		v, err := levee.DoValue(ctx, p, func(ctx context.Context) (string, error) {
			n := int(order.Add(1))
			log.begin(n)
			v, err := plays[n](ctx)
			log.end(n, err)
			return v, err
		})
		done <- res{v, err}
	}()
	waitPending(t, clk, 2) // #1's 700 ms, the wait of 500 ms
	clk.Advance(500 * ms)
	waitPending(t, clk, 3) // #1, #2, the next wait (1000 ms)
	clk.Advance(200 * ms)
	waitPending(t, clk, 3) // #2, #3, the wait of 500 ms from 700
	clk.Advance(200 * ms)
	r := <-done
	if r.err != nil || r.v != "two" {
		t.Fatalf("DoValue = %q, %v; want two (%s)", r.v, r.err, log)
	}
	waitPending(t, clk, 0)
	log.mu.Lock()
	got := fmt.Sprint(log.starts, log.ends)
	canceled := errors.Is(log.errs[3], context.Canceled)
	log.mu.Unlock()
	if want := "map[1:0s 2:500ms 3:700ms] map[1:700ms 2:900ms 3:900ms]"; got != want || !canceled {
		t.Fatalf("attempts %s (#3 cancelled: %v), want %s", got, canceled, want)
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(ls.kinds(), ","), "hedge-started#2,hedge-started#3"; got != want {
		t.Fatalf("events %s, want %s", got, want)
	}
	var hedges, attempts float64
	for _, en := range rec.Entries() {
		if en.Kind == "add" && en.Name == "levee.hedges" {
			hedges += en.Value
		}
		if en.Kind == "add" && en.Name == "levee.attempts" {
			attempts += en.Value
		}
	}
	if hedges != 2 || attempts != 2 { // the cancelled #3 is not counted
		t.Fatalf("levee.hedges %v, levee.attempts %v; want 2 and 2", hedges, attempts)
	}
}
