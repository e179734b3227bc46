package levee_test

// The host-scenario runner (conformance/hosts/README.md): every
// conformance/hosts/*.json is replayed through the public API (levee.DoValue
// for `call`, an http.Client over levee.Transport with an in-process fake
// RoundTripper for `http`) under a virtual clock, and the observable trace is
// compared with the scenario's, field by field. LEVEE_HOSTS_DIR names another
// folder of scenarios.

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

type hsScenario struct {
	Name      string   `json:"name"`
	Covers    []string `json:"covers"`
	Document  string   `json:"document"`
	Seed      uint64   `json:"seed"`
	WallStart int64    `json:"wall_start"`
	Calls     []hsCall `json:"calls"`
	// RetryIfPolicy is each policy's own predicate: its answers, used in order
	// by the calls of that policy without a predicate of their own.
	RetryIfPolicy map[string][]any `json:"retry_if_policy"`
}

type hsCall struct {
	API            string                     `json:"api"`
	At             int64                      `json:"at"`
	Policy         string                     `json:"policy"`
	Key            *string                    `json:"key"`
	Idempotent     *bool                      `json:"idempotent"`
	IdempotencyKey *string                    `json:"idempotency_key"`
	HTTP           *hsHTTP                    `json:"http"`
	Fallbacks      map[string]map[string]any  `json:"fallbacks"`
	CancelAt       *int64                     `json:"cancel_at"`
	Hedge          bool                       `json:"hedge"`
	RetryIf        []any                      `json:"retry_if"`
	Script         []map[string]any           `json:"script"`
	Faults         []hsFault                  `json:"faults"`
	Expect         map[string]json.RawMessage `json:"expect"`
}

type hsHTTP struct {
	Method  string            `json:"method"`
	URL     string            `json:"url"`
	Headers map[string]string `json:"headers"`
	Body    *string           `json:"body"`
}

type hsFault struct {
	Op      string `json:"op"`
	Nth     int    `json:"nth"`
	Trap    bool   `json:"trap"`
	Verdict string `json:"verdict"`
	// Commands replaces the whole answer of a hedged call's crossing (hedge-step, report-attempt)
	Commands []map[string]any `json:"commands"`
}

// hedgeAnswer is a fault's commands (the vectors' JSON form; an end's verdict in hex) as an
// answer, its events bit cleared.
func hedgeAnswer(t *testing.T, cmds []map[string]any) levee.HedgeAnswer {
	var a levee.HedgeAnswer
	for _, c := range cmds {
		for k, v := range c {
			var hc levee.HedgeCommand
			switch k {
			case "start":
				m := v.(map[string]any)
				hc = levee.HedgeCommand{Kind: levee.HedgeStart, Attempt: uint32(num(m["attempt"])), Timeout: uint64(num(m["timeout"]))}
			case "cancel":
				hc = levee.HedgeCommand{Kind: levee.HedgeCancel, Attempt: uint32(num(v))}
			case "wait":
				hc = levee.HedgeCommand{Kind: levee.HedgeWait, Delay: uint64(num(v))}
			case "end":
				m := v.(map[string]any)
				vs, _ := m["verdict"].(string)
				verdict, err := strconv.ParseUint(strings.TrimPrefix(vs, "0x"), 16, 64)
				if err != nil {
					t.Errorf("fault end verdict %q: %v", vs, err)
				}
				hc = levee.HedgeCommand{Kind: levee.HedgeEnd, Attempt: uint32(num(m["attempt"])), Verdict: levee.Verdict(verdict)}
			default:
				t.Fatalf("fault command %q is not one this runner knows", k)
			}
			a.Commands = append(a.Commands, hc)
		}
	}
	return a
}

func hostsDir(t *testing.T) string {
	if d := os.Getenv("LEVEE_HOSTS_DIR"); d != "" {
		return d
	}
	return filepath.Join("..", "..", "conformance", "hosts")
}

func TestHostScenarios(t *testing.T) {
	dir := hostsDir(t)
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range files {
		if filepath.Base(f) == "schema.json" {
			continue
		}
		n++
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var sc hsScenario
		if err := json.Unmarshal(b, &sc); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		t.Run(sc.Name, func(t *testing.T) { runScenario(t, &sc, false) })
		if hasCallAPI(&sc) {
			// again through Policy.Do, which returns no value: every field but the value
			t.Run(sc.Name+"/Do", func(t *testing.T) { runScenario(t, &sc, true) })
		}
	}
	if n == 0 {
		t.Skipf("no host scenarios in %s yet", dir)
	}
}

