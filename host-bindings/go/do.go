package levee

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"
)

// Policy is a named policy of an engine. It stays valid across Reload (it is
// resolved by name again) and is safe for use by many goroutines.
type Policy struct {
	e    *Engine
	name string
	st   atomic.Pointer[policyState]
	// index, info, ok are written under e.mu by refreshInfosLocked and published through st.
	index uint32
	info  PolicyInfo
	ok    bool
}

type policyState struct {
	index uint32
	info  PolicyInfo
	ok    bool
}

// Policy returns the named policy; an unknown name is an error.
func (e *Engine) Policy(name string) (*Policy, error) {
	if e == nil {
		return nil, errNilEngine
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.policies == nil {
		e.policies = map[string]*Policy{}
	}
	p := e.policies[name]
	if p == nil {
		p = &Policy{e: e, name: name}
		for i, info := range e.infos {
			if info.Name == name {
				p.index, p.info, p.ok = uint32(i), info, true
			}
		}
		p.publish()
		e.policies[name] = p
	}
	if !p.ok {
		known := make([]string, len(e.infos))
		for i, info := range e.infos {
			known[i] = info.Name
		}
		return nil, &UnknownPolicyError{Name: name, Known: known}
	}
	return p, nil
}

func (p *Policy) publish() { p.st.Store(&policyState{index: p.index, info: p.info, ok: p.ok}) }

// Policies lists the policy names of the loaded document, in order.
func (e *Engine) Policies() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	names := make([]string, len(e.infos))
	for i, info := range e.infos {
		names[i] = info.Name
	}
	return names
}

// Name is the policy's name ("" for a nil policy).
func (p *Policy) Name() string {
	if p == nil {
		return ""
	}
	return p.name
}

// Info is what the core says of the policy (its defaults filled in; zero for a nil policy).
func (p *Policy) Info() PolicyInfo {
	if p == nil {
		return PolicyInfo{}
	}
	return p.st.Load().info
}

// Engine is the engine the policy belongs to (nil for a nil policy).
func (p *Policy) Engine() *Engine {
	if p == nil {
		return nil
	}
	return p.e
}

// RegisterFallback registers (or replaces) a fallback by name for every call of the
// engine; a nil f removes the name's fallback.
func (e *Engine) RegisterFallback(name string, f Fallback) {
	e.fbMu.Lock()
	if f == nil {
		delete(e.fbs, name)
	} else {
		e.fbs[name] = f
	}
	e.fbMu.Unlock()
}

// TypedFallback is a fallback that returns a T: the value of a call whose result is a T.
// Of[T](p).Fallback checks at compile time that a call's fallback returns its result type
// (failsafe-go's Fallback[R]); RegisterTypedFallback and WithTypedFallback register one on
// the engine for the calls whose result is a T.
type TypedFallback[T any] func(ctx context.Context, cause error) (T, error)

// untyped is f as a Fallback (nil for a nil f).
func (f TypedFallback[T]) untyped() Fallback {
	if f == nil {
		return nil
	}
	return func(ctx context.Context, cause error) (any, error) {
		v, err := f(ctx, cause)
		if err != nil {
			return nil, err
		}
		return v, nil
	}
}

// fbKey is the key of a typed fallback: its name and the result type it returns.
type fbKey struct {
	name string
	t    reflect.Type
}

// RegisterTypedFallback registers (or replaces) f under name for the calls of e whose
// result is a T: DoValue[T] and Of[T](p).Do, and the Transport's for T = *http.Response.
// The engine keeps one fallback per name and result type, so one name can stand for an
// HTTP response and for a DoValue's value at once; a typed fallback of a call's result type
// wins over an untyped one (RegisterFallback), which serves the calls no typed one fits.
// A nil f removes the name's fallback for T.
func RegisterTypedFallback[T any](e *Engine, name string, f TypedFallback[T]) error {
	if e == nil {
		return errNilEngine
	}
	k := fbKey{name, reflect.TypeFor[T]()}
	e.fbMu.Lock()
	if f == nil {
		delete(e.tfbs, k)
	} else {
		e.tfbs[k] = f.untyped()
	}
	e.fbMu.Unlock()
	return nil
}

// Typed is the calls of a policy whose result is a T, with their own fallbacks checked
// at compile time: a fallback must return a T, as the function must.
//
//	q, err := levee.Of[Quote](p).Fallback("cached", fromCache).Do(ctx, fetchQuote)
type Typed[T any] struct {
	p   *Policy
	fbs []CallOption
}

// Of is the calls of p whose result is a T.
func Of[T any](p *Policy) Typed[T] { return Typed[T]{p: p} }

// Fallback returns t with f as the fallback of name for its calls (it wins over the
// engine's, as WithCallFallback does); t itself is unchanged.
func (t Typed[T]) Fallback(name string, f TypedFallback[T]) Typed[T] {
	fbs := append(t.fbs[:len(t.fbs):len(t.fbs)], WithCallFallback(name, f.untyped()))
	return Typed[T]{p: t.p, fbs: fbs}
}

// Do is DoValue(ctx, p, fn, opts...) with t's fallbacks (an option's fallback of the
// same name wins).
func (t Typed[T]) Do(ctx context.Context, fn func(ctx context.Context) (T, error), opts ...CallOption) (T, error) {
	if len(t.fbs) > 0 {
		opts = append(t.fbs[:len(t.fbs):len(t.fbs)], opts...)
	}
	return DoValue(ctx, t.p, fn, opts...)
}

