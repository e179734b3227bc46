package leveegrpc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	leveegrpc "github.com/levee-dev/levee/host-bindings/go/grpc"
	pb "github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakypb"
	"github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakyserver"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

// The tests run against the real Flaky server (internal/flakyserver) on 127.0.0.1, started
// and stopped by each test, with small real times; they assert on counts and order, never
// on how fast the machine is.

const doc = `
policies:
  retry:
    attempts: 3
    attempt-timeout: 2s
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
  pushback:
    attempts: 3
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
  limited:
    attempts: 1
    rate-limit: { rate: 1, per: 1h, burst: 1 }
  breaker:
    attempts: 1
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }
  hedged:
    attempt-timeout: 5s
    hedge: { attempts: 2, delay: 100ms }
  deadline:
    attempts: 2
    attempt-timeout: 200ms
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
  timeout:
    attempts: 2
    attempt-timeout: 500ms
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
  fallback:
    attempts: 1
    fallbacks: [cached]
  streambreaker:
    attempts: 3
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
    breaker: { window: { kind: count, size: 4 }, minimum-calls: 3, failure-rate: 50, open-duration: 60s }
  untimed:
    attempts: 3
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
  single:
    attempts: 3
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
    bulkhead: { max-concurrent: 1 }
`

var scripts atomic.Int64

// script is a script id of its own for each use.
func script(t *testing.T) string { return fmt.Sprintf("%s-%d", t.Name(), scripts.Add(1)) }

type recorder struct {
	mu  sync.Mutex
	evs []levee.Event
}

func (r *recorder) listen(ev levee.Event) { r.mu.Lock(); r.evs = append(r.evs, ev); r.mu.Unlock() }

func (r *recorder) of(k levee.EventKind) []levee.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []levee.Event
	for _, ev := range r.evs {
		if ev.Kind == k {
			out = append(out, ev)
		}
	}
	return out
}

type env struct {
	t   *testing.T
	eng *levee.Engine
	rec *recorder
}

func newEnv(t *testing.T) *env {
	t.Helper()
	rec := &recorder{}
	eng, err := levee.Load(context.Background(), doc, levee.WithListener(rec.listen), levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close(context.Background()) })
	return &env{t: t, eng: eng, rec: rec}
}

func (e *env) policy(name string) *levee.Policy {
	p, err := e.eng.Policy(name)
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

func startServer(t *testing.T) *flakyserver.Server {
	t.Helper()
	s, err := flakyserver.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// dial is a client of s through the interceptor, gRPC's own retries off (one layer only).
func dial(t *testing.T, s *flakyserver.Server, i *leveegrpc.Interceptor) pb.FlakyClient {
	t.Helper()
	cc, err := grpc.NewClient(s.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDisableRetry(),
		grpc.WithUnaryInterceptor(i.Unary), grpc.WithStreamInterceptor(i.Stream))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return pb.NewFlakyClient(cc)
}

// plain is a client of s without Levee (for Stats).
func plain(t *testing.T, s *flakyserver.Server) pb.FlakyClient {
	t.Helper()
	cc, err := grpc.NewClient(s.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return pb.NewFlakyClient(cc)
}

// stats polls the server's Stats until cond holds (the server sees a cancellation a moment
// after the client returns), at most 200 times 10ms apart, and returns the last.
func stats(t *testing.T, c pb.FlakyClient, name string, cond func(*pb.StatsReply) bool) *pb.StatsReply {
	t.Helper()
	var st *pb.StatsReply
	for range 200 {
		var err error
		st, err = c.Stats(context.Background(), &pb.StatsRequest{Script: name})
		if err != nil {
			t.Fatal(err)
		}
		if cond(st) {
			return st
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("stats of %s: %v", name, st)
	return st
}

func step(code codes.Code) *pb.Step { return &pb.Step{Code: uint32(code)} }

func TestUnavailableRetried(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	r, err := c.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{step(codes.Unavailable), step(codes.Unavailable), step(codes.OK)}})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetAttempt() != 3 || r.GetPreviousAttempts() != "2" {
		t.Fatalf("reply %v: want attempt 3, previous attempts 2", r)
	}
	if r.GetAuthority() != s.Addr {
		t.Fatalf("authority %q, want %q", r.GetAuthority(), s.Addr)
	}
	if n := len(e.rec.of(levee.EventRetryScheduled)); n != 2 {
		t.Fatalf("%d retries scheduled, want 2", n)
	}
	if ev := e.rec.of(levee.EventRetryScheduled); ev[0].Key != s.Addr {
		t.Fatalf("key %q, want the target authority %q", ev[0].Key, s.Addr)
	}
	if st := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); st.GetStarted() != 3 {
		t.Fatalf("server saw %v", st)
	}
	// every attempt failing: the caller sees the last attempt's status, the *levee.Error its cause
	name = script(t)
	_, err = c.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{Code: uint32(codes.Unavailable), Message: "down"}}})
	if status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrRetriesExhausted) {
		t.Fatalf("err %v: want UNAVAILABLE and ErrRetriesExhausted", err)
	}
	var le *levee.Error
	if !errors.As(err, &le) || le.Attempts != 3 || status.Convert(err).Message() != "down" {
		t.Fatalf("err %v (%#v): want the last status's message and 3 attempts", err, le)
	}
}