// ---------------------------------------------------------------- scheduling

// sched knows which goroutines of the calls (actors) are blocked on the virtual
// clock: the runner advances the clock only when every live one is. A call is
// one actor, its goroutine, plus one per attempt of a hedged call in flight
// (levee.SetHedgeSeam tells their starts and ends). Every wake-up marks its
// actor runnable synchronously, in the timer (or cancel, or attempt's close)
// that causes it, so the runner never sees an actor as blocked that is about to run.
type sched struct {
	clk     *leveetest.VirtualClock
	mu      sync.Mutex
	live    map[actor]bool // actor -> blocked
	changed chan struct{}
	origin  time.Time
	waitCtx map[actor]context.Context // the context a blocked actor waits on (nil: deaf to it)
	parked  map[int]bool              // the call's goroutine waits for an attempt of its hedged call
	played  int                       // the call whose attempt ended last (a policy's predicate runs right after it)
}

// actor is a goroutine of call `call`: its own (attempt 0), or attempt n's of a hedged call.
type actor struct{ call, attempt int }

type callKey struct{}

func callIndex(ctx context.Context) int {
	i, ok := ctx.Value(callKey{}).(int)
	if !ok {
		return -1
	}
	return i
}

// actorOf is the goroutine that runs under ctx.
func actorOf(ctx context.Context) actor { return actor{callIndex(ctx), levee.HedgeAttemptOf(ctx)} }

func (s *sched) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *sched) setBlocked(i actor, b bool) {
	s.mu.Lock()
	if _, ok := s.live[i]; ok {
		s.live[i] = b
		if !b {
			delete(s.waitCtx, i)
		}
		s.notifyLocked()
	}
	s.mu.Unlock()
}

func (s *sched) since() int64 { return int64(s.clk.Now().Sub(s.origin)) }

// wait blocks actor i until d has passed on the virtual clock or, unless deaf,
// until ctx is done (a cancel marks the actor runnable itself).
func (s *sched) wait(ctx context.Context, i actor, d time.Duration, deaf bool) error {
	if d <= 0 {
		if deaf {
			return nil
		}
		return ctx.Err()
	}
	ch := make(chan struct{})
	// blocked and its timer added at once, so the runner never sees the one without the other
	s.mu.Lock()
	if _, ok := s.live[i]; ok {
		s.live[i] = true
		if !deaf {
			s.waitCtx[i] = ctx
		}
		s.notifyLocked()
	}
	tm := s.clk.AfterFunc(d, func() { s.setBlocked(i, false); close(ch) })
	s.mu.Unlock()
	if deaf {
		<-ch
		return nil
	}
	select {
	case <-ch:
		return ctx.Err()
	case <-ctx.Done():
		tm.Stop()
		s.setBlocked(i, false)
		return ctx.Err()
	}
}

// hangUntilDone blocks actor i until ctx is done: its deadline (a timer at the
// same instant, made after the context's, fires after it) or a cancel.
func (s *sched) hangUntilDone(ctx context.Context, i actor) error {
	if dl, ok := levee.ClockDeadline(ctx); ok {
		return s.wait(ctx, i, dl.Sub(s.clk.Now()), false)
	}
	s.mu.Lock()
	if ctx.Err() == nil {
		if _, ok := s.live[i]; ok {
			s.live[i] = true
			s.waitCtx[i] = ctx
			s.notifyLocked()
		}
	}
	s.mu.Unlock()
	<-ctx.Done() // only a cancel ends it
	s.setBlocked(i, false)
	return ctx.Err()
}

// The seam of hedged calls (levee.SetHedgeSeam).

func (s *sched) spawn(ctx context.Context, n int) {
	s.mu.Lock()
	s.live[actor{callIndex(ctx), n}] = false
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *sched) exit(ctx context.Context, n int) {
	i := callIndex(ctx)
	s.mu.Lock()
	delete(s.live, actor{i, n})
	delete(s.waitCtx, actor{i, n})
	if s.parked[i] {
		s.parked[i] = false
		if _, ok := s.live[actor{i, 0}]; ok {
			s.live[actor{i, 0}] = false
			delete(s.waitCtx, actor{i, 0})
		}
	}
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *sched) park(ctx context.Context) {
	i := callIndex(ctx)
	s.mu.Lock()
	if _, ok := s.live[actor{i, 0}]; ok {
		s.parked[i] = true
		s.live[actor{i, 0}] = true
		s.waitCtx[actor{i, 0}] = ctx // the caller's cancel ends the park
		s.notifyLocked()
	}
	s.mu.Unlock()
}

