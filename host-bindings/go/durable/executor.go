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
// The executor is a driver, like the in-process call drivers: its loop feeds the core's
// machine (levee.Executor, docs/durable.md "The executor") what happened and carries out the
// commands it answers. The core decides what to claim, when a call is due, what a record
// found after a crash means, whether to retry and how long to wait, when to renew a lease and
// what each row holds; the executor runs the store's statements (durable/sqlite.sql and
// durable/postgres.sql), the handlers, their timers and cancellation. The record
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
	"math"
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
	machines map[*levee.Executor]struct{} // of the runs in progress, which Register reaches too
	wake     chan struct{}
}

// New returns an executor of the engine's policies on the store.
func New(engine *levee.Engine, store Store, opts ...Option) *Executor {
	x := &Executor{
		engine: engine, store: store, log: slog.Default(), handlers: map[string]registered{},
		machines: map[*levee.Executor]struct{}{}, wake: make(chan struct{}, 1),
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
	defer x.mu.Unlock()
	x.handlers[name] = r
	for m := range x.machines {
		if err := m.Register(name); err != nil {
			return err
		}
	}
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
	return x.operator(ctx, id, false)
}

// Retry gives a dead or cancelled call a fresh set of attempts, due now.
func (x *Executor) Retry(ctx context.Context, id int64) (bool, error) {
	ok, err := x.operator(ctx, id, true)
	x.signal()
	return ok, err
}

// operator writes what the core answers for an operator's cancel or retry, compare-and-set
// against the record read, tried levee.DurableOperatorTries times against concurrent writers.
func (x *Executor) operator(ctx context.Context, id int64, revive bool) (bool, error) {
	for range levee.DurableOperatorTries {
		r, err := x.store.get(ctx, id)
		if err != nil || r == nil {
			return false, err
		}
		now, err := x.store.now(ctx)
		if err != nil {
			return false, err
		}
		w, err := x.engine.ExecOperator(id, r.record, revive, now)
		var le *levee.LoadError
		if errors.As(err, &le) {
			return false, nil // finished already, or a record the core cannot use
		}
		if err != nil {
			return false, err
		}
		ok, err := x.store.replace(ctx, id, w.Status, w.NextAt, w.Attempts, w.Record, w.Error, r.record)
		if err != nil || ok {
			return ok, err
		}
	}
	return false, nil
}

// Run claims and runs due calls until ctx is done, then cancels the attempts still running
// (their calls stay running in the store and are resumed, by this process or another, once
// their lease lapses) and returns nil. Calls found due at start-up, including ones cut off by a
// crash once their lease lapses, are resumed first.
func (x *Executor) Run(ctx context.Context) error { return x.run(ctx, false) }

// RunUntilIdle is Run that also returns once no call is pending in the store.
func (x *Executor) RunUntilIdle(ctx context.Context) error { return x.run(ctx, true) }

// The loop is a driver of the core's machine (levee.Executor, docs/durable.md "The
// executor"): it feeds what happened and carries out the commands answered, in order. Every
// decision is the machine's; the loop keeps the store's I/O (in goroutines that report back
// through a channel), the handlers, their timers and cancellation, and the logger.

// errAbandoned cancels an attempt the machine abandoned (its call is lost to another process
// or an operator, or its lease ran out): nothing of it is recorded.
var errAbandoned = errors.New("levee durable: the attempt was abandoned")

// recoverAfter is how soon the loop feeds the machine again after the engine failed to
// answer: the engine itself tries to re-instantiate at most every 100 ms.
const recoverAfter = 100 * time.Millisecond

// message is what a goroutine reports to the loop: an event for the machine of generation
// gen, or a running attempt's end or renewal tick.
type message struct {
	gen     uint64
	ev      levee.ExecEvent
	run     *attemptRun // the attempt a renewal tick or an end belongs to
	result  []byte      // the handler's result (an end)
	claimed []claimed   // the rows a claim returned
}

// attemptRun is a handler's attempt in flight.
type attemptRun struct {
	id     int64
	cancel context.CancelCauseFunc
	stop   chan struct{} // closed to stop its renewal ticks
}

// loop is one run of the executor: its machine and what the host holds for it.
type loop struct {
	x       *Executor
	ctx     context.Context // the caller's
	runCtx  context.Context // ends when the run does: the store's I/O and the attempts
	wg      sync.WaitGroup
	done    chan struct{} // closed when the loop returns: goroutines stop reporting
	msgs    chan message
	cfg     levee.ExecutorConfig
	mach    *levee.Executor
	gen     uint64
	epoch   time.Time
	rows    map[int64]claimed     // the claimed rows, for their handler's payload and key
	results map[int64][]byte      // a finished handler's result, until its row is written
	runs    map[int64]*attemptRun // the attempts running
	timer   *time.Timer
	timerOn bool
	woken   bool // a wake came while the loop was not sleeping: the next sleep is a poll
	idle    bool
	// closedErr: the engine is closed, the run returns it
	closedErr error
}

func (x *Executor) run(ctx context.Context, untilIdle bool) error {
	runCtx, stop := context.WithCancel(ctx)
	l := &loop{
		x: x, ctx: ctx, runCtx: runCtx, done: make(chan struct{}), msgs: make(chan message, 64),
		cfg: levee.ExecutorConfig{Owner: x.owner, Concurrency: uint32(x.concurrency), Poll: uint64(max(x.poll, 0)),
			ClaimHold: uint64(max(x.hold, 0)), UntilIdle: untilIdle},
		epoch: time.Now(), rows: map[int64]claimed{}, results: map[int64][]byte{}, runs: map[int64]*attemptRun{},
		timer: time.NewTimer(time.Hour),
	}
	l.timer.Stop()
	defer func() {
		if !l.idle {
			stop() // cancel the attempts still running: their rows are resumed once their leases lapse
		}
		waited := make(chan struct{})
		go func() {
			l.wg.Wait()
			close(waited)
		}()
		for drained := false; !drained; {
			select {
			case <-waited:
				drained = true
			case <-l.msgs: // nothing is fed any more
			}
		}
		stop()
		close(l.done)
		l.timer.Stop()
		l.dropMachine()
	}()
	if err := l.newMachine(); err != nil {
		return err
	}
	l.feed(levee.ExecEvent{Kind: levee.ExecPoll})
	for !l.idle {
		select {
		case <-ctx.Done():
			return nil
		case m := <-l.msgs:
			l.receive(m)
		case <-x.wake:
			l.wake()
		case <-l.timer.C:
			l.timerOn = false
			l.feed(levee.ExecEvent{Kind: levee.ExecPoll})
		}
		if errors.Is(l.closedErr, levee.ErrClosed) {
			return l.closedErr
		}
	}
	return nil
}

// newMachine makes the run's machine, with every handler registered so far.
func (l *loop) newMachine() error {
	m, err := l.x.engine.NewExecutor(l.cfg)
	if err != nil {
		return err
	}
	l.x.mu.Lock()
	defer l.x.mu.Unlock()
	for name := range l.x.handlers {
		if err := m.Register(name); err != nil {
			_ = m.Close()
			return err
		}
	}
	l.x.machines[m] = struct{}{}
	l.mach = m
	return nil
}

func (l *loop) dropMachine() {
	l.x.mu.Lock()
	delete(l.x.machines, l.mach)
	l.x.mu.Unlock()
	_ = l.mach.Close()
}

// now is the loop's monotonic clock, ns.
func (l *loop) now() uint64 { return uint64(time.Since(l.epoch)) }

// feed feeds the machine and carries out its commands, in order.
func (l *loop) feed(ev levee.ExecEvent) {
	cmds, err := l.mach.Feed(l.now(), ev)
	if err != nil {
		l.fault(err)
		return
	}
	for _, c := range cmds {
		l.do(c)
	}
}

// fault: the engine failed or replaced the machine. The calls held are abandoned (their rows
// are resumed once their leases lapse); the reports of what the old machine asked for are
// dropped.
func (l *loop) fault(err error) {
	l.abandonAll()
	l.gen++
	switch {
	case errors.Is(err, levee.ErrExecutorReset):
		l.sleep(0)
	case errors.Is(err, levee.ErrClosed):
		l.closedErr = err
	default:
		l.x.log.Error("levee durable: the engine failed; the calls this process held are resumed when their leases lapse",
			"err", err)
		l.sleep(recoverAfter)
	}
}

func (l *loop) abandonAll() {
	for id, r := range l.runs {
		r.cancel(errAbandoned)
		close(r.stop)
		delete(l.runs, id)
	}
	clear(l.rows)
	clear(l.results)
}

// sleep feeds a poll after d (a new sleep replaces the last).
func (l *loop) sleep(d time.Duration) {
	l.timer.Reset(d)
	l.timerOn = true
}

// wake is a submission or an attempt's end: a sleep ends now, else the next sleep is a poll.
func (l *loop) wake() {
	if l.timerOn {
		l.sleep(0)
	} else {
		l.woken = true
	}
}

// report sends m to the loop, unless the loop has returned.
func (l *loop) report(m message) {
	select {
	case l.msgs <- m:
	case <-l.done:
	}
}

// spawn runs the store's I/O f in a goroutine of the run.
func (l *loop) spawn(f func()) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		f()
	}()
}