func TestInvalidArgumentNotRetried(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	_, err := c.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{step(codes.InvalidArgument), step(codes.OK)}})
	if status.Code(err) != codes.InvalidArgument || !errors.Is(err, levee.ErrNonRetryable) {
		t.Fatalf("err %v: want INVALID_ARGUMENT, not retried", err)
	}
	if st := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); st.GetStarted() != 1 {
		t.Fatalf("server saw %v, want 1 attempt", st)
	}
}

func TestPushback(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("pushback")})
	name := script(t)
	pushback := "80"
	t0 := time.Now()
	r, err := c.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{Code: uint32(codes.Unavailable), Pushback: &pushback}, step(codes.OK)}})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetAttempt() != 2 {
		t.Fatalf("reply %v: want attempt 2", r)
	}
	ev := e.rec.of(levee.EventRetryScheduled)
	if len(ev) != 1 || ev[0].Duration != uint64(80*time.Millisecond) {
		t.Fatalf("retry events %v: want one retry after the pushback's 80ms", ev)
	}
	if el := time.Since(t0); el < 80*time.Millisecond {
		t.Fatalf("the call took %v: the retry came before the pushback", el)
	}
	// a negative pushback: no retry
	name = script(t)
	neg := "-1"
	_, err = c.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{Code: uint32(codes.Unavailable), Pushback: &neg}, step(codes.OK)}})
	if status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrPushback) {
		t.Fatalf("err %v: want UNAVAILABLE, stopped by the pushback", err)
	}
	if st := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); st.GetStarted() != 1 {
		t.Fatalf("server saw %v, want 1 attempt", st)
	}
}

func TestRateLimitIsResourceExhausted(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("limited")})
	name := script(t)
	req := &pb.Request{Script: name}
	if _, err := c.Unary(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	_, err := c.Unary(context.Background(), req)
	if status.Code(err) != codes.ResourceExhausted || !errors.Is(err, levee.ErrRateLimited) {
		t.Fatalf("err %v: want RESOURCE_EXHAUSTED with ErrRateLimited", err)
	}
	var ge *leveegrpc.Error
	if !errors.As(err, &ge) {
		t.Fatalf("err %T: want a *leveegrpc.Error", err)
	}
	if st := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); st.GetStarted() != 1 {
		t.Fatalf("server saw %v: the rejection is local", st)
	}
}