// CallOption configures one call. Options are plain values (not closures), so
// applying them costs no allocation.
type CallOption struct {
	kind  callOptKind
	s     string
	flags uint32
	mask  uint32 // flag bits cleared before flags are set
	fb    Fallback
	// onRetry is the OnRetry hook
	onRetry func(RetryInfo)
	retryIf func(any, error) RetryAnswer
}

type callOptKind uint8

const (
	optNone callOptKind = iota
	optKey
	optFlags
	optFallback
	optOnRetry
	optHTTP
	optRetryIf
)

type callOpts struct {
	key       string
	flags     uint32
	fallbacks map[string]Fallback
	onRetry   func(RetryInfo)
	retryIf   func(any, error) RetryAnswer
	http      bool // the Transport's call (http.request.resend_count on its attempt spans)
}

func (o *CallOption) apply(c *callOpts) {
	switch o.kind {
	case optKey:
		c.key = o.s
	case optFlags:
		c.flags = c.flags&^o.mask | o.flags
	case optFallback:
		if c.fallbacks == nil {
			c.fallbacks = map[string]Fallback{}
		}
		c.fallbacks[o.s] = o.fb
	case optOnRetry:
		c.onRetry = o.onRetry
	case optHTTP:
		c.http = true
	case optRetryIf:
		c.retryIf = o.retryIf
	}
}

// WithKey runs the call under a key (say, a downstream host): breakers, buckets
// and budgets are kept per policy and key.
func WithKey(key string) CallOption { return CallOption{kind: optKey, s: key} }

// NotIdempotent marks the operation as not idempotent.
func NotIdempotent() CallOption { return CallOption{kind: optFlags, flags: FlagNotIdempotent} }

// WithIdempotencyKey says the operation carries an idempotency key.
func WithIdempotencyKey() CallOption { return CallOption{kind: optFlags, flags: FlagIdempotencyKey} }

// WithMethod passes the HTTP method of the operation to the core.
func WithMethod(method string) CallOption {
	return CallOption{kind: optFlags, mask: cStartMethodMask << flagMethodShift, flags: MethodFlag(method)}
}

// withFlags sets flag bits.
func withFlags(flags uint32) CallOption { return CallOption{kind: optFlags, flags: flags} }

// WithCallFallback registers a fallback for this call only (it wins over the engine's).
func WithCallFallback(name string, f Fallback) CallOption {
	return CallOption{kind: optFallback, s: name, fb: f}
}

// Do runs fn under the policy: every attempt under its per-attempt timeout (a
// context deadline), sleeps between attempts that stop when ctx is done, the
// policy's fallbacks. It returns nil on success (of fn or of a fallback) and
// otherwise a *Error (errors.Is it with the sentinel of its reason; errors.As
// or errors.Is for the last attempt's error).
func Do(ctx context.Context, p *Policy, fn func(ctx context.Context) error, opts ...CallOption) error {
	if fn == nil {
		return errNilFn
	}
	_, _, err := p.run(ctx, funcAttempt(fn), opts)
	return err
}

// Do is Do(ctx, p, fn, opts...).
func (p *Policy) Do(ctx context.Context, fn func(ctx context.Context) error, opts ...CallOption) error {
	if fn == nil {
		return errNilFn
	}
	_, _, err := p.run(ctx, funcAttempt(fn), opts)
	return err
}

// DoValue is Do for a function that returns a value. A fallback's value is
// returned when it succeeds; a fallback that returns anything but a T (or nil)
// is reported to the core as failed.
func DoValue[T any](ctx context.Context, p *Policy, fn func(ctx context.Context) (T, error), opts ...CallOption) (T, error) {
	if fn == nil {
		var zero T
		return zero, errNilFn
	}
	a := &valueAttempt[T]{fn: fn}
	fbv, used, err := p.run(ctx, a, opts)
	if used && err == nil {
		v, _ := fbv.(T)
		return v, nil
	}
	return a.val, err
}

// attempter runs one attempt under a timeout (0 = none) on e's clock and says what happened.
type attempter interface {
	attempt(e *Engine, ctx context.Context, timeout time.Duration) (Outcome, error)
	hedgedAttempter // the attempts of a hedged call (hedge.go)
}

// retryPreparer is an attempter that must prepare a retry (an error: it cannot be sent again).
type retryPreparer interface {
	prepareRetry() error
}

type funcAttempt func(ctx context.Context) error

func (f funcAttempt) attempt(e *Engine, ctx context.Context, timeout time.Duration) (Outcome, error) {
	if timeout <= 0 {
		err := f(ctx)
		return Classify(ctx, err), err
	}
	actx, cancel := e.withTimeout(ctx, timeout)
	err := f(actx)
	o := Classify(actx, err)
	cancel()
	return o, err
}

type valueAttempt[T any] struct {
	fn  func(ctx context.Context) (T, error)
	val T
	ok  bool // the last attempt returned val without an error
}

func (a *valueAttempt[T]) resultType() reflect.Type { return reflect.TypeFor[T]() }

func (a *valueAttempt[T]) checkFallback(v any) error {
	if v == nil {
		return nil
	}
	if _, ok := v.(T); !ok {
		var zero T
		return fmt.Errorf("levee: the fallback returned a %T, not a %T", v, zero)
	}
	return nil
}