// settle returns once every attempt of the call is blocked on the clock or gone:
// all that close at this instant have closed.
func (s *sched) settle(ctx context.Context) {
	i := callIndex(ctx)
	for {
		s.mu.Lock()
		done := true
		for a, b := range s.live {
			if a.call == i && a.attempt > 0 && (!b || (s.waitCtx[a] != nil && s.waitCtx[a].Err() != nil)) {
				done = false
			}
		}
		ch := s.changed
		s.mu.Unlock()
		if done {
			return
		}
		select {
		case <-ch:
		case <-time.After(50 * time.Millisecond): // a cancelled wait's goroutine wakes without a notice
		}
	}
}

// schedClock is the clock of the engine: its sleeps are recorded and block their call.
type schedClock struct {
	s      *sched
	mu     sync.Mutex
	sleeps map[int][]int64
}

func (c *schedClock) Now() time.Time                                  { return c.s.clk.Now() }
func (c *schedClock) AfterFunc(d time.Duration, f func()) levee.Timer { return c.s.clk.AfterFunc(d, f) }
func (c *schedClock) Sleep(ctx context.Context, d time.Duration) error {
	a := actorOf(ctx)
	c.mu.Lock()
	c.sleeps[a.call] = append(c.sleeps[a.call], int64(d))
	c.mu.Unlock()
	return c.s.wait(ctx, a, d, false)
}

// ---------------------------------------------------------------- the dependency

type scriptErr struct{ class string }

func (e *scriptErr) Error() string      { return e.class }
func (e *scriptErr) LeveeClass() string { return e.class }

type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

type attemptRec struct {
	At        int64  `json:"at"`
	End       int64  `json:"end"`
	Degraded  bool   `json:"degraded,omitempty"`
	Cancelled bool   `json:"cancelled,omitempty"` // hedged calls: ended by a cancel
	Closed    *int64 `json:"closed,omitempty"`    // hedged calls: when an unwinding attempt closed
}

// dependency plays one call's script: attempt after attempt, or, for a hedged call,
// attempt n plays step n (its attempts run at once).
type dependency struct {
	s        *sched
	i        int
	hedge    bool
	script   []map[string]any
	mu       sync.Mutex
	n        int
	attempts []attemptRec
	requests []map[string]string
	problems []string
	// hedged calls: by attempt number
	byAttempt map[int]attemptRec
	reqByN    map[int]map[string]string
}

func (d *dependency) trace() []attemptRec {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.hedge {
		return append([]attemptRec{}, d.attempts...)
	}
	out := []attemptRec{}
	for n := 1; n <= len(d.byAttempt); n++ {
		out = append(out, d.byAttempt[n])
	}
	return out
}

func (d *dependency) requestTrace() []map[string]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.hedge {
		return orEmptyH(d.requests)
	}
	out := []map[string]string{}
	for n := 1; n <= len(d.reqByN); n++ {
		out = append(out, d.reqByN[n])
	}
	return out
}

type stepResult struct {
	value   any
	status  int
	headers map[string]string
	err     error
}

func num(v any) int64 {
	f, _ := v.(float64)
	return int64(f)
}