// receive feeds what a goroutine reported, unless it belongs to a machine replaced since, to
// an attempt no longer held, or to a run that stops.
func (l *loop) receive(m message) {
	if m.gen != l.gen || l.ctx.Err() != nil {
		return
	}
	id := m.ev.ID
	switch m.ev.Kind {
	case levee.ExecClaimed:
		for _, c := range m.claimed {
			l.rows[c.id] = c
			m.ev.Rows = append(m.ev.Rows, levee.ClaimedCall{ID: c.id, Handler: c.handler, Record: c.record, DBNow: c.dbNow})
		}
	case levee.ExecRenew:
		if l.runs[id] != m.run {
			return
		}
	case levee.ExecFinished:
		if l.runs[id] != m.run {
			return
		}
		close(m.run.stop)
		delete(l.runs, id)
		if m.result != nil {
			l.results[id] = m.result
		}
	}
	l.feed(m.ev)
	if m.ev.Kind == levee.ExecWritten && l.runs[id] == nil {
		// the machine is done with the call, or waits for its outcome's write
		delete(l.rows, id)
		delete(l.results, id)
		l.wake()
	}
}

func dur(ns uint64) time.Duration { return time.Duration(min(ns, 1<<63-1)) }

// do carries out one command.
func (l *loop) do(c levee.ExecCommand) {
	x, gen, ctx := l.x, l.gen, l.runCtx
	switch c.Kind {
	case levee.ExecClaim:
		l.spawn(func() {
			rows, err := x.store.claim(ctx, x.owner, c.Hold, int(min(c.Limit, 1<<31-1)))
			ev := levee.ExecEvent{Kind: levee.ExecClaimed}
			if err != nil {
				ev = levee.ExecEvent{Kind: levee.ExecClaimFailed, Error: err.Error()}
			}
			l.report(message{gen: gen, ev: ev, claimed: rows})
		})
	case levee.ExecWrite:
		w := writeArgs{status: c.Row.Status, nextAt: c.Row.NextAt, attempts: c.Row.Attempts, record: c.Row.Record,
			err: c.Row.Error}
		if c.Row.Lease {
			w.leaseOwner = &x.owner
		}
		if c.Row.KeepResult {
			w.result = l.results[c.Row.ID]
		}
		id := c.Row.ID
		l.spawn(func() {
			ok, err := x.store.write(ctx, id, x.owner, w)
			r := levee.WriteResult{Kind: levee.WriteApplied}
			switch {
			case err != nil:
				r = levee.WriteResult{Kind: levee.WriteFailed, Error: err.Error()}
			case !ok:
				r.Kind = levee.WriteLost
			}
			l.report(message{gen: gen, ev: levee.ExecEvent{Kind: levee.ExecWritten, ID: id, Result: r}})
		})
	case levee.ExecRun:
		l.start(c)
	case levee.ExecAbandon:
		if r := l.runs[c.ID]; r != nil {
			r.cancel(errAbandoned)
			close(r.stop)
			delete(l.runs, c.ID)
		}
		delete(l.rows, c.ID)
		delete(l.results, c.ID)
	case levee.ExecQuarantine:
		delete(l.rows, c.ID)
		delete(l.results, c.ID)
		l.spawn(func() {
			if err := x.store.quarantine(ctx, c.ID, c.Error); err != nil && l.ctx.Err() == nil {
				x.log.Error("levee durable: quarantining a record", "call", c.ID, "reason", c.Error, "err", err)
			}
		})
	case levee.ExecNextDue:
		l.spawn(func() {
			in, pending, err := x.store.nextDueIn(ctx)
			ev := levee.ExecEvent{Kind: levee.ExecNextDueIn, Pending: pending, DueIn: uint64(max(in, 0))}
			if err != nil {
				if l.ctx.Err() == nil {
					x.log.Error("levee durable: reading the next due time", "err", err)
				}
				// unknown: the machine sleeps its longest, the poll interval
				ev.Pending, ev.DueIn = true, math.MaxUint64
			}
			l.report(message{gen: gen, ev: ev})
		})
	case levee.ExecSleep:
		var d time.Duration
		if now := l.now(); c.Until > now {
			d = dur(c.Until - now)
		}
		if l.woken {
			l.woken, d = false, 0
		}
		l.sleep(d)
	case levee.ExecIdle:
		l.idle = true
	case levee.ExecLog:
		var attrs []any
		if c.ID != 0 {
			attrs = append(attrs, "call", c.ID)
		}
		if c.Level == levee.LogWarn {
			x.log.Warn(c.Text, attrs...)
		} else {
			x.log.Error(c.Text, attrs...)
		}
	}
}