func TestBreakerPerTarget(t *testing.T) {
	e := newEnv(t)
	down, up := startServer(t), startServer(t)
	i := &leveegrpc.Interceptor{Policy: e.policy("breaker")}
	cd, cu := dial(t, down, i), dial(t, up, i)
	name := script(t)
	fail := &pb.Request{Script: name, Steps: []*pb.Step{step(codes.Unavailable)}}
	for range 2 {
		if _, err := cd.Unary(context.Background(), fail); status.Code(err) != codes.Unavailable {
			t.Fatalf("err %v", err)
		}
	}
	_, err := cd.Unary(context.Background(), fail)
	if status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrBreakerOpen) {
		t.Fatalf("err %v: want UNAVAILABLE from the open breaker", err)
	}
	if st := stats(t, plain(t, down), name, func(*pb.StatsReply) bool { return true }); st.GetStarted() != 2 {
		t.Fatalf("server saw %v: the third call should not reach it", st)
	}
	// the other target's breaker is its own
	for range 3 {
		if _, err := cu.Unary(context.Background(), &pb.Request{Script: script(t)}); err != nil {
			t.Fatalf("the healthy target: %v", err)
		}
	}
	tr := e.rec.of(levee.EventBreakerTransition)
	if len(tr) != 1 || tr[0].Key != down.Addr {
		t.Fatalf("transitions %v: want one, of %s", tr, down.Addr)
	}
}

func TestHedgingCancelsTheLoser(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("hedged")})
	name := script(t)
	r, err := c.Unary(context.Background(), &pb.Request{Script: name, Payload: []byte("x"),
		Steps: []*pb.Step{{DelayMs: 5000}, {}}})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetAttempt() != 2 || r.GetPreviousAttempts() != "1" || string(r.GetPayload()) != "x" {
		t.Fatalf("reply %v: want the hedge's (attempt 2, previous attempts 1)", r)
	}
	st := stats(t, plain(t, s), name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 1 })
	if st.GetStarted() != 2 || st.GetFinished() != 1 {
		t.Fatalf("server saw %v: want 2 started, the loser cancelled", st)
	}
	if n := len(e.rec.of(levee.EventHedgeStarted)); n != 1 {
		t.Fatalf("%d hedges started, want 1", n)
	}
}

func TestDeadlinePropagation(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("deadline")})
	r, err := c.Unary(context.Background(), &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetDeadlineMs() < 0 || r.GetDeadlineMs() > 200 {
		t.Fatalf("the server saw a deadline of %dms, want at most the attempt timeout (200ms)", r.GetDeadlineMs())
	}
	// the caller's earlier deadline bounds the attempt
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	r, err = c.Unary(ctx, &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetDeadlineMs() < 0 || r.GetDeadlineMs() > 100 {
		t.Fatalf("the server saw a deadline of %dms, want at most the caller's (100ms)", r.GetDeadlineMs())
	}
	// an attempt over its timeout is a timeout, retried; the server saw it cut
	e2 := newEnv(t)
	c2 := dial(t, s, &leveegrpc.Interceptor{Policy: e2.policy("timeout")})
	name := script(t)
	r, err = c2.Unary(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{DelayMs: 5000}, {}}})
	if err != nil {
		t.Fatal(err)
	}
	if r.GetAttempt() != 2 {
		t.Fatalf("reply %v: want attempt 2", r)
	}
	if st := stats(t, plain(t, s), name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 1 }); st.GetStarted() != 2 {
		t.Fatalf("server saw %v", st)
	}
}

func TestServerStreamRetriedOnlyBeforeTheFirstMessage(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	// attempt 1 fails before any message (retried); attempt 2 sends two, then fails (final)
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{
		step(codes.Unavailable), {Messages: 2, Code: uint32(codes.Unavailable)}}})
	if err != nil {
		t.Fatal(err)
	}
	var got []uint32
	for {
		r, err := st.Recv()
		if err != nil {
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("err %v: want the stream's UNAVAILABLE", err)
			}
			break
		}
		got = append(got, r.GetAttempt())
		if r.GetPreviousAttempts() != "1" {
			t.Fatalf("reply %v: want previous attempts 1", r)
		}
	}
	if len(got) != 2 || got[0] != 2 || got[1] != 2 {
		t.Fatalf("messages from attempts %v, want [2 2]", got)
	}
	if ss := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); ss.GetStarted() != 2 {
		t.Fatalf("server saw %v: no retry after the first message", ss)
	}
	// a stream that ends OK without a message
	st, err = c.ServerStream(context.Background(), &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v, want io.EOF", err)
	}
}

