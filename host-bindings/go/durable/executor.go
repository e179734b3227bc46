// Package durable runs durable calls: retries that survive a process restart.
//
//	engine, _ := levee.Load(ctx, policies)
//	store, _ := durable.OpenSQLite(ctx, "calls.db") // or durable.OpenPostgres(ctx, "host=... dbname=...")
//	x := durable.New(engine, store)
//	x.Register("send-invoice", sendInvoice, durable.WithPolicy("email"), durable.NotIdempotent())
//	id, _ := x.Submit(ctx, "send-invoice", []byte(`{"order": 17}`), "invoice-17")
//	// or, stored if and only if the caller's transaction commits (a pgx.Tx, or an SQLite *sql.Tx):
//	id, _ = x.SubmitTx(ctx, tx, "send-invoice", []byte(`{"order": 17}`), "invoice-17")
//	err := x.Run(ctx) // resumes what is due at start-up, then sleeps until the next call is due
//
// The executor is a driver, like the in-process call drivers: it asks the core
// (Engine.Durable*) at every step and does what the answer says. The core decides when a call
// is due, what a record found after a crash means, whether to retry and how long to wait; the
// executor persists the record the core returns before each attempt and after each outcome,
// through the shared statements of durable/sqlite.sql and durable/postgres.sql. The record
// bytes and the rows are the same in every host: a call a Python process wrote is resumed by a
// Go process, and the other way round.
//
// Every write is fenced by the row's holder (lease_owner): a process that lost a call (its
// lease lapsed and another process took it, or an operator cancelled it) has its writes
// refused, so it never records an outcome for a call it no longer holds. A record the core
// refuses (corrupt, another version, a policy no longer loaded) is quarantined with the
// core's error, which names it. See docs/durable.md for the guarantees and the clock rules.
package durable

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"sync"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

// Handler runs one attempt of a durable call. ctx ends at the attempt's timeout (the core's,
// already bounded by the call's deadline) and when the executor loses the call or stops. The
// error is classified as for in-process calls (levee.Classify): return levee.HTTPStatusError,
// levee.ClassError and the like to say what happened; the policy decides what follows.
type Handler func(ctx context.Context, payload []byte, call Call) ([]byte, error)

// Call is what a handler knows of the attempt it runs.
type Call struct {
	ID      int64
	Attempt uint32 // counting the first
	// IdempotencyKey is the call's key ("" for none): use it to make a second run of an
	// attempt whose outcome was lost harmless.
	IdempotencyKey string
	Timeout        time.Duration // 0: none
}

// CallStatus is what the store holds for a call. Record is the core's description of the
// record (its canonical JSON, decoded), nil for a record the core cannot read (Error says why).
type CallStatus struct {
	ID             int64
	Handler        string
	Status         string // scheduled, running, done, dead, cancelled or quarantined
	NextAt         int64  // wall ns since the Unix epoch
	Attempts       int64
	LeaseOwner     string
	IdempotencyKey string
	Error          string
	Result         []byte
	Record         map[string]any
}

// Option configures an Executor.
type Option func(*Executor)

// WithOwner names this process in leases; it must be unique per process (the default is the
// host name, the pid and a random suffix).
func WithOwner(owner string) Option { return func(x *Executor) { x.owner = owner } }

// WithConcurrency bounds the calls this process runs at once (default 16).
func WithConcurrency(n int) Option { return func(x *Executor) { x.concurrency = max(1, n) } }

// WithPollInterval is the longest the executor sleeps before looking at the store again
// (default 1 s): calls other processes submit are seen within it.
func WithPollInterval(d time.Duration) Option { return func(x *Executor) { x.poll = d } }

// WithClaimHold is how long a claim keeps calls out of other processes' due window until the
// core's answer is written, milliseconds later (default 5 s): a process that dies right after
// claiming delays its claimed calls by that much.
func WithClaimHold(d time.Duration) Option { return func(x *Executor) { x.hold = d } }

// WithAttemptDone calls f after an attempt's outcome is known and before it is persisted (for
// metrics; the crash tests kill the process there).
func WithAttemptDone(f func(callID int64, attempt uint32, o levee.Outcome)) Option {
	return func(x *Executor) { x.onAttemptDone = f }
}