// lastResult is the value of the last attempt when it succeeded (for a retry predicate).
func (a *valueAttempt[T]) lastResult() any {
	if a.ok {
		return a.val
	}
	return nil
}

// fallbackChecker is an attempter that checks the value a fallback returns.
type fallbackChecker interface {
	checkFallback(v any) error
}

func (a *valueAttempt[T]) attempt(e *Engine, ctx context.Context, timeout time.Duration) (Outcome, error) {
	return funcAttempt(func(ctx context.Context) error {
		v, err := a.fn(ctx)
		a.ok = err == nil
		if a.ok {
			a.val = v
		}
		return err
	}).attempt(e, ctx, timeout)
}

// Classify maps the error of an attempt run under actx to an outcome, by the
// table of docs/hosts.md (section 6). It only says what happened; the policy
// decides what to do about it:
//   - nil: success;
//   - an OutcomeError: its outcome;
//   - actx's deadline passed (the attempt timeout): timeout;
//   - the server's certificate failed verification: error-class "tls-certificate";
//   - the connection could not be made (refused, reset, DNS, a connect timeout,
//     a TLS handshake failure): connection-error;
//   - another timeout (a read, a response header wait): timeout;
//   - another network error (reset, broken pipe, unexpected EOF): connection-error;
//   - anything else: error-class, named by ErrorClassOf.
func Classify(actx context.Context, err error) Outcome {
	if err == nil {
		return Outcome{Kind: OutcomeSuccess}
	}
	var oe OutcomeError
	if errors.As(err, &oe) {
		return oe.LeveeOutcome()
	}
	if actx != nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
		return Outcome{Kind: OutcomeTimeout}
	}
	if isCertificateError(err) {
		return Outcome{Kind: OutcomeErrorClass, Text: cHttpTlsCertificateClass}
	}
	var opErr *net.OpError
	var dnsErr *net.DNSError
	var recErr tls.RecordHeaderError
	var alert tls.AlertError
	if (errors.As(err, &opErr) && opErr.Op == "dial") || errors.As(err, &dnsErr) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.As(err, &recErr) || errors.As(err, &alert) {
		return Outcome{Kind: OutcomeConnectionError}
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return Outcome{Kind: OutcomeTimeout}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return Outcome{Kind: OutcomeTimeout}
	}
	if opErr != nil || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) {
		return Outcome{Kind: OutcomeConnectionError}
	}
	return Outcome{Kind: OutcomeErrorClass, Text: ErrorClassOf(err)}
}

func isCertificateError(err error) bool {
	var cv *tls.CertificateVerificationError
	var ua x509.UnknownAuthorityError
	var he x509.HostnameError
	var ci x509.CertificateInvalidError
	return errors.As(err, &cv) || errors.As(err, &ua) || errors.As(err, &he) || errors.As(err, &ci)
}

// ErrorClassOf is the class name of an error, by the naming rule of docs/hosts.md:
// the LeveeClass() of the first error in the chain that has one; else the
// dynamic type of the error, skipping fmt.Errorf's wrappers, without package or
// `*` (*fs.PathError is "PathError"; errors.New values are "errorString", so
// give them a class). An empty name, or one not UTF-8, is "Error".
func ErrorClassOf(err error) string {
	type classer interface{ LeveeClass() string }
	var c classer
	if errors.As(err, &c) {
		return validClass(c.LeveeClass())
	}
	for e := err; e != nil; {
		t := reflect.TypeOf(e)
		if s := t.String(); s != "*fmt.wrapError" && s != "*fmt.wrapErrors" {
			return typeClass(t)
		}
		u, ok := e.(interface{ Unwrap() error })
		if !ok {
			return typeClass(t)
		}
		e = u.Unwrap()
	}
	return cHttpUnnamedErrorClass
}

func typeClass(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	name := t.Name()
	if i := strings.IndexByte(name, '['); i >= 0 {
		name = name[:i] // generics stripped
	}
	return validClass(name)
}

func validClass(s string) string {
	if s == "" || !utf8.ValidString(s) {
		return cHttpUnnamedErrorClass
	}
	return s
}

var (
	errNilPolicy = nilArg("the policy is nil (get one with Engine.Policy)")
	errNilFn     = nilArg("fn, the function to run, is nil")
	errNilCtx    = nilArg("ctx is nil (use context.Background())")
)

// startCall starts a call, settling a held-back success on the same crossing,
// and starts its driver d at the reading the call starts at; act is the
// driver's action for the verdict (decided under the lock: see decideLocked).
func (e *Engine) startCall(cctx context.Context, ref callRef, flags uint32, d *driver, info *PolicyInfo) (act action, v Verdict, gen uint64, err error) {
	*d = newDriver(info, 0) // outside the lock; begin sets the start
	e.mu.Lock()
	if err = e.readyLocked(true); err != nil {
		gen = e.gen
		d.begin(e.Now())
		e.unlockEmitCtx(cctx)
		return act, 0, gen, err
	}
	e.takePendingLocked()
	gen = e.gen
	h := e.hold
	e.hold = heldSuccess{}
	now := e.Now()
	d.begin(now)
	ctx := e.enterAt(now) // one clock reading serves the call's start and the bound
	if ref.key != "" {
		e.keyedCalls++
	}
	call, index, key := ref.call, ref.policy, ref.key
	if e.inject != nil {
		v, err = e.injected(cctx, call, opStart, func() (Verdict, error) {
			return e.in.start(ctx, e.rep, call, index, key, flags, now, h.call, h.at, h.elapsed)
		})
	} else {
		v, err = e.in.start(ctx, e.rep, call, index, key, flags, now, h.call, h.at, h.elapsed)
	}
	e.leave()
	if err != nil {
		err = e.faultLocked(err)
		e.tagFaultLocked(ref)
	} else {
		act = e.decideLocked(cctx, d, v, now, ref)
		if v.WakesPending() {
			e.wakesLocked() // after the park: the verdict may name the call it queued
		}
		if e.o.snapEvery > 0 && e.in != nil && now-e.snapAt >= uint64(e.o.snapEvery) {
			e.snapshotLocked(now)
		}
	}
	e.unlockEmitCtx(cctx)
	return act, v, gen, err
}