// play runs the next step of the script under ctx (attempt n's, for a hedged call).
func (d *dependency) play(ctx context.Context, http bool) stepResult {
	at := d.s.since()
	me := actorOf(ctx)
	rec := attemptRec{At: at, Degraded: levee.Degraded(ctx)}
	n := me.attempt
	d.mu.Lock()
	if !d.hedge || n == 0 {
		n = d.n + 1
	}
	d.n++
	d.mu.Unlock()
	var closed *int64
	defer func() {
		rec.End = d.s.since()
		if closed != nil {
			rec.End, rec.Closed = *closed, ptr(d.s.since())
		}
		d.mu.Lock()
		if d.hedge {
			d.byAttempt[n] = rec
		} else {
			d.attempts = append(d.attempts, rec)
		}
		d.mu.Unlock()
		d.s.mu.Lock()
		d.s.played = d.i
		d.s.mu.Unlock()
	}()
	if n > len(d.script) {
		d.mu.Lock()
		d.problems = append(d.problems, fmt.Sprintf("attempt %d asked for, the script has %d", n, len(d.script)))
		d.mu.Unlock()
		return stepResult{err: &scriptErr{"ScriptExhausted"}}
	}
	st := d.script[n-1]
	// cut is the end of a wait by ctx: a cancel (not the attempt's timeout) of a hedged
	// call's attempt is marked, and an unwinding step takes its time to close
	cut := func(err error) error {
		if d.hedge && errors.Is(err, context.Canceled) {
			rec.Cancelled = true
			if u, ok := st["unwind"]; ok {
				end := d.s.since()
				closed = &end
				_ = d.s.wait(ctx, me, time.Duration(num(u)), true)
			}
		}
		return err
	}
	if _, ok := st["hang"]; ok {
		return stepResult{err: cut(d.s.hangUntilDone(ctx, me))}
	}
	if late, ok := st["late"]; ok {
		_ = d.s.wait(ctx, me, time.Duration(num(late)), true)
		return d.result(st, http)
	}
	if after, ok := st["after"]; ok {
		if err := d.s.wait(ctx, me, time.Duration(num(after)), false); err != nil {
			return stepResult{err: cut(err)}
		}
	} else if err := ctx.Err(); err != nil {
		return stepResult{err: cut(err)}
	}
	return d.result(st, http)
}

func ptr(v int64) *int64 { return &v }

func (d *dependency) result(st map[string]any, isHTTP bool) stepResult {
	switch {
	case st["raise"] != nil:
		return stepResult{err: &scriptErr{st["raise"].(string)}}
	case st["refuse"] != nil:
		return stepResult{err: &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}}
	case st["connect_timeout"] != nil:
		return stepResult{err: &net.OpError{Op: "dial", Net: "tcp", Err: timeoutError{}}}
	case st["tls_certificate"] != nil:
		return stepResult{err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}}
	case st["status"] != nil:
		h := map[string]string{}
		if hs, ok := st["headers"].(map[string]any); ok {
			for k, v := range hs {
				h[k] = v.(string)
			}
		}
		return stepResult{status: int(num(st["status"])), headers: h}
	default:
		if isHTTP {
			return stepResult{status: 200}
		}
		return stepResult{value: st["return"]}
	}
}

// RoundTrip is the in-process transport of `http` calls.
func (d *dependency) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		_ = req.Body.Close()
	}
	got := map[string]string{}
	for _, name := range []string{"x-levee-attempt", "idempotency-key", "x-idempotency-key"} {
		if vs, ok := req.Header[http.CanonicalHeaderKey(name)]; ok && len(vs) > 0 {
			got[name] = vs[0]
		}
	}
	d.mu.Lock()
	if n := levee.HedgeAttemptOf(req.Context()); d.hedge && n > 0 {
		d.reqByN[n] = got
	} else {
		d.requests = append(d.requests, got)
	}
	d.mu.Unlock()
	r := d.play(req.Context(), true)
	if r.err != nil {
		return nil, r.err
	}
	resp := &http.Response{StatusCode: r.status, Status: strconv.Itoa(r.status) + " " + http.StatusText(r.status),
		Header: http.Header{}, Body: io.NopCloser(strings.NewReader("")), Request: req, ProtoMajor: 1, ProtoMinor: 1}
	for k, v := range r.headers {
		resp.Header.Set(k, v)
	}
	return resp, nil
}

// ---------------------------------------------------------------- one scenario

var knownExpect = map[string]bool{"attempts": true, "requests": true, "sleeps": true, "fallbacks": true, "result": true,
	"events": true, "metrics": true, "on_retry": true, "retry_if": true}

var knownSteps = map[string]bool{"return": true, "raise": true, "status": true, "refuse": true, "connect_timeout": true,
	"tls_certificate": true, "hang": true, "late": true}

type callOut struct {
	id        uint64
	value     any
	resp      *http.Response
	err       error
	fallbacks []string
	onRetry   []map[string]any
	retryIf   []map[string]any // what each predicate call was given
	dep       *dependency
	plain     bool // run through Policy.Do: no value to compare
}

func hasCallAPI(sc *hsScenario) bool {
	for _, c := range sc.Calls {
		if c.API == "call" {
			return true
		}
	}
	return false
}