// WithLogger is where the executor reports what it cannot tell a caller (a store that failed
// while a call ran); the default is slog.Default().
func WithLogger(l *slog.Logger) Option { return func(x *Executor) { x.log = l } }

// HandlerOption configures a registered handler.
type HandlerOption func(*registered)

// WithPolicy runs the handler under the named policy (default: the handler's name).
func WithPolicy(name string) HandlerOption { return func(r *registered) { r.policy = name } }

// NotIdempotent marks the operation as not idempotent: a call of it without an idempotency
// key is not retried after a failure, nor after a crash (its outcome is unknown).
func NotIdempotent() HandlerOption { return func(r *registered) { r.idempotent = false } }

type registered struct {
	fn         Handler
	policy     string
	idempotent bool
}

// Executor runs durable calls from a store: at most one process at a time per call, under a
// lease. Its methods are safe for concurrent use.
type Executor struct {
	engine        *levee.Engine
	store         Store
	owner         string
	concurrency   int
	poll          time.Duration
	hold          time.Duration
	onAttemptDone func(int64, uint32, levee.Outcome)
	log           *slog.Logger

	mu       sync.Mutex
	handlers map[string]registered
	wake     chan struct{}
}

// New returns an executor of the engine's policies on the store.
func New(engine *levee.Engine, store Store, opts ...Option) *Executor {
	x := &Executor{
		engine: engine, store: store, concurrency: 16, poll: time.Second, hold: 5 * time.Second,
		log: slog.Default(), handlers: map[string]registered{}, wake: make(chan struct{}, 1),
	}
	for _, o := range opts {
		o(x)
	}
	if x.owner == "" {
		host, _ := os.Hostname()
		var b [4]byte
		_, _ = rand.Read(b[:])
		x.owner = fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:]))
	}
	return x
}

// Owner is the name this process holds leases under.
func (x *Executor) Owner() string { return x.owner }

// Register registers fn under name. The policy must exist now (the error is the engine's
// UnknownPolicyError otherwise), not at run time.
func (x *Executor) Register(name string, fn Handler, opts ...HandlerOption) error {
	r := registered{fn: fn, policy: name, idempotent: true}
	for _, o := range opts {
		o(&r)
	}
	if _, err := x.engine.Policy(r.policy); err != nil {
		return err
	}
	x.mu.Lock()
	x.handlers[name] = r
	x.mu.Unlock()
	return nil
}

func (x *Executor) handler(name string) (registered, bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	r, ok := x.handlers[name]
	return r, ok
}

func (x *Executor) signal() {
	select {
	case x.wake <- struct{}{}:
	default:
	}
}

// Submit persists a new call of handler and returns its id. A second submission with the
// same idempotency key ("" for none) returns the first call's id and adds nothing.
func (x *Executor) Submit(ctx context.Context, handler string, payload []byte, idempotencyKey string) (int64, error) {
	return x.submit(ctx, nil, handler, payload, idempotencyKey, "")
}

// SubmitKeyed is Submit with the policy's key (the key of its per-key state, as for Do).
func (x *Executor) SubmitKeyed(ctx context.Context, handler string, payload []byte, idempotencyKey, key string) (int64, error) {
	return x.submit(ctx, nil, handler, payload, idempotencyKey, key)
}

// SubmitTx is Submit inside the caller's open transaction tx, so that the call is stored if
// and only if the caller's own writes are (the outbox pattern): a call submitted by a
// transaction that rolls back, or never commits, is not in the store and never runs.
//
// tx is a pgx.Tx (github.com/jackc/pgx/v5) on the database of a PostgresStore, or a *sql.Tx
// (database/sql, the "sqlite" driver of modernc.org/sqlite) on the file of an SQLiteStore. A
// transaction of another kind, or on another database, file or search_path, is refused with
// an error that says so (prefix "levee durable: tx: "), before anything is written. The
// clock is the store's, as for Submit: the database's, read through tx, for PostgreSQL.
//
// The call runs once the caller commits: an executor of the store sees it at its next poll at
// the latest (WithPollInterval, 1 s by default), since a commit it did not make does not wake
// it. The idempotency key is checked inside tx: a second submission with the same key, in tx
// or after the first committed, returns the first call's id and adds nothing. SubmitTx does
// not commit or roll back tx.
//
// For SQLite, the caller's database should wait on a locked file as the store does (open it
// with "?_pragma=busy_timeout(30000)&_txlock=immediate"): the file has one writer at a time,
// and the executor waits for the caller's transaction to end before it claims calls.
func (x *Executor) SubmitTx(ctx context.Context, tx any, handler string, payload []byte, idempotencyKey string) (int64, error) {
	return x.SubmitKeyedTx(ctx, tx, handler, payload, idempotencyKey, "")
}