// decideLocked asks the driver what verdict v (asked at now) means, under the
// lock of the crossing that gave it: a verdict the host refuses (docs/hosts.md,
// section 3) loses the events of its crossing, and a contract breach
// re-instantiates the engine before any other goroutine crosses; otherwise the
// events the verdict says are pending are drained under the same lock, so no
// other goroutine's trap can come between a breaker transition and its snapshot.
func (e *Engine) decideLocked(cctx context.Context, d *driver, v Verdict, now uint64, ref callRef) action {
	act := d.next(v, now)
	if act.kind == actSleep && !act.retry && act.reason == ReasonBulkheadFull {
		act.park = e.parkLocked(cctx, ref) // queued: parked in this crossing, so no wake-up is lost
	}
	if act.kind == actRecover {
		switch act.fault {
		case faultContract:
			_ = e.faultKindLocked(fmt.Errorf("call %d, %v: a verdict broke the contract: %w", ref.call, d.op, act.breach), faultContract)
			e.tagFaultLocked(ref)
		case faultInvalid:
			if v.EventsPending() && e.in != nil {
				gctx := e.enter()
				_, err := e.in.drainEvents(gctx, e.rep) // the refused crossing's events are lost
				e.leave()
				if err != nil {
					_ = e.faultLocked(err)
				}
			}
			e.queued = append(e.queued, Event{At: e.Now(), Kind: EventEngineFault, Fault: faultInvalid.String(),
				Call: ref.call, Policy: ref.policy, Key: ref.key,
				Err: fmt.Errorf("%w: call %d, %v: %w", ErrEngineFault, ref.call, d.op, act.breach)})
		}
		return act
	}
	if v.EventsPending() {
		e.drainLocked()
	}
	return act
}

func (e *Engine) snapshotLocked(now uint64) {
	if e.in == nil {
		return
	}
	// The recovery snapshot is export-snapshot: only the keys that hold protection, so
	// its cost follows them, not the size of the key table. It is bounded as
	// export-state is (it may walk no more than the whole state), and it leaves the
	// measure of the whole state (stateBytes, keyedCalls) alone: a snapshot is smaller
	// than the state the next export-state walks.
	ctx := e.enterWork(e.stateWork())
	b, err := e.in.exportSnapshot(ctx, e.rep)
	e.leave()
	if err != nil {
		_ = e.faultLocked(err)
		return
	}
	e.snap, e.snapAt = b, now
}

// step is a crossing of a call Do drives, asked at now; act is the driver's
// action for its verdict (decideLocked).
func (e *Engine) step(cctx context.Context, ref callRef, op crossing, d *driver, now uint64,
	f func(ctx context.Context, in *instance) (Verdict, error)) (act action, v Verdict, err error) {
	e.mu.Lock()
	defer e.unlockEmitCtx(cctx)
	if err := e.readyLocked(false); err != nil {
		return act, 0, err
	}
	ctx := e.enter()
	if e.inject != nil {
		in := e.in
		v, err = e.injected(cctx, ref.call, op, func() (Verdict, error) { return f(ctx, in) })
	} else {
		v, err = f(ctx, e.in)
	}
	e.leave()
	if err != nil {
		err = e.faultLocked(err)
		e.tagFaultLocked(ref)
		return act, 0, err
	}
	act = e.decideLocked(cctx, d, v, now, ref)
	if v.WakesPending() {
		// a slot freed (the report's) went to the oldest waiter; taken after this
		// crossing's own park, since the verdict that queues a call may name it
		e.wakesLocked()
	}
	return act, v, nil
}

// callRef names the call a crossing belongs to, for the engine-fault it may cause.
type callRef struct {
	call   uint64
	policy uint32
	key    string
}

// tagFaultLocked makes the engine-fault just queued the call's (levee.call,
// levee.policy, levee.key of docs/telemetry.md).
func (e *Engine) tagFaultLocked(ref callRef) {
	if n := len(e.queued); n > 0 && e.queued[n-1].Kind == EventEngineFault && e.queued[n-1].Call == 0 {
		e.queued[n-1].Call, e.queued[n-1].Policy, e.queued[n-1].Key = ref.call, ref.policy, ref.key
	}
}

// injected runs a crossing under the test seam (export_test.go): the hook may
// make it trap, or replace its verdict (a verdict that breaks the contract).
func (e *Engine) injected(cctx context.Context, call uint64, op crossing, f func() (Verdict, error)) (Verdict, error) {
	trap, verdict, replace := e.inject(cctx, call, op.String())
	if trap {
		return 0, trapf("injected trap on %v of call %d", op, call)
	}
	v, err := f()
	if err == nil && replace {
		return Verdict(verdict) | v&cVerdictEventsBit, nil
	}
	return v, err
}