// runScenario replays one scenario; plain replays its `call`s through Policy.Do
// (no value) instead of DoValue.
func runScenario(t *testing.T, sc *hsScenario, plain bool) {
	ctx := context.Background()
	origin := time.Unix(sc.WallStart, 0)
	s := &sched{clk: leveetest.NewVirtualClockAt(origin), live: map[actor]bool{}, waitCtx: map[actor]context.Context{},
		parked: map[int]bool{}, changed: make(chan struct{}), origin: origin}
	clk := &schedClock{s: s, sleeps: map[int][]int64{}}
	rec := leveetest.NewRecorder()
	rec.Label = func(ctx context.Context) any { return callIndex(ctx) }
	outs := make([]*callOut, len(sc.Calls))
	lopts := []levee.Option{levee.WithSeed(sc.Seed), levee.WithClock(clk), levee.WithTelemetry(rec)}
	for pol, list := range sc.RetryIfPolicy {
		// no two steps of different calls share an instant: the call whose
		// attempt just ended is the one the policy's predicate is asked for
		lopts = append(lopts, levee.WithPolicyRetryIf(pol, predicate("policy", list, func() *callOut {
			s.mu.Lock()
			defer s.mu.Unlock()
			return outs[s.played]
		})))
	}
	e, err := levee.Load(ctx, sc.Document, lopts...)
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	defer e.Close(ctx)
	levee.SetHedgeSeam(e, s.spawn, s.exit, s.park, s.settle)

	// a field or step this runner does not know would go unchecked: refuse it
	for i, c := range sc.Calls {
		for k := range c.Expect {
			if !knownExpect[k] {
				t.Fatalf("call %d: expect.%s is not a field this runner checks", i, k)
			}
		}
		for n, st := range c.Script {
			kind := ""
			for k := range st {
				if k != "after" && k != "headers" && k != "unwind" && !(k == "return" && st["late"] != nil) {
					if kind != "" || !knownSteps[k] {
						t.Fatalf("call %d: script step %d %v is not one this runner plays", i, n, st)
					}
					kind = k
				}
			}
		}
	}
	var idMu sync.Mutex
	crossings := map[int]map[string]int{}
	replace := map[int]*levee.HedgeAnswer{} // the answer of the crossing in progress, replaced
	levee.SetFaultInjector(e, func(cctx context.Context, call uint64, op string) (bool, uint64, bool) {
		i := callIndex(cctx)
		if i < 0 {
			return false, 0, false
		}
		idMu.Lock()
		defer idMu.Unlock()
		if op == "start" {
			outs[i].id = call
		}
		if crossings[i] == nil {
			crossings[i] = map[string]int{}
		}
		crossings[i][op]++
		for _, f := range sc.Calls[i].Faults {
			if f.Op == op && f.Nth == crossings[i][op] {
				if f.Trap {
					return true, 0, false
				}
				if f.Commands != nil {
					a := hedgeAnswer(t, f.Commands)
					replace[i] = &a
					return false, 0, false
				}
				v, err := strconv.ParseUint(strings.TrimPrefix(f.Verdict, "0x"), 16, 64)
				if err != nil {
					t.Errorf("fault verdict %q: %v", f.Verdict, err)
				}
				return false, v, true
			}
		}
		return false, 0, false
	})
	levee.SetHedgeInjector(e, func(cctx context.Context, _ uint64, _ string, a levee.HedgeAnswer) levee.HedgeAnswer {
		i := callIndex(cctx)
		idMu.Lock()
		defer idMu.Unlock()
		if r := replace[i]; r != nil {
			delete(replace, i)
			return *r
		}
		return a
	})

	var wg sync.WaitGroup
	for i := range sc.Calls {
		c := &sc.Calls[i]
		out := &callOut{dep: &dependency{s: s, i: i, hedge: c.Hedge, script: c.Script, byAttempt: map[int]attemptRec{},
			reqByN: map[int]map[string]string{}}}
		outs[i] = out
		cctx, cancel := context.WithCancel(context.WithValue(ctx, callKey{}, i))
		defer cancel()
		s.clk.AfterFunc(time.Duration(c.At), func() {
			s.mu.Lock()
			s.live[actor{i, 0}] = false
			s.notifyLocked()
			s.mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					s.mu.Lock()
					delete(s.live, actor{i, 0})
					delete(s.waitCtx, actor{i, 0})
					s.notifyLocked()
					s.mu.Unlock()
				}()
				runCall(t, e, c, out, cctx, plain)
				// a success Do held back is settled now, so its events are this call's
				// (the core's decisions are those of the next start's settle either way)
				_ = e.FlushContext(cctx)
			}()
		})
		if c.CancelAt != nil {
			s.clk.AfterFunc(time.Duration(*c.CancelAt), func() {
				cancel()                         // first: a wait that blocks after this sees ctx done
				s.setBlocked(actor{i, 0}, false) // then: a wait blocked before it is runnable now
			})
		}
	}

	// advance the clock whenever every live call is blocked
	deadline := time.Now().Add(20 * time.Second)
	for {
		s.mu.Lock()
		allBlocked := true
		for i, b := range s.live {
			// a wait whose context another call cancelled (a wake-up from the bulkhead
			// queue) is about to run: its cancel came before that call blocked or ended
			if !b || (s.waitCtx[i] != nil && s.waitCtx[i].Err() != nil) {
				allBlocked = false
			}
		}
		nLive := len(s.live)
		ch := s.changed
		s.mu.Unlock()
		if allBlocked {
			if !s.clk.AdvanceToNext() {
				if nLive == 0 {
					break
				}
				t.Fatalf("deadlock: %d call(s) blocked with no timer pending", nLive)
			}
			continue
		}
		select {
		case <-ch:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("a call did not block or end within 20 s of real time")
		}
	}
	wg.Wait()
	if err := e.Flush(); err != nil && !errors.Is(err, levee.ErrClosed) {
		t.Errorf("flush: %v", err)
	}

	entries := rec.Entries()
	for i := range sc.Calls {
		c := &sc.Calls[i]
		out := outs[i]
		for _, p := range out.dep.problems {
			t.Errorf("call %d: %s", i, p)
		}
		check := func(field string, got any) {
			raw, ok := c.Expect[field]
			if !ok {
				return
			}
			var want any
			if err := json.Unmarshal(raw, &want); err != nil {
				t.Fatalf("call %d: expect.%s: %v", i, field, err)
			}
			g := normalize(got)
			if !reflect.DeepEqual(g, want) {
				gj, _ := json.Marshal(g)
				wj, _ := json.Marshal(want)
				t.Errorf("call %d (%s %s): %s\n  got  %s\n  want %s", i, c.API, c.Policy, field, gj, wj)
			}
		}
		check("attempts", out.dep.trace())
		if c.API == "http" {
			check("requests", out.dep.requestTrace())
		}
		check("sleeps", orEmpty(clk.sleeps[i]))
		check("fallbacks", orEmptyS(out.fallbacks))
		if out.plain && out.err == nil {
			// Policy.Do returns no value: the call must have succeeded, whatever its value
			var want map[string]any
			_ = json.Unmarshal(c.Expect["result"], &want)
			if _, ok := want["value"]; ok {
				out.value = want["value"]
			}
		}
		check("result", resultOf(c, out))
		check("on_retry", orEmptyM(out.onRetry))
		if out.plain {
			// Policy.Do gives its predicates no value: take the expected one where a value was given
			var want []map[string]any
			_ = json.Unmarshal(c.Expect["retry_if"], &want)
			for n, g := range out.retryIf {
				if _, ok := g["value"]; ok && g["value"] == nil && n < len(want) {
					if v, ok := want[n]["value"]; ok {
						g["value"] = v
					}
				}
			}
		}
		check("retry_if", orEmptyM(out.retryIf))
		key := ""
		if c.Key != nil {
			key = *c.Key
		} else if c.API == "http" {
			if req, err := http.NewRequest(c.HTTP.Method, c.HTTP.URL, nil); err == nil {
				key = levee.HTTPKey(req.URL)
			}
		}
		evs := []map[string]any{}
		metrics := map[string]any{}
		for _, en := range entries {
			if en.Label != i {
				continue
			}
			switch en.Kind {
			case "event":
				m := map[string]any{"name": en.Name}
				for _, a := range en.Attrs {
					v := a.Value.Resolve().Any()
					switch a.Key {
					case "levee.policy":
						if v != c.Policy {
							t.Errorf("call %d: event %s has levee.policy %v", i, en.Name, v)
						}
					case "levee.key":
						// key-evicted names the evicted key (key-overflow names the call's own,
						// not the shared entry it was decided against: docs/telemetry.md)
						if v != key && en.Name != "key-evicted" {
							t.Errorf("call %d: event %s has levee.key %q, want %q", i, en.Name, v, key)
						}
					case "levee.call":
						if id, _ := v.(uint64); id != out.id && en.Name != "call-evicted" {
							t.Errorf("call %d: event %s has levee.call %v, want %d", i, en.Name, v, out.id)
						}
					default:
						m[a.Key] = v
					}
				}
				evs = append(evs, m)
			case "add":
				k := leveetest.SeriesName(en.Name, en.Attrs)
				f, _ := metrics[k].(float64)
				metrics[k] = f + en.Value
			case "record":
				k := leveetest.SeriesName(en.Name, en.Attrs)
				h, _ := metrics[k].(map[string]any)
				if h == nil {
					h = map[string]any{"count": 0.0, "sum": 0.0}
				}
				h["count"] = h["count"].(float64) + 1
				h["sum"] = h["sum"].(float64) + en.Value
				metrics[k] = h
			}
		}
		check("events", evs)
		if raw, ok := c.Expect["metrics"]; ok {
			var want map[string]any
			_ = json.Unmarshal(raw, &want)
			if !metricsEqual(metrics, want) {
				gj, _ := json.Marshal(metrics)
				t.Errorf("call %d (%s %s): metrics\n  got  %s\n  want %s", i, c.API, c.Policy, gj, raw)
			}
		}
	}
}