// SubmitKeyedTx is SubmitTx with the policy's key (the key of its per-key state, as for Do).
func (x *Executor) SubmitKeyedTx(ctx context.Context, tx any, handler string, payload []byte, idempotencyKey, key string) (int64, error) {
	if isNil(tx) {
		return 0, errTx(x.store.Dialect(), "nil: SubmitTx needs the caller's open transaction (Submit uses the store's own)")
	}
	return x.submit(ctx, tx, handler, payload, idempotencyKey, key)
}

// isNil is true for a nil interface and for a nil pointer, map, func and the like in one.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch r := reflect.ValueOf(v); r.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface:
		return r.IsNil()
	}
	return false
}

// submit is every Submit: through the store's own connection (tx nil) or the caller's tx.
func (x *Executor) submit(ctx context.Context, tx any, handler string, payload []byte, idempotencyKey, key string) (int64, error) {
	if err := levee.CheckKey(key); err != nil {
		return 0, err
	}
	r, ok := x.handler(handler)
	if !ok {
		return 0, fmt.Errorf("levee durable: no durable handler named `%s` is registered", handler)
	}
	index, ok, err := x.engine.PolicyIndex(r.policy)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, fmt.Errorf("levee durable: handler `%s`: `%s` is not a policy of the loaded document", handler, r.policy)
	}
	var flags uint32
	if !r.idempotent {
		flags = 1
	}
	sub, err := x.store.submitter(ctx, tx)
	if err != nil {
		return 0, err
	}
	now, err := sub.now(ctx)
	if err != nil {
		return 0, err
	}
	step, err := x.engine.DurableBegin(index, key, idempotencyKey, flags, now)
	if err != nil {
		return 0, err
	}
	var k *string
	if idempotencyKey != "" {
		k = &idempotencyKey
	}
	id, err := sub.insert(ctx, handler, append([]byte{}, payload...), k, step.NextAt, step.Record)
	if err == nil && tx == nil {
		x.signal() // a call in the caller's transaction is not visible until it commits
	}
	return id, err
}

// Status is what the store holds for a call; ok is false for an unknown id.
func (x *Executor) Status(ctx context.Context, id int64) (s CallStatus, ok bool, err error) {
	r, err := x.store.get(ctx, id)
	if err != nil || r == nil {
		return CallStatus{}, false, err
	}
	return x.status(*r), true, nil
}

// Calls lists every call of the store.
func (x *Executor) Calls(ctx context.Context) ([]CallStatus, error) { return x.list(ctx, false) }

// Dead lists the calls given up, and the quarantined records, with their last error.
func (x *Executor) Dead(ctx context.Context) ([]CallStatus, error) { return x.list(ctx, true) }

func (x *Executor) list(ctx context.Context, deadOnly bool) ([]CallStatus, error) {
	rows, err := x.store.rows(ctx, deadOnly)
	if err != nil {
		return nil, err
	}
	out := make([]CallStatus, len(rows))
	for i, r := range rows {
		out[i] = x.status(r)
	}
	return out, nil
}

// Counts is how many calls the store holds in each status.
func (x *Executor) Counts(ctx context.Context) (map[string]int64, error) { return x.store.counts(ctx) }

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func (x *Executor) status(r row) CallStatus {
	s := CallStatus{
		ID: r.id, Handler: r.handler, Status: r.status, NextAt: r.nextAt, Attempts: r.attempts,
		LeaseOwner: deref(r.leaseOwner), IdempotencyKey: deref(r.idempotencyKey), Error: deref(r.err), Result: r.result,
	}
	if js, err := x.engine.DurableInspect(r.record); err == nil {
		var rec map[string]any
		if json.Unmarshal([]byte(js), &rec) == nil {
			s.Record = rec
		}
	}
	return s
}