// start runs a handler's attempt in a goroutine under its timeout, with its renewal ticks in
// another; its end is reported to the loop (nothing is, once it was abandoned or the run stops).
func (l *loop) start(c levee.ExecCommand) {
	x, gen := l.x, l.gen
	row := l.rows[c.ID]
	delete(l.rows, c.ID)
	reg, registered := x.handler(row.handler)
	actx, cancel := context.WithCancelCause(l.runCtx)
	run := &attemptRun{id: c.ID, cancel: cancel, stop: make(chan struct{})}
	l.runs[c.ID] = run
	l.wg.Add(2)
	go func() {
		defer l.wg.Done()
		defer cancel(nil)
		hctx := actx
		if c.Timeout > 0 {
			var stopT context.CancelFunc
			hctx, stopT = context.WithTimeout(actx, dur(c.Timeout))
			defer stopT()
		}
		call := Call{ID: c.ID, Attempt: c.Attempt, IdempotencyKey: deref(row.idempotencyKey), Timeout: dur(c.Timeout)}
		var result []byte
		var herr error
		if registered {
			result, herr = runHandler(hctx, reg.fn, row.payload, call)
		} else {
			herr = fmt.Errorf("handler: no durable handler named `%s` is registered", row.handler)
		}
		if context.Cause(actx) != nil {
			return // abandoned, or the executor stops: nothing is recorded
		}
		ev := levee.ExecEvent{Kind: levee.ExecFinished, ID: c.ID}
		var o levee.Outcome
		switch {
		case herr == nil:
			o = levee.Outcome{Kind: levee.OutcomeSuccess}
		case errors.Is(hctx.Err(), context.DeadlineExceeded):
			o = levee.Outcome{Kind: levee.OutcomeTimeout} // the message is the core's
		default:
			o, ev.Message = levee.Classify(hctx, herr), herr.Error()
		}
		if x.onAttemptDone != nil {
			x.onAttemptDone(c.ID, c.Attempt, o)
		}
		ev.Outcome, ev.Code, ev.Text = o.Kind, o.Code, o.Text
		if o.Overloaded {
			ev.Flags = 1
		}
		l.report(message{gen: gen, ev: ev, run: run, result: result})
	}()
	go func() {
		defer l.wg.Done()
		t := time.NewTicker(max(dur(c.RenewEvery), time.Nanosecond))
		defer t.Stop()
		for {
			select {
			case <-run.stop:
				return
			case <-actx.Done():
				return
			case <-t.C:
				l.report(message{gen: gen, ev: levee.ExecEvent{Kind: levee.ExecRenew, ID: c.ID}, run: run})
			}
		}
	}()
}

// panicError is a handler's panic, reported as the error class `panic`.
type panicError struct{ v any }

func (p panicError) Error() string      { return fmt.Sprintf("the handler panicked: %v", p.v) }
func (p panicError) ErrorClass() string { return "panic" }

func runHandler(ctx context.Context, fn Handler, payload []byte, call Call) (out []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			out, err = nil, panicError{v}
		}
	}()
	return fn(ctx, payload, call)
}
