// Command testworker is the Go durable worker of the crash tests (durable/tests/run.sh); it
// takes the arguments of durable/tests/worker.py and writes the same log lines, so that the
// harness kills and resumes Python and Go workers alike:
//
//	testworker STORE --owner NAME --log FILE [--submit HANDLER[:KEY[:PAYLOAD]]]... [--die-after-outcome]
//	           [--until-idle] [--scale N] [--concurrency N] [--submit-only]
//
// STORE is `sqlite:PATH` or `postgres:CONNINFO`. Handlers write `start CALL ATTEMPT PID WALL_NS`
// and `end CALL ATTEMPT PID WALL_NS RESULT` to FILE (O_APPEND, one write per line).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/durable"
)

// doc is worker.py's DOC: the same policies, so that a record either wrote runs in both.
const doc = `
policies:
  flaky:
    attempts: 5
    attempt-timeout: 60s
    retry-on: [timeout, connection-error]
    backoff: { kind: constant, base: 3s, cap: 3s, jitter: none }
    durable: { lease: 2s, max-crashes: 3 }
  work:
    attempts: 10
    attempt-timeout: 10s
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    durable: { lease: 2s, max-crashes: 5 }
`

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "testworker:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) < 2 {
		return errors.New("usage: testworker STORE --owner NAME --log FILE ...")
	}
	spec := os.Args[1]
	fs := flag.NewFlagSet("testworker", flag.ContinueOnError)
	owner := fs.String("owner", "", "lease owner")
	logPath := fs.String("log", "", "the handlers' log")
	var submits list
	fs.Var(&submits, "submit", "HANDLER[:KEY[:PAYLOAD]]")
	dieAfter := fs.Bool("die-after-outcome", false, "SIGKILL itself between an outcome and its write")
	untilIdle := fs.Bool("until-idle", false, "stop when no call is pending")
	scale := fs.Int("scale", 0, "submit N `work` calls")
	concurrency := fs.Int("concurrency", 16, "calls run at once")
	submitOnly := fs.Bool("submit-only", false, "submit, then exit")
	if err := fs.Parse(os.Args[2:]); err != nil {
		return err
	}
	f, err := os.OpenFile(*logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	pid := os.Getpid()
	logLine := func(parts ...any) {
		s := fmt.Sprintln(parts...)
		_, _ = f.WriteString(s) // one write per line: O_APPEND keeps lines whole
	}
	now := func() int64 { return time.Now().UnixNano() }

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	engine, err := levee.Load(ctx, doc)
	if err != nil {
		return err
	}
	defer engine.Close(context.Background())
	var store durable.Store
	kind, rest, _ := strings.Cut(spec, ":")
	switch kind {
	case "sqlite":
		store, err = durable.OpenSQLite(ctx, rest)
	case "postgres":
		store, err = durable.OpenPostgres(ctx, rest)
	default:
		err = fmt.Errorf("unknown store %q", spec)
	}
	if err != nil {
		return err
	}
	defer store.Close()

	opts := []durable.Option{durable.WithOwner(*owner), durable.WithPollInterval(50 * time.Millisecond),
		durable.WithClaimHold(time.Second), durable.WithConcurrency(*concurrency)}
	if *dieAfter {
		opts = append(opts, durable.WithAttemptDone(func(id int64, attempt uint32, o levee.Outcome) {
			logLine("outcome", id, attempt, pid, now(), o.Kind)
			_ = syscall.Kill(pid, syscall.SIGKILL) // between the outcome and its write
		}))
	}
	x := durable.New(engine, store, opts...)

	flaky := func(ctx context.Context, _ []byte, c durable.Call) ([]byte, error) {
		logLine("start", c.ID, c.Attempt, pid, now())
		if c.Attempt == 1 {
			logLine("end", c.ID, c.Attempt, pid, now(), "timeout")
			return nil, fmt.Errorf("the first attempt always times out: %w", context.DeadlineExceeded)
		}
		logLine("end", c.ID, c.Attempt, pid, now(), "ok")
		return []byte("ok"), nil
	}
	slow := func(ctx context.Context, payload []byte, c durable.Call) ([]byte, error) {
		logLine("start", c.ID, c.Attempt, pid, now())
		d := 50 * time.Millisecond
		if c.Attempt == 1 {
			secs, _ := strconv.ParseFloat(string(payload), 64)
			d = time.Duration(secs * float64(time.Second))
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		logLine("end", c.ID, c.Attempt, pid, now(), "ok")
		return []byte("ok"), nil
	}
	work := func(ctx context.Context, payload []byte, c durable.Call) ([]byte, error) {
		logLine("start", c.ID, c.Attempt, pid, now())
		n, err := strconv.Atoi(string(payload))
		if err != nil {
			return nil, err
		}
		time.Sleep(time.Millisecond)
		if (n*7+int(c.Attempt))%10 == 0 { // about one call in ten fails once
			logLine("end", c.ID, c.Attempt, pid, now(), "fail")
			return nil, fmt.Errorf("transient: %w", syscall.ECONNRESET)
		}
		if n%1000 == 999 { // ten calls in 10,000 always fail with a non-retryable error
			logLine("end", c.ID, c.Attempt, pid, now(), "fatal")
			return nil, levee.ClassError("ValueError", fmt.Errorf("call %d is refused", n))
		}
		logLine("end", c.ID, c.Attempt, pid, now(), "ok")
		return []byte("ok"), nil
	}
	for _, r := range []struct {
		name, policy string
		fn           durable.Handler
		opts         []durable.HandlerOption
	}{
		{"flaky", "flaky", flaky, nil},
		{"slow", "flaky", slow, nil},
		{"slow-bare", "flaky", slow, []durable.HandlerOption{durable.NotIdempotent()}},
		{"work", "work", work, nil},
	} {
		if err := x.Register(r.name, r.fn, append(r.opts, durable.WithPolicy(r.policy))...); err != nil {
			return err
		}
	}

	for _, s := range submits {
		handler, rest, _ := strings.Cut(s, ":")
		key, payload, _ := strings.Cut(rest, ":")
		id, err := x.Submit(ctx, handler, []byte(payload), key)
		if err != nil {
			return err
		}
		shown := key
		if shown == "" {
			shown = "-"
		}
		logLine("submitted", id, handler, shown, pid, now())
	}
	for i := range *scale {
		if _, err := x.Submit(ctx, "work", []byte(strconv.Itoa(i)), fmt.Sprintf("work-%d", i)); err != nil {
			return err
		}
	}
	if *scale > 0 {
		logLine("submitted-scale", *scale, pid, now())
	}
	logLine("ready", *owner, pid, now())
	if *submitOnly {
		return nil
	}
	if *untilIdle {
		return x.RunUntilIdle(ctx)
	}
	return x.Run(ctx)
}