func TestClientStreamNotRetried(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	cs, err := c.ClientStream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := cs.Send(&pb.Request{Script: name, Steps: []*pb.Step{step(codes.Unavailable), step(codes.OK)}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cs.CloseAndRecv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("err %v: want UNAVAILABLE, the request stream not buffered, not retried", err)
	}
	if ss := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); ss.GetStarted() != 1 {
		t.Fatalf("server saw %v", ss)
	}
	// and one that succeeds reads every message
	cs, err = c.ClientStream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := cs.Send(&pb.Request{Script: script(t)}); err != nil {
			t.Fatal(err)
		}
	}
	r, err := cs.CloseAndRecv()
	if err != nil || r.GetReceived() != 3 {
		t.Fatalf("reply %v, err %v: want 3 received", r, err)
	}
}

func TestCallerCancellation(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	ctx, cancel := context.WithCancel(context.Background())
	pc := plain(t, s)
	go func() {
		defer cancel() // once the server has the attempt (at most 2s from now)
		for range 200 {
			if st, err := pc.Stats(context.Background(), &pb.StatsRequest{Script: name}); err == nil && st.GetStarted() == 1 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	_, err := c.Unary(ctx, &pb.Request{Script: name, Steps: []*pb.Step{{DelayMs: 5000}}})
	if status.Code(err) != codes.Canceled || !errors.Is(err, levee.ErrCancelled) {
		t.Fatalf("err %v: want CANCELED with ErrCancelled", err)
	}
	st := stats(t, pc, name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 1 })
	if st.GetStarted() != 1 {
		t.Fatalf("server saw %v: a cancelled call is not retried", st)
	}
	if n := len(e.rec.of(levee.EventRetryScheduled)); n != 0 {
		t.Fatalf("%d retries scheduled after the caller's cancel", n)
	}
}

func TestFallbackAndPolicyPerMethod(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	e.eng.RegisterFallback("cached", func(context.Context, error) (any, error) {
		return &pb.Reply{Payload: []byte("cached")}, nil
	})
	fb, retry := e.policy("fallback"), e.policy("retry")
	i := &leveegrpc.Interceptor{PolicyFor: func(method string) *levee.Policy {
		if method == pb.Flaky_Unary_FullMethodName {
			return fb
		}
		return retry
	}}
	c := dial(t, s, i)
	r, err := c.Unary(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{step(codes.Unavailable)}})
	if err != nil || string(r.GetPayload()) != "cached" {
		t.Fatalf("reply %v, err %v: want the fallback's", r, err)
	}
	// a fallback of another message type is an error the caller sees
	e.eng.RegisterFallback("cached", func(context.Context, error) (any, error) { return &pb.StatsReply{}, nil })
	_, err = c.Unary(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{step(codes.Unavailable)}})
	if status.Code(err) != codes.Internal {
		t.Fatalf("err %v: want INTERNAL for a fallback of the wrong type", err)
	}
	// no policy at all
	var none leveegrpc.Interceptor
	if err := none.Unary(context.Background(), "/x/y", nil, nil, nil, nil); !errors.Is(err, leveegrpc.ErrNoPolicy) {
		t.Fatalf("err %v", err)
	}
}

// The README's gRPC example is example/main.go (ci.sh runs it).
func TestReadmeExample(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	const marker = "<!-- grpc-example: grpc/example/main.go -->\n```go\n"
	_, after, ok := strings.Cut(string(readme), marker)
	if !ok {
		t.Fatal("README.md: no gRPC example marker")
	}
	block, _, ok := strings.Cut(after, "```\n")
	if !ok {
		t.Fatal("README.md: the gRPC example block is not closed")
	}
	src, err := os.ReadFile("example/main.go")
	if err != nil {
		t.Fatal(err)
	}
	if block != string(src) {
		t.Fatal("README.md's gRPC example differs from example/main.go: copy the file into the block")
	}
}

func TestAuthority(t *testing.T) {
	for target, want := range map[string]string{
		"dns:///Example.com:8443": "Example.com:8443",
		"example.com:443":         "example.com:443",
		"127.0.0.1:50051":         "127.0.0.1:50051",
		"passthrough:///[::1]:80": "[::1]:80",
		":50051":                  "localhost:50051",
	} {
		cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		if got := leveegrpc.Authority(cc); got != want {
			t.Errorf("Authority(%q) = %q, want %q", target, got, want)
		}
		if got := leveegrpc.Authority(cc, grpc.CallAuthority("other:1")); got != "other:1" {
			t.Errorf("Authority(%q, CallAuthority) = %q", target, got)
		}
		_ = cc.Close()
	}
}