func metricsEqual(got, want map[string]any) bool {
	if len(got) != len(want) {
		return false
	}
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			return false
		}
		switch wv := w.(type) {
		case float64:
			if gv, ok := g.(float64); !ok || gv != wv {
				return false
			}
		case map[string]any:
			gv, ok := g.(map[string]any)
			if !ok || gv["count"] != wv["count"] || math.Abs(gv["sum"].(float64)-wv["sum"].(float64)) > 1e-9 {
				return false
			}
		}
	}
	return true
}

func orEmpty(v []int64) []int64 {
	if v == nil {
		return []int64{}
	}
	return v
}

func orEmptyH(v []map[string]string) []map[string]string {
	if v == nil {
		return []map[string]string{}
	}
	return v
}

func orEmptyS(v []string) []string {
	if v == nil {
		return []string{}
	}
	return v
}

func orEmptyM(v []map[string]any) []map[string]any {
	if v == nil {
		return []map[string]any{}
	}
	return v
}

// normalize turns a Go value into what encoding/json would decode it to.
func normalize(v any) any {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	var out any
	_ = json.Unmarshal(b, &out)
	return out
}

// lastName is the name of a typed error's cause (README: "The expected trace").
func lastName(err error) any {
	if err == nil {
		return nil
	}
	o := levee.Classify(nil, err)
	switch o.Kind {
	case levee.OutcomeTimeout:
		return "timeout"
	case levee.OutcomeConnectionError:
		return "connection-error"
	case levee.OutcomeHTTPStatus:
		return "http:" + strconv.Itoa(int(o.Code))
	case levee.OutcomeErrorClass:
		return "error:" + o.Text
	default:
		return o.Kind.String()
	}
}