// Cancel cancels a call that has not finished. An attempt running now may still complete;
// its outcome is then refused. It reports false when the call is unknown or already finished.
func (x *Executor) Cancel(ctx context.Context, id int64) (bool, error) {
	return x.operator(ctx, id, x.engine.DurableCancel)
}

// Retry gives a dead or cancelled call a fresh set of attempts, due now.
func (x *Executor) Retry(ctx context.Context, id int64) (bool, error) {
	ok, err := x.operator(ctx, id, x.engine.DurableRevive)
	x.signal()
	return ok, err
}

func (x *Executor) operator(ctx context.Context, id int64, op func([]byte, uint64) (levee.DurableStep, error)) (bool, error) {
	for range 10 { // compare-and-set against concurrent writers
		r, err := x.store.get(ctx, id)
		if err != nil || r == nil {
			return false, err
		}
		now, err := x.store.now(ctx)
		if err != nil {
			return false, err
		}
		step, err := op(r.record, now)
		var le *levee.LoadError
		if errors.As(err, &le) {
			return false, nil // finished already, or a record the core cannot use
		}
		if err != nil {
			return false, err
		}
		var msg *string
		if step.Action == levee.DurableCancelled {
			m := "cancelled by an operator"
			msg = &m
		}
		ok, err := x.store.replace(ctx, id, statusOf(step.Action), step.NextAt, step.Attempt, step.Record, msg, r.record)
		if err != nil || ok {
			return ok, err
		}
	}
	return false, nil
}

func statusOf(a levee.DurableAction) string {
	switch a {
	case levee.DurableRun:
		return "running"
	case levee.DurableWait:
		return "scheduled"
	case levee.DurableDone:
		return "done"
	case levee.DurableDead:
		return "dead"
	default:
		return "cancelled"
	}
}

// Run claims and runs due calls until ctx is done, then cancels the attempts still running
// (their calls stay running in the store and are resumed, by this process or another, once
// their lease lapses) and returns nil. Calls found due at start-up, including ones cut off by a
// crash once their lease lapses, are resumed first.
func (x *Executor) Run(ctx context.Context) error { return x.run(ctx, false) }

// RunUntilIdle is Run that also returns once no call is pending in the store.
func (x *Executor) RunUntilIdle(ctx context.Context) error { return x.run(ctx, true) }