func TestKeyFunctionAndHeaderCommit(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	i := &leveegrpc.Interceptor{Policy: e.policy("retry"),
		Key: func(_ context.Context, method string, _ *grpc.ClientConn, _ []grpc.CallOption) string {
			return "svc" + method
		}}
	c := dial(t, s, i)
	name := script(t)
	// Header before any message: the stream commits at its headers (attempt 2's, after attempt 1 failed)
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{step(codes.Unavailable), {Messages: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	r, err := st.Recv()
	if err != nil || r.GetAttempt() != 2 {
		t.Fatalf("reply %v, err %v: want attempt 2's message", r, err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v, want io.EOF", err)
	}
	ev := e.rec.of(levee.EventRetryScheduled)
	if len(ev) != 1 || ev[0].Key != "svc"+pb.Flaky_ServerStream_FullMethodName {
		t.Fatalf("retries %v: want one, keyed by the Key function", ev)
	}
}

func TestHedgedServerStream(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("hedged")})
	name := script(t)
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{DelayMs: 5000, Messages: 1}, {Messages: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	var got []uint32
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, r.GetAttempt())
	}
	if len(got) != 2 || got[0] != 2 || got[1] != 2 {
		t.Fatalf("messages from attempts %v, want the hedge's two", got)
	}
	ss := stats(t, plain(t, s), name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 1 })
	if ss.GetStarted() != 2 || ss.GetFinished() != 1 {
		t.Fatalf("server saw %v: want the first attempt cancelled", ss)
	}
}

// A server stream that fails after its first message (committed): each failure is the call's
// outcome in the core, never retried, so the breaker opens and refuses the next call.
func TestServerStreamFailureAfterCommitOpensTheBreaker(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("streambreaker")})
	name := script(t)
	req := &pb.Request{Script: name, Steps: []*pb.Step{{Messages: 1, Code: uint32(codes.Unavailable), Message: "half way"}}}
	for i := range 3 {
		st, err := c.ServerStream(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := st.Recv(); err != nil || r.GetAttempt() != uint32(i+1) {
			t.Fatalf("call %d: reply %v, err %v: want the server's attempt %d", i+1, r, err, i+1)
		}
		if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
			t.Fatalf("call %d: err %v: want the stream's UNAVAILABLE", i+1, err)
		}
	}
	st, err := c.ServerStream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrBreakerOpen) {
		t.Fatalf("err %v: want UNAVAILABLE from the open breaker", err)
	}
	if ss := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); ss.GetStarted() != 3 {
		t.Fatalf("server saw %v: want 3 attempts (no retry after the commit, the 4th call refused)", ss)
	}
	if n := len(e.rec.of(levee.EventRetryScheduled)); n != 0 {
		t.Fatalf("%d retries scheduled after a commit", n)
	}
	if tr := e.rec.of(levee.EventBreakerTransition); len(tr) != 1 || tr[0].StateTo != levee.BreakerOpen {
		t.Fatalf("transitions %v: want the breaker opened", tr)
	}
}

// The caller gets the status a committed stream ended with as it came (code and message),
// with the core's verdict as its cause.
func TestServerStreamStatusAfterCommitUnchanged(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("retry")})
	name := script(t)
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: name,
		Steps: []*pb.Step{{Messages: 2, Code: uint32(codes.Unavailable), Message: "lost the shard"}}})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	_, err = st.Recv()
	if s := status.Convert(err); s.Code() != codes.Unavailable || s.Message() != "lost the shard" {
		t.Fatalf("err %v: want UNAVAILABLE \"lost the shard\" as the server sent it", err)
	}
	var le *levee.Error
	if !errors.As(err, &le) || !errors.Is(err, levee.ErrNonRetryable) || le.Attempts != 1 {
		t.Fatalf("err %v (%#v): want the core's verdict (not retried, 1 attempt) as its cause", err, le)
	}
	// read again: the same end
	if _, err2 := st.Recv(); status.Code(err2) != codes.Unavailable {
		t.Fatalf("a Recv after the end: %v", err2)
	}
	if ss := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); ss.GetStarted() != 1 {
		t.Fatalf("server saw %v: a committed stream is not retried", ss)
	}
}