func resultOf(c *hsCall, out *callOut) any {
	if out.err == nil {
		if c.API == "http" {
			if out.resp == nil {
				return map[string]any{"status": nil}
			}
			return map[string]any{"status": out.resp.StatusCode}
		}
		return map[string]any{"value": out.value}
	}
	var le *levee.Error
	if errors.As(out.err, &le) {
		if le.Reason == levee.ReasonCancelled {
			return map[string]any{"cancelled": true}
		}
		return map[string]any{"error": map[string]any{"reason": le.Reason.String(), "attempts": le.Attempts, "last": lastName(le.Last)}}
	}
	if errors.Is(out.err, context.Canceled) {
		return map[string]any{"cancelled": true}
	}
	return map[string]any{"raised": levee.ErrorClassOf(unwrapURL(out.err))}
}

// unwrapURL takes the *url.Error off an http.Client error.
func unwrapURL(err error) error {
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) && strings.HasPrefix(fmt.Sprintf("%T", err), "*url.") {
		return ue.Unwrap()
	}
	return err
}

// ---------------------------------------------------------------- one call

// predicate plays scripted answers (true, false, null or "raise"; null past
// the end) and records, on the call rec names, what each call of it was given.
func predicate(by string, answers []any, rec func() *callOut) func(any, error) levee.RetryAnswer {
	var mu sync.Mutex
	n := 0
	return func(result any, err error) levee.RetryAnswer {
		entry := map[string]any{"by": by}
		if r, ok := result.(*http.Response); ok && r != nil {
			entry["status"] = r.StatusCode // the Transport gives a response with the status's error
		} else if err != nil {
			entry["error"] = lastName(err)
		} else {
			entry["value"] = result
		}
		out := rec()
		mu.Lock()
		out.retryIf = append(out.retryIf, entry)
		var a any
		if n < len(answers) {
			a = answers[n]
		}
		n++
		mu.Unlock()
		switch a {
		case true:
			return levee.Retry
		case false:
			return levee.NoRetry
		case "raise":
			panic(&scriptErr{"PredicateBroke"})
		}
		return levee.Unset
	}
}