// holdSuccess holds back the report of a success, to be settled by the next
// start. It only appends to the pending list (under pmu, held for the append):
// at thousands of calls in flight, taking the engine's lock a second time per
// call, behind other goroutines' guest calls, cost more than the guest calls.
// The next start, or any other operation, moves the list into the core under
// the engine's lock (takePendingLocked), in the order the calls finished.
func (e *Engine) holdSuccess(cctx context.Context, ref callRef, at, elapsed, gen uint64) {
	e.pmu.Lock()
	e.pending = append(e.pending, pendingSuccess{heldSuccess{call: ref.call, at: at, elapsed: elapsed,
		policy: ref.policy, key: ref.key}, gen})
	e.pmu.Unlock()
	if e.nParked.Load() > 0 {
		// calls wait in a bulkhead queue: the slot this success frees must not wait for the next start
		_ = e.FlushContext(cctx)
	}
}

type pendingSuccess struct {
	heldSuccess
	gen uint64 // the engine generation the call ran in; a later one drops it
}

// takePendingLocked moves the pending successes into the core: each but the
// last is reported, the last stays held for the next start to settle. A
// success from an instance since replaced (a fault) is dropped, as its call
// is gone with that instance.
func (e *Engine) takePendingLocked() {
	e.pmu.Lock()
	p := e.pending
	e.pending = e.spare[:0]
	e.pmu.Unlock()
	for _, s := range p {
		if s.gen != e.gen || e.closed || e.in == nil {
			continue
		}
		if e.hold.call != 0 && e.sendHeldLocked() != nil {
			continue // the fault re-instantiated the engine (gen moved on)
		}
		e.hold = s.heldSuccess
	}
	clear(p) // nothing to keep alive; the buffer is reused
	e.spare = p[:0]
}

// sendHeldLocked reports the held-back success, if any.
func (e *Engine) sendHeldLocked() error {
	if e.hold.call == 0 || e.in == nil {
		return nil
	}
	h := e.hold
	e.hold = heldSuccess{}
	ctx := e.enter()
	v, err := e.in.report(ctx, e.rep, h.call, h.at, h.elapsed, OutcomeSuccess, 0, "", 0, 0)
	e.leave()
	if err != nil {
		return e.faultLocked(err)
	}
	if v.Kind() != VerdictDone {
		return e.faultLocked(trapf("a held-back success was answered %v", v))
	}
	if v.WakesPending() {
		e.wakesLocked()
	}
	if v.EventsPending() {
		// drained under the lock, so a breaker transition is snapshotted before any other
		// goroutine's trap could restore an older state (docs/architecture.md)
		e.drainLocked()
	}
	return nil
}

// Flush sends a held-back success report now (Do holds one back to settle it on
// the next call) and delivers the events it caused.
func (e *Engine) Flush() error { return e.FlushContext(context.Background()) }

// FlushContext is Flush delivering the events with ctx (to the telemetry sink
// and the logger): the context of the call whose success was held back, say.
func (e *Engine) FlushContext(ctx context.Context) error {
	e.mu.Lock()
	err := e.readyLocked(false)
	if err == nil {
		e.drainLocked()
	}
	e.unlockEmitCtx(ctx)
	return err
}

func (e *Engine) emit(ctx context.Context, evs []Event) {
	if t := e.o.tel; t != nil {
		for i := range evs {
			e.observe(ctx, "a telemetry sink", evs[i].Kind, func() { e.telEvent(ctx, t, &evs[i]) })
		}
	}
	for _, ev := range evs {
		for _, l := range e.o.listeners {
			e.observe(ctx, "a listener", ev.Kind, func() { l(ev) })
		}
		if lg := e.o.logger; lg != nil {
			level := slog.LevelInfo
			switch ev.Kind {
			case EventEngineFault, EventGaveUp, EventRejected:
				level = slog.LevelWarn
			}
			attrs := []slog.Attr{slog.String("kind", ev.Kind.String()), slog.Uint64("at", ev.At),
				slog.String("policy", e.policyName(ev.Policy)), slog.Uint64("call", ev.Call)}
			if ev.Key != "" {
				attrs = append(attrs, slog.String("key", ev.Key))
			}
			if ev.Attempt != 0 {
				attrs = append(attrs, slog.Uint64("attempt", uint64(ev.Attempt)))
			}
			if ev.Reason != ReasonNone {
				attrs = append(attrs, slog.String("reason", ev.Reason.String()))
			}
			if ev.Duration != 0 {
				attrs = append(attrs, slog.Duration("duration", time.Duration(ev.Duration)))
			}
			if ev.Kind == EventBreakerTransition {
				attrs = append(attrs, slog.String("from", ev.StateFrom.String()), slog.String("to", ev.StateTo.String()))
			}
			if ev.Name != "" {
				attrs = append(attrs, slog.String("name", ev.Name))
			}
			if ev.Value != 0 {
				attrs = append(attrs, slog.Int64("value", ev.Value))
			}
			if ev.Err != nil {
				attrs = append(attrs, slog.String("error", ev.Err.Error()))
			}
			lg.LogAttrs(ctx, level, "levee "+ev.Kind.String(), attrs...)
		}
	}
}