// A client stream that fails once open: its status is the call's outcome (the breaker counts
// it), never retried, and the breaker refuses the next opening.
func TestClientStreamFailureAfterOpenOpensTheBreaker(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("streambreaker")})
	name := script(t)
	for i := range 3 {
		cs, err := c.ClientStream(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if err := cs.Send(&pb.Request{Script: name, Steps: []*pb.Step{{Code: uint32(codes.Unavailable), Message: "down"}}}); err != nil {
			t.Fatal(err)
		}
		_, err = cs.CloseAndRecv()
		if st := status.Convert(err); st.Code() != codes.Unavailable || st.Message() != "down" || !errors.Is(err, levee.ErrNonRetryable) {
			t.Fatalf("call %d: err %v: want the stream's UNAVAILABLE, not retried", i+1, err)
		}
	}
	_, err := c.ClientStream(context.Background())
	if status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrBreakerOpen) {
		t.Fatalf("err %v: want UNAVAILABLE from the open breaker", err)
	}
	if ss := stats(t, plain(t, s), name, func(*pb.StatsReply) bool { return true }); ss.GetStarted() != 3 {
		t.Fatalf("server saw %v: want 3 attempts", ss)
	}
	if n := len(e.rec.of(levee.EventRetryScheduled)); n != 0 {
		t.Fatalf("%d retries scheduled", n)
	}
}

// A committed stream the caller cancels is the caller's cancellation: not a failure of the
// dependency (the breaker stays closed), not retried, and the server sees the cancel.
func TestCommittedStreamCancelledByTheCaller(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("streambreaker")})
	name := script(t)
	for i := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		st, err := c.ServerStream(ctx, &pb.Request{Script: name, Steps: []*pb.Step{{Messages: 2, DelayMs: 200}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		cancel()
		_, err = st.Recv()
		if status.Code(err) != codes.Canceled || !errors.Is(err, levee.ErrCancelled) {
			t.Fatalf("call %d: err %v: want CANCELED with ErrCancelled", i+1, err)
		}
	}
	ss := stats(t, plain(t, s), name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 3 })
	if ss.GetStarted() != 3 {
		t.Fatalf("server saw %v", ss)
	}
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v: the breaker must stay closed after the caller's cancels", err)
	}
	if tr := e.rec.of(levee.EventBreakerTransition); len(tr) != 0 {
		t.Fatalf("transitions %v: the caller's cancels are not failures", tr)
	}
}