func runCall(t *testing.T, e *levee.Engine, c *hsCall, out *callOut, ctx context.Context, plain bool) {
	p, err := e.Policy(c.Policy)
	if err != nil {
		out.err = err
		return
	}
	var opts []levee.CallOption
	for name, fb := range c.Fallbacks {
		name, fb := name, fb
		opts = append(opts, levee.WithCallFallback(name, func(ctx context.Context, cause error) (any, error) {
			out.fallbacks = append(out.fallbacks, name)
			if cls, ok := fb["raise"].(string); ok {
				return nil, &scriptErr{cls}
			}
			if c.API == "http" {
				status := 200
				if m, ok := fb["return"].(map[string]any); ok && m["status"] != nil {
					status = int(num(m["status"]))
				}
				return &http.Response{StatusCode: status, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(""))}, nil
			}
			return fb["return"], nil
		}))
	}
	hook := func(ri levee.RetryInfo) {
		name := lastName(ri.Err)
		out.onRetry = append(out.onRetry, map[string]any{"attempt": ri.Attempt, "delay": ri.Delay.Seconds(), "error": name})
	}
	if c.API == "http" {
		h := c.HTTP
		var body io.Reader
		if h.Body != nil {
			switch *h.Body {
			case "bytes":
				body = bytes.NewReader([]byte("payload"))
			case "stream":
				body = io.NopCloser(strings.NewReader("payload")) // no GetBody: cannot be sent twice
			}
		}
		req, err := http.NewRequestWithContext(ctx, h.Method, h.URL, body)
		if err != nil {
			out.err = err
			return
		}
		for k, v := range h.Headers {
			req.Header.Set(k, v)
		}
		tr := &levee.Transport{Base: out.dep, Policy: p, OnRetry: hook}
		if c.RetryIf != nil {
			tr.RetryIf = predicate("call", c.RetryIf, func() *callOut { return out })
		}
		registerHTTPFallbacks(e, c, out) // the Transport runs the engine's fallbacks
		client := &http.Client{Transport: tr}
		resp, err := client.Do(req)
		out.resp, out.err = resp, err
		if resp != nil {
			_ = resp.Body.Close()
		}
		return
	}
	if c.Key != nil {
		opts = append(opts, levee.WithKey(*c.Key))
	}
	if c.Idempotent != nil && !*c.Idempotent {
		opts = append(opts, levee.NotIdempotent())
	}
	if c.IdempotencyKey != nil {
		opts = append(opts, levee.WithIdempotencyKey())
	}
	opts = append(opts, levee.OnRetry(hook))
	if c.RetryIf != nil {
		opts = append(opts, levee.RetryIf(predicate("call", c.RetryIf, func() *callOut { return out })))
	}
	if plain {
		out.plain = true
		out.err = p.Do(ctx, func(ctx context.Context) error { return out.dep.play(ctx, false).err }, opts...)
		return
	}
	out.value, out.err = levee.DoValue(ctx, p, func(ctx context.Context) (any, error) {
		r := out.dep.play(ctx, false)
		return r.value, r.err
	}, opts...)
}

// registerHTTPFallbacks registers the call's fallbacks on the engine (the
// Transport runs the engine's): a scenario's calls of one policy share them.
func registerHTTPFallbacks(e *levee.Engine, c *hsCall, out *callOut) {
	names := make([]string, 0, len(c.Fallbacks))
	for name := range c.Fallbacks {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		name, fb := name, c.Fallbacks[name]
		e.RegisterFallback(name, func(ctx context.Context, cause error) (any, error) {
			out.fallbacks = append(out.fallbacks, name)
			if cls, ok := fb["raise"].(string); ok {
				return nil, &scriptErr{cls}
			}
			status := 200
			if m, ok := fb["return"].(map[string]any); ok && m["status"] != nil {
				status = int(num(m["status"]))
			}
			return &http.Response{StatusCode: status, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(""))}, nil
		})
	}
}