// observe runs observer code (a listener, the telemetry sink) for an event of kind k: a
// panic is logged and ignored, so observer code never reaches the call (docs/hosts.md).
func (e *Engine) observe(ctx context.Context, who string, k EventKind, f func()) {
	defer func() {
		if r := recover(); r != nil && e.o.logger != nil {
			e.o.logger.LogAttrs(ctx, slog.LevelWarn, "levee: "+who+" panicked (ignored)",
				slog.String("event", k.String()), slog.String("panic", fmt.Sprint(r)))
		}
	}()
	f()
}

func (e *Engine) policyName(i uint32) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if int(i) < len(e.infos) {
		return e.infos[i].Name
	}
	return fmt.Sprint(i)
}

// fallback is the fallback of name for a call whose result is of type rt (nil: Do's,
// which has none): the call's own, else the engine's typed for rt, else the engine's
// untyped one. When none fits but the engine has typed ones of that name for other result
// types, the error says so (the call counts it as a fallback that failed).
func (e *Engine) fallback(name string, co *callOpts, rt reflect.Type) (Fallback, error) {
	if f, ok := co.fallbacks[name]; ok {
		return f, nil
	}
	e.fbMu.RLock()
	defer e.fbMu.RUnlock()
	if rt != nil {
		if f := e.tfbs[fbKey{name, rt}]; f != nil {
			return f, nil
		}
	}
	if f := e.fbs[name]; f != nil {
		return f, nil
	}
	var types []string
	for k := range e.tfbs {
		if k.name == name {
			types = append(types, k.t.String())
		}
	}
	if len(types) == 0 {
		return nil, nil
	}
	slices.Sort(types)
	return nil, &fallbackTypeError{name: name, result: rt, registered: types}
}

// fallbackTypeError is the failure of a fallback registered only for other result types.
type fallbackTypeError struct {
	name       string
	result     reflect.Type
	registered []string
}

func (e *fallbackTypeError) Error() string {
	call := "a call without a result (Do)"
	if e.result != nil {
		call = e.result.String()
	}
	return fmt.Sprintf("levee: fallback '%s' is registered for %s, not for %s", e.name, strings.Join(e.registered, ", "), call)
}

// resultTyper is an attempter whose calls have a result type (DoValue's T, the Transport's
// *http.Response); a call of Do has none.
type resultTyper interface {
	resultType() reflect.Type
}

func resultTypeOf(a attempter) reflect.Type {
	if rt, ok := a.(resultTyper); ok {
		return rt.resultType()
	}
	return nil
}

func (c *callRun) ref() callRef { return callRef{c.call, c.st.index, c.co.key} }

// run drives one call through the step protocol. If the function (or a
// fallback) panics, the call is cancelled in the core and the panic goes on.
func (p *Policy) run(ctx context.Context, a attempter, opts []CallOption) (fbVal any, fbUsed bool, err error) {
	if p == nil {
		return nil, false, errNilPolicy
	}
	if ctx == nil {
		return nil, false, errNilCtx
	}
	var co callOpts
	for i := range opts {
		opts[i].apply(&co)
	}
	for name, f := range co.fallbacks {
		if f == nil {
			return nil, false, nilArg(fmt.Sprintf("the call's fallback %q is nil (WithCallFallback, Typed.Fallback)", name))
		}
	}
	st := p.st.Load()
	if !st.ok {
		return nil, false, fmt.Errorf("levee: policy %q is gone after a reload", p.name)
	}
	if err := CheckKey(co.key); err != nil {
		return nil, false, err
	}
	if err := ctx.Err(); err != nil {
		return nil, false, &Error{Policy: p.name, Reason: ReasonCancelled, Ctx: err}
	}
	call := p.e.nextCall.Add(1)
	c := callRun{p: p, a: a, co: co, st: st, call: call}
	defer func() {
		if !c.finished {
			_ = p.e.cancelIn(context.Background(), call)
			c.tel.end(cResults[3], c.d.attempts > 1, ReasonCancelled, errPanicked)
		}
	}()
	ctx, c.tel = p.e.startCallTel(ctx, p.name, co.key, co.http)
	c.ctx = ctx
	fbVal, fbUsed, err = c.steps(ctx)
	c.finished = true
	return fbVal, fbUsed, err
}

var errPanicked = errors.New("levee: the call panicked")

// callRun is one call in progress: the glue between the driver (driver.go), the
// attempter (the caller's function, or an HTTP request) and the engine's crossings.
type callRun struct {
	p        *Policy
	a        attempter
	co       callOpts // a copy: a pointer to the caller's would escape with c's content
	st       *policyState
	call     uint64
	d        driver
	ctx      context.Context // the call's (with its span), for cancel's events
	tel      *callTel
	finished bool
	lastErr  error
	fbErr    error
	fbVal    any
	fbUsed   bool
	unreg    []string
	fbUnreg  bool // the last fallback chosen had no function registered
}

// fail builds the typed error of a reason.
func (c *callRun) fail(reason Reason, retryAfter time.Duration, ctxErr error) error {
	return &Error{Policy: c.p.name, Reason: reason, Attempts: c.d.attempts, RetryAfter: retryAfter, Last: c.lastErr,
		FallbackErr: c.fbErr, Unregistered: c.unreg, Ctx: ctxErr}
}

// cancelCall abandons the call in the core, its events delivered with the call's context.
func (c *callRun) cancelCall(ctx context.Context) {
	e := c.p.e
	_ = e.cancelIn(ctx, c.call)
}