func (x *Executor) run(ctx context.Context, untilIdle bool) error {
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		stop()
		wg.Wait()
	}()
	done := make(chan struct{}, x.concurrency) // one send per attempt goroutine, never blocking
	running := 0
	for {
		for drained := false; !drained; { // the attempts that ended since the last look
			select {
			case <-done:
				running--
			default:
				drained = true
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		var claimed []claimed
		var err error
		if free := x.concurrency - running; free > 0 {
			// The records' last-seen becomes the claim's db_now, read while the statement runs:
			// the monotonic clock counts from before it, so that the time the claim takes to
			// return (or the writes that follow) never shortens a wait: a retry may start late,
			// never early.
			got := time.Now()
			claimed, err = x.store.claim(runCtx, x.owner, uint64(x.hold), free)
			for i := range claimed {
				claimed[i].got = got
			}
			if err != nil && ctx.Err() == nil {
				x.log.Error("levee durable: claiming due calls", "err", err)
			}
		}
		for _, c := range claimed {
			running++
			wg.Add(1)
			go func() {
				defer func() {
					wg.Done()
					done <- struct{}{}
					x.signal()
				}()
				x.drive(runCtx, c)
			}()
		}
		if len(claimed) > 0 && running < x.concurrency {
			continue
		}
		wait := x.poll
		if err == nil {
			in, pending, err := x.store.nextDueIn(runCtx)
			switch {
			case err != nil:
				if ctx.Err() == nil {
					x.log.Error("levee durable: reading the next due time", "err", err)
				}
			case !pending && untilIdle && running == 0:
				return nil
			case pending:
				wait = min(wait, time.Duration(max(in, 0)))
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-x.wake:
		case <-done:
			running--
		case <-t.C:
		}
		t.Stop()
	}
}

// errLost: this process no longer holds the call (a fenced write was refused).
var errLost = errors.New("levee durable: the call is held by another process now")

func (x *Executor) write(ctx context.Context, c claimed, step levee.DurableStep, result []byte) error {
	w := writeArgs{status: statusOf(step.Action), nextAt: step.NextAt, attempts: step.Attempt, record: step.Record}
	if step.Action == levee.DurableRun {
		w.leaseOwner = &x.owner
	}
	if step.Action == levee.DurableDone {
		w.result = result
	}
	if step.Action == levee.DurableDead {
		msg := x.deadReason(step)
		w.err = &msg
	}
	ok, err := x.store.write(ctx, c.id, x.owner, w)
	if err != nil {
		return err
	}
	if !ok {
		return errLost
	}
	return nil
}

// deadReason is the error column of a call given up: the reason, then the last error as the
// record holds it (the same text in every host).
func (x *Executor) deadReason(step levee.DurableStep) string {
	js, err := x.engine.DurableInspect(step.Record)
	if err != nil {
		return step.Reason.String()
	}
	var rec struct {
		LastError *struct {
			Attempt uint64 `json:"attempt"`
			Class   string `json:"class"`
			Message string `json:"message"`
		} `json:"last-error"`
	}
	if json.Unmarshal([]byte(js), &rec) != nil || rec.LastError == nil {
		return fmt.Sprintf("%s: attempt 0 failed with ``: ", step.Reason)
	}
	return fmt.Sprintf("%s: attempt %d failed with `%s`: %s", step.Reason, rec.LastError.Attempt, rec.LastError.Class,
		rec.LastError.Message)
}

func (x *Executor) quarantine(ctx context.Context, c claimed, err error) {
	msg := err.Error()
	if qerr := x.store.quarantine(ctx, c.id, msg); qerr != nil && ctx.Err() == nil {
		x.log.Error("levee durable: quarantining a record", "call", c.id, "reason", msg, "err", qerr)
	}
}

// coreAnswer sorts an error of the engine: a LoadError names what is wrong with the record
// (quarantine it); anything else is the engine's own fault (leave the call to be resumed).
func (x *Executor) coreAnswer(ctx context.Context, c claimed, err error) {
	var le *levee.LoadError
	if errors.As(err, &le) {
		x.quarantine(ctx, c, err)
		return
	}
	x.log.Error("levee durable: the engine failed; the call is resumed when its claim lapses", "call", c.id, "err", err)
}

func (x *Executor) drive(ctx context.Context, c claimed) {
	reg, ok := x.handler(c.handler)
	if !ok {
		x.quarantine(ctx, c, fmt.Errorf("handler: no durable handler named `%s` is registered", c.handler))
		return
	}
	step, err := x.engine.DurableStep(c.record, x.owner, c.dbNow, 0)
	if err != nil {
		x.coreAnswer(ctx, c, err)
		return
	}
	if err := x.write(ctx, c, step, nil); err != nil { // before the attempt
		x.lostOrFailed(ctx, c, err)
		return
	}
	if step.Action != levee.DurableRun {
		return // a wait: the call is due again at next_at, for whichever process finds it
	}
	a, err := x.attempt(ctx, c, reg, step)
	if err != nil {
		x.lostOrFailed(ctx, c, err)
		return
	}
	if x.onAttemptDone != nil {
		x.onAttemptDone(c.id, step.Attempt, a.outcome)
	}
	// After the claim only the monotonic clock counts: the core works at max(the claim's
	// wall time, last seen + the monotonic time since it gave these bytes).
	o := a.outcome
	var flags uint32
	if o.Overloaded {
		flags = 1
	}
	after, err := x.engine.DurableOutcome(a.record, x.owner, c.dbNow, uint64(time.Since(a.got)), o.Kind, o.Code, o.Text,
		a.message, flags)
	if err != nil {
		x.coreAnswer(ctx, c, err)
		return
	}
	if err := x.write(ctx, c, after, a.result); err != nil {
		x.lostOrFailed(ctx, c, err)
	}
}

func (x *Executor) lostOrFailed(ctx context.Context, c claimed, err error) {
	if errors.Is(err, errLost) || ctx.Err() != nil {
		return // another process (or an operator) holds the call now, or this one stops
	}
	x.log.Error("levee durable: writing a call; it is resumed when its claim lapses", "call", c.id, "err", err)
}

type attemptResult struct {
	record  []byte    // the latest record (renewals change it)
	got     time.Time // when the core gave it (monotonic)
	result  []byte
	outcome levee.Outcome
	message string
}

// panicError is a handler's panic, reported as the error class `panic`.
type panicError struct{ v any }

func (p panicError) Error() string      { return fmt.Sprintf("the handler panicked: %v", p.v) }
func (p panicError) ErrorClass() string { return "panic" }

// attempt runs the handler under the attempt's timeout, renewing the lease every third of it.
// errLost: the call was lost (a renewal refused, or the lease ran out while the store could not
// be reached); ctx's error: the executor stops. Either way nothing is to be recorded.
func (x *Executor) attempt(ctx context.Context, c claimed, reg registered, step levee.DurableStep) (attemptResult, error) {
	got := c.got // step.Record's last-seen is the claim's db_now
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if step.Timeout > 0 {
		var stopT context.CancelFunc
		actx, stopT = context.WithTimeout(actx, time.Duration(min(step.Timeout, 1<<63-1)))
		defer stopT()
	}
	var mu sync.Mutex
	cur := attemptResult{record: step.Record, got: got}
	lease := time.Duration(i64(step.LeaseUntil - min(step.LeaseUntil, c.dbNow))) // as the core granted it
	stopRenew := make(chan struct{})
	renewDone := make(chan struct{})
	go func() {
		defer close(renewDone)
		every := max(50*time.Millisecond, lease/3)
		expires := got.Add(lease)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stopRenew:
				return
			case <-t.C:
			}
			mu.Lock()
			asked := time.Now() // r.Record's last-seen is this moment
			rec, since := cur.record, asked.Sub(cur.got)
			mu.Unlock()
			r, err := x.engine.DurableRenew(rec, x.owner, c.dbNow, uint64(since))
			if err == nil {
				err = x.write(ctx, c, r, nil)
				if err == nil {
					mu.Lock()
					cur.record, cur.got = r.Record, asked
					expires = cur.got.Add(lease)
					mu.Unlock()
					continue
				}
			}
			var le *levee.LoadError
			if errors.Is(err, errLost) || errors.As(err, &le) || time.Now().After(expires) {
				cancel(errLost)
				return
			}
			x.log.Warn("levee durable: renewing a lease", "call", c.id, "err", err) // tried again next tick
		}
	}()
	timeout := time.Duration(min(step.Timeout, 1<<63-1))
	call := Call{ID: c.id, Attempt: step.Attempt, IdempotencyKey: deref(c.idempotencyKey), Timeout: timeout}
	result, herr := runHandler(actx, reg.fn, c.payload, call)
	close(stopRenew)
	<-renewDone
	if errors.Is(context.Cause(actx), errLost) {
		return attemptResult{}, errLost
	}
	if ctx.Err() != nil {
		return attemptResult{}, ctx.Err()
	}
	mu.Lock()
	out := cur
	mu.Unlock()
	switch {
	case herr == nil:
		out.result, out.outcome = result, levee.Outcome{Kind: levee.OutcomeSuccess}
	case errors.Is(actx.Err(), context.DeadlineExceeded):
		out.outcome, out.message = levee.Outcome{Kind: levee.OutcomeTimeout}, "the attempt timed out"
	default:
		out.outcome, out.message = levee.Classify(actx, herr), truncate(herr.Error(), 4096)
	}
	return out, nil
}

func runHandler(ctx context.Context, fn Handler, payload []byte, call Call) (out []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			out, err = nil, panicError{v}
		}
	}()
	return fn(ctx, payload, call)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && s[n]&0xc0 == 0x80 { // not inside a UTF-8 sequence
		n--
	}
	return s[:n]
}