// A committed stream holds its bulkhead slot until it ends (read to its end here): another
// call meanwhile finds the bulkhead full.
func TestCommittedStreamHoldsItsBulkheadSlot(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("single")})
	a, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{{Messages: 2, DelayMs: 50}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Recv(); err != nil {
		t.Fatal(err)
	}
	b, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Recv(); status.Code(err) != codes.ResourceExhausted || !errors.Is(err, levee.ErrBulkheadFull) {
		t.Fatalf("err %v: want RESOURCE_EXHAUSTED, the slot held by the open stream", err)
	}
	for {
		if _, err := a.Recv(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	b, err = c.ServerStream(context.Background(), &pb.Request{Script: script(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v: the slot is free once the stream has ended", err)
	}
}

// A committed stream the caller drops without reading it to its end nor cancelling it ends
// when it is garbage collected, as the caller's cancellation: its slot is freed.
func TestAbandonedStreamFreesItsSlot(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("single")})
	func() {
		a, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{{Messages: 2, DelayMs: 50}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Recv(); err != nil {
			t.Fatal(err)
		}
	}()
	var err error
	for n := range 200 {
		runtime.GC()
		var b pb.Flaky_ServerStreamClient
		if b, err = c.ServerStream(context.Background(), &pb.Request{Script: script(t)}); err != nil {
			t.Fatal(err)
		}
		if _, err = b.Recv(); errors.Is(err, io.EOF) {
			t.Logf("admitted after %d GCs", n+1)
			break
		}
		if !errors.Is(err, levee.ErrBulkheadFull) {
			t.Fatalf("err %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !errors.Is(err, io.EOF) {
		t.Fatalf("err %v: the dropped stream still holds its slot", err)
	}
	if tr := e.rec.of(levee.EventBreakerTransition); len(tr) != 0 {
		t.Fatalf("transitions %v", tr)
	}
}

// A committed stream whose ClientConn is closed before the caller reads it to its end: the
// attempt ends (CANCELED, as grpc ends the stream) and frees its slot.
func TestCommittedStreamEndsWithItsClientConn(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	i := &leveegrpc.Interceptor{Policy: e.policy("single")}
	cc, err := grpc.NewClient(s.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDisableRetry(),
		grpc.WithStreamInterceptor(i.Stream))
	if err != nil {
		t.Fatal(err)
	}
	a, err := pb.NewFlakyClient(cc).ServerStream(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{{Messages: 2, DelayMs: 50}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Recv(); err != nil {
		t.Fatal(err)
	}
	_ = cc.Close()
	c := dial(t, s, i)
	for range 200 {
		b, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err = b.Recv(); errors.Is(err, io.EOF) {
			if _, err := a.Recv(); status.Code(err) != codes.Canceled {
				t.Fatalf("the closed stream's Recv: %v, want CANCELED", err)
			}
			return
		}
		if !errors.Is(err, levee.ErrBulkheadFull) {
			t.Fatalf("err %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the stream of a closed ClientConn still holds its slot")
}

// A committed stream that fails under a policy with a fallback: the core ends the call with
// the fallback, whose message is the stream's next one, then its end.
func TestCommittedStreamFallback(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	e.eng.RegisterFallback("cached", func(context.Context, error) (any, error) {
		return &pb.Reply{Payload: []byte("cached")}, nil
	})
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("fallback")})
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t), Payload: []byte("live"),
		Steps: []*pb.Step{{Messages: 1, Code: uint32(codes.Unavailable)}}})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(r.GetPayload()))
	}
	if fmt.Sprint(got) != "[live cached]" {
		t.Fatalf("messages %v, want the stream's then the fallback's", got)
	}
	if n := len(e.rec.of(levee.EventFallbackChosen)); n != 1 {
		t.Fatalf("%d fallbacks chosen, want 1", n)
	}
}

// Every stream call's goroutine (the call in the core, which lasts as long as a handed
// stream) ends with its stream: after streams read to their end, cancelled, dropped and
// failed, none is left.
func TestStreamCallsLeaveNoGoroutine(t *testing.T) {
	e, s := newEnv(t), startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: e.policy("untimed")})
	read := func(st pb.Flaky_ServerStreamClient) {
		for {
			if _, err := st.Recv(); err != nil {
				return
			}
		}
	}
	for _, step := range []*pb.Step{{Messages: 2}, {Messages: 1, Code: uint32(codes.Unavailable)}, {Code: uint32(codes.InvalidArgument)}} {
		st, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{step}})
		if err != nil {
			t.Fatal(err)
		}
		read(st)
	}
	ctx, cancel := context.WithCancel(context.Background())
	st, err := c.ServerStream(ctx, &pb.Request{Script: script(t), Steps: []*pb.Step{{Messages: 2, DelayMs: 50}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	func() { // dropped after its first message
		st, err := c.ServerStream(context.Background(), &pb.Request{Script: script(t), Steps: []*pb.Step{{Messages: 2, DelayMs: 50}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}()
	cs, err := c.ClientStream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.Send(&pb.Request{Script: script(t)}); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CloseAndRecv(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var stacks string
	for range 200 {
		runtime.GC()
		stacks = string(buf[:runtime.Stack(buf, true)])
		if !strings.Contains(stacks, "host-bindings/go/grpc.(*streamCall)") {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("a stream call's goroutine is left:\n%s", stacks)
}

// A committed stream cut by its attempt's deadline: a timeout in the core, not retried; the
// caller gets DEADLINE_EXCEEDED.
func TestCommittedStreamTimesOut(t *testing.T) {
	tel := leveetest.NewRecorder()
	eng, err := levee.Load(context.Background(), doc, levee.WithTelemetry(tel))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close(context.Background()) })
	p, err := eng.Policy("timeout")
	if err != nil {
		t.Fatal(err)
	}
	s := startServer(t)
	c := dial(t, s, &leveegrpc.Interceptor{Policy: p})
	name := script(t)
	st, err := c.ServerStream(context.Background(), &pb.Request{Script: name, Steps: []*pb.Step{{Messages: 2, DelayMs: 300}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	if status.Code(err) != codes.DeadlineExceeded || !errors.Is(err, levee.ErrNonRetryable) {
		t.Fatalf("err %v: want DEADLINE_EXCEEDED, not retried", err)
	}
	if ss := stats(t, plain(t, s), name, func(st *pb.StatsReply) bool { return st.GetCancelled() == 1 }); ss.GetStarted() != 1 {
		t.Fatalf("server saw %v", ss)
	}
	var outcomes []string
	for _, en := range tel.Entries() {
		if en.Kind == "add" && en.Name == "levee.attempts" {
			for _, a := range en.Attrs {
				if a.Key == "levee.outcome" {
					outcomes = append(outcomes, a.Value.String())
				}
			}
		}
	}
	if fmt.Sprint(outcomes) != "[timeout]" {
		t.Fatalf("attempts reported %v, want one timeout", outcomes)
	}
}

// bidiDesc is a bidirectional method of a test server: it reads one request, answers it,
// then ends with UNAVAILABLE.
var bidiDesc = grpc.StreamDesc{StreamName: "Fail", ServerStreams: true, ClientStreams: true}

// A bidirectional stream that fails once open (after a message each way): its status is the
// call's outcome (the breaker counts it), never retried, and the breaker refuses the next.
func TestBidiStreamFailureAfterOpenOpensTheBreaker(t *testing.T) {
	e := newEnv(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var opened atomic.Int32
	srv := grpc.NewServer()
	srv.RegisterService(&grpc.ServiceDesc{ServiceName: "levee.test.Bidi", HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Fail", ServerStreams: true, ClientStreams: true,
			Handler: func(_ any, stream grpc.ServerStream) error {
				opened.Add(1)
				var req pb.Request
				if err := stream.RecvMsg(&req); err != nil {
					return err
				}
				if err := stream.SendMsg(&pb.Reply{Payload: req.GetPayload()}); err != nil {
					return err
				}
				return status.Error(codes.Unavailable, "gone")
			}}}}, struct{}{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	i := &leveegrpc.Interceptor{Policy: e.policy("streambreaker")}
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDisableRetry(),
		grpc.WithStreamInterceptor(i.Stream))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	const method = "/levee.test.Bidi/Fail"
	for n := range 3 {
		cs, err := cc.NewStream(context.Background(), &bidiDesc, method)
		if err != nil {
			t.Fatal(err)
		}
		if err := cs.SendMsg(&pb.Request{Payload: []byte("x")}); err != nil {
			t.Fatal(err)
		}
		var r pb.Reply
		if err := cs.RecvMsg(&r); err != nil || string(r.GetPayload()) != "x" {
			t.Fatalf("call %d: reply %v, err %v", n+1, &r, err)
		}
		err = cs.RecvMsg(&r)
		if st := status.Convert(err); st.Code() != codes.Unavailable || st.Message() != "gone" || !errors.Is(err, levee.ErrNonRetryable) {
			t.Fatalf("call %d: err %v: want the stream's UNAVAILABLE, not retried", n+1, err)
		}
	}
	_, err = cc.NewStream(context.Background(), &bidiDesc, method)
	if status.Code(err) != codes.Unavailable || !errors.Is(err, levee.ErrBreakerOpen) {
		t.Fatalf("err %v: want UNAVAILABLE from the open breaker", err)
	}
	if n := opened.Load(); n != 3 {
		t.Fatalf("the server opened %d streams, want 3", n)
	}
}