func (c *callRun) cancelled(cerr error) (any, bool, error) {
	c.cancelCall(c.ctx)
	c.tel.end(cResults[3], c.d.attempts > 1, ReasonCancelled, cerr)
	return nil, false, c.fail(ReasonCancelled, 0, cerr)
}

// steps performs the driver's actions until the call ends.
func (c *callRun) steps(ctx context.Context) (any, bool, error) {
	e, a, call := c.p.e, c.a, c.call
	info := &c.st.info
	d := &c.d
	act, v, gen, ferr := e.startCall(ctx, c.ref(), c.co.flags, d, info)
	if ferr != nil && errors.Is(ferr, ErrClosed) {
		return nil, false, ferr
	}
	start := d.start
	now := start // the reading the verdict in hand was asked at
	tr := e.o.trace
	if tr != nil && ferr == nil {
		tr(Step{Op: "start", Call: call, Now: start, Verdict: v})
	}
	for {
		if ferr != nil {
			act = d.crossingFailed(e.Now())
			ferr = nil
		}
		switch act.kind {
		case actAttempt:
			// The attempt runs from the reading the verdict was asked at (one
			// clock reading fewer; the crossing, well under a microsecond, counts
			// toward its elapsed time).
			t0 := now
			actx, span := c.tel.attemptSpan(ctx, act.n, false)
			o, aerr := a.attempt(e, actx, act.d)
			t1 := e.Now()
			now = t1
			c.tel.endAttemptSpan(span, o, aerr)
			if cerr := ctx.Err(); cerr != nil {
				c.lastErr = aerr
				return c.cancelled(cerr)
			}
			elapsed := t1 - t0
			var caller uint32 // the retry predicate's answer, a report flag
			if c.co.retryIf != nil || e.o.retryIf != nil {
				caller = c.askPredicate(aerr)
			}
			if o.Kind == OutcomeSuccess && caller&cReportCallerRetry == 0 && (act.d == 0 || time.Duration(elapsed) < act.d) {
				// held back to settle on the next start (a late success is the core's to judge)
				if tr != nil {
					tr(Step{Op: "hold-success", Call: call, Now: t1, Outcome: o})
				}
				e.holdSuccess(ctx, c.ref(), t1, elapsed, gen)
				c.tel.reported(o.Kind, elapsed)
				c.tel.end(cResults[0], act.n > 1, ReasonNone, nil)
				return nil, false, nil
			}
			if o.Kind == OutcomeTimeout && act.d > 0 && time.Duration(elapsed) > act.d {
				elapsed = uint64(act.d) // the timeout fired: the attempt lasted its timeout
			}
			c.lastErr = aerr
			flags := caller
			if o.Overloaded {
				flags |= cReportOverloaded
			}
			var wall uint64
			if o.Kind == OutcomeHTTPStatus && o.Text != "" {
				wall = e.wallSecs()
			}
			text := strings.ToValidUTF8(o.Text, "\uFFFD") // a raw header: the core says what it means
			act, v, ferr = e.step(ctx, c.ref(), opReport, d, t1, func(ctx context.Context, in *instance) (Verdict, error) {
				return in.report(ctx, e.rep, call, t1, elapsed, o.Kind, o.Code, text, wall, flags)
			})
			if ferr == nil { // a report that trapped never reached the core
				c.tel.reported(o.Kind, elapsed)
			}
			if tr != nil && ferr == nil {
				tr(Step{Op: "report", Call: call, Now: t1, Outcome: o, Verdict: v})
			}
		case actSleep:
			if act.retry {
				c.onRetry(act.d)
				if rp, ok := a.(retryPreparer); ok {
					if err := rp.prepareRetry(); err != nil {
						// the operation cannot be sent again (GetBody failed): that is this call's end
						c.cancelCall(ctx)
						c.tel.end(cResults[2], d.attempts > 1, ReasonNone, err)
						return nil, false, err
					}
				}
			}
			if act.park != nil {
				if cerr := e.parkSleep(ctx, act.park, act.d); cerr != nil {
					return c.cancelled(cerr)
				}
			} else if cerr := e.sleep(ctx, act.d); cerr != nil {
				return c.cancelled(cerr)
			}
			now = e.Now()
			at := now
			act, v, ferr = e.step(ctx, c.ref(), opAcquire, d, at, func(ctx context.Context, in *instance) (Verdict, error) {
				return in.acquire(ctx, e.rep, call, at)
			})
			if tr != nil && ferr == nil {
				tr(Step{Op: "acquire", Call: call, Now: now, Verdict: v})
			}
		case actFallback:
			ok := false
			c.fbUnreg = false
			f, mistyped := e.fallback(act.name, &c.co, resultTypeOf(a))
			if f != nil {
				fctx := context.WithValue(ctx, fallbackKey{}, FallbackInfo{Policy: c.p.name, Name: act.name,
					Reason: act.reason, Attempts: d.attempts, Err: c.lastErr})
				val, err := f(fctx, c.lastErr)
				if fc, isFC := a.(fallbackChecker); isFC && err == nil {
					err = fc.checkFallback(val)
				}
				if err == nil {
					ok, c.fbVal, c.fbUsed = true, val, true
				} else {
					c.fbErr = err
				}
			} else if mistyped != nil {
				c.fbErr = mistyped // registered, but not for this call's result: a fallback that failed
			} else {
				c.fbUnreg = true
				if !slices.Contains(c.unreg, act.name) {
					c.unreg = append(c.unreg, act.name)
				}
			}
			if cerr := ctx.Err(); cerr != nil {
				return c.cancelled(cerr)
			}
			now = e.Now()
			at := now
			act, v, ferr = e.step(ctx, c.ref(), opReportFallback, d, at, func(ctx context.Context, in *instance) (Verdict, error) {
				return in.reportFallback(ctx, e.rep, call, at, ok)
			})
			if tr != nil && ferr == nil {
				tr(Step{Op: "report-fallback", Call: call, Now: now, Verdict: v})
			}
		case actDone:
			if c.fbUsed {
				c.tel.end(cResults[1], d.attempts > 1, ReasonNone, nil)
				return c.fbVal, true, nil
			}
			c.tel.end(cResults[0], d.attempts > 1, ReasonNone, nil)
			return nil, false, nil
		case actFail:
			err := c.fail(act.reason, act.d, nil)
			c.tel.end(cResults[2], d.attempts > 1, act.reason, err)
			return nil, false, err
		case actRecover:
			return c.recover(ctx, act)
		case actHedge:
			var final bool
			var val any
			var used bool
			var err error
			if act, final, val, used, err = c.hedge(ctx, act, now); final {
				return val, used, err
			}
			now = e.Now()
			v = 0
		}
	}
}

// recover ends the call on the one recovery path (docs/hosts.md, section 3).
func (c *callRun) recover(ctx context.Context, act action) (any, bool, error) {
	e, d := c.p.e, &c.d // the fault is reported (and a contract breach recovered) by decideLocked
	switch act.ending {
	case recoverAttemptResult:
		// the attempt's own result: its value (nil error), or its error as the user's own
		c.tel.end(c.ownResult(c.lastErr), d.attempts > 1, ReasonNone, c.lastErr)
		return nil, false, c.lastErr
	case recoverFallbackResult:
		if c.fbUsed {
			c.tel.end(cResults[1], d.attempts > 1, ReasonNone, nil)
			return c.fbVal, true, nil
		}
		err := c.fbErr
		if c.fbUnreg || err == nil {
			err = &Error{Policy: c.p.name, Reason: ReasonFallbacksFailed, Attempts: d.attempts, Last: c.lastErr, Unregistered: c.unreg}
		}
		c.tel.end(cResults[2], d.attempts > 1, ReasonNone, err)
		return nil, false, err
	case recoverDeadline:
		err := c.fail(ReasonDeadline, 0, nil)
		c.tel.end(cResults[2], d.attempts > 1, ReasonDeadline, err)
		return nil, false, err
	default: // recoverDegraded: exactly one attempt, without the core
		actx, span := c.tel.attemptSpan(context.WithValue(ctx, degradedKey{}, true), act.n, true)
		o, err := c.a.attempt(e, actx, act.d)
		c.tel.endAttemptSpan(span, o, err)
		if cerr := ctx.Err(); cerr != nil {
			c.lastErr = err
			c.tel.end(cResults[3], d.attempts > 0, ReasonCancelled, cerr)
			return nil, false, c.fail(ReasonCancelled, 0, cerr)
		}
		if o.Kind == OutcomeSuccess {
			err = nil // a late success of a degraded attempt is still a success
		}
		c.tel.end(c.ownResult(err), d.attempts > 0, ReasonNone, err)
		return nil, false, err
	}
}

type fallbackKey struct{}

// FallbackInfo is what a fallback is told of its call (docs/hosts.md, section 5).
type FallbackInfo struct {
	Policy, Name string
	// Reason is the core's reason for falling back (the trigger).
	Reason Reason
	// Attempts is the attempts made.
	Attempts int
	// Err is the last attempt's error (the cause argument of the Fallback).
	Err error
}

// FallbackContext returns the FallbackInfo of the fallback running under ctx.
func FallbackContext(ctx context.Context) (FallbackInfo, bool) {
	if ctx == nil {
		return FallbackInfo{}, false
	}
	fi, ok := ctx.Value(fallbackKey{}).(FallbackInfo)
	return fi, ok
}

type degradedKey struct{}

// Degraded says whether the attempt running under ctx is the degraded attempt
// of the recovery path (docs/hosts.md, section 3): the engine failed, and this
// one attempt runs without the policy.
func Degraded(ctx context.Context) bool {
	if ctx == nil {
		return false
	}
	d, _ := ctx.Value(degradedKey{}).(bool)
	return d
}

// ownResult is the levee.result of a call that ends with its attempt's own
// result: a success, or a response of the Transport, is a success.
func (c *callRun) ownResult(err error) string {
	if err == nil {
		return cResults[0]
	}
	if rr, ok := c.a.(interface{ lastResult() any }); ok && rr.lastResult() != nil {
		return cResults[0]
	}
	return cResults[2]
}

// onRetry calls the policy's and the call's retry hooks.
func (c *callRun) onRetry(delay time.Duration) {
	e := c.p.e
	ph := e.o.onRetry[c.p.name]
	if ph == nil && c.co.onRetry == nil {
		return
	}
	ri := RetryInfo{Policy: c.p.name, Key: c.co.key, Attempt: c.d.attempts, Delay: delay, Err: c.lastErr}
	if rr, ok := c.a.(interface{ lastResult() any }); ok {
		if r := rr.lastResult(); r != nil {
			ri.Result, ri.Err = r, nil
		}
	}
	if ph != nil {
		e.callHook(ph, ri)
	}
	if c.co.onRetry != nil {
		e.callHook(c.co.onRetry, ri)
	}
}
