package levee

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
)

// ErrEngineFault is wrapped by every error that comes from the guest failing
// (a trap, a guest call over its time bound, a Canonical ABI violation). The
// engine has already been re-instantiated when such an error is returned.
var ErrEngineFault = errors.New("levee: engine fault")

// ErrClosed is returned by an engine after Close.
var ErrClosed = errors.New("levee: engine closed")

// LoadErrors is the error Load and Reload return for an invalid policy document.
type LoadErrors []LoadError

func (e LoadErrors) Error() string {
	parts := make([]string, len(e))
	for i, le := range e {
		parts[i] = le.Error()
	}
	return "levee: invalid policy document: " + strings.Join(parts, "; ")
}

// Listener receives every event the engine records (and EventEngineFault).
// It is called outside the engine's lock, possibly from many goroutines.
type Listener func(Event)

// Fallback is a fallback registered by name. cause is the error of the last
// attempt (nil if the call was rejected before any attempt). The value is
// returned by DoValue when its type fits; Do ignores it.
type Fallback func(ctx context.Context, cause error) (any, error)

type options struct {
	seed        *uint64
	core        []byte
	callLimit   time.Duration
	perByte     time.Duration // GuestTimePerByte; tests of the bound set 0
	memoryPages uint32
	snapEvery   time.Duration
	listeners   []Listener
	logger      *slog.Logger
	fallbacks   map[string]Fallback
	typedFbs    map[fbKey]Fallback
	trace       func(Step)
	clock       Clock // nil: the machine's clock (the fast path)
	tel         Telemetry
	tracer      Tracer
	noGaugeKey  bool
	onRetry     map[string]func(RetryInfo)
	retryIf     map[string]func(any, error) RetryAnswer
}

// Option configures Load.
type Option func(*options)

// check refuses the nil functions among the options (the error names the option).
func (o *options) check() error {
	for _, l := range o.listeners {
		if l == nil {
			return nilArg("WithListener(nil): the listener is nil")
		}
	}
	names := make([]string, 0, len(o.fallbacks))
	for name, f := range o.fallbacks {
		if f == nil {
			names = append(names, name)
		}
	}
	if len(names) > 0 {
		slices.Sort(names)
		return nilArg(fmt.Sprintf("WithFallback(%q, nil): the fallback is nil", names[0]))
	}
	for k, f := range o.typedFbs {
		if f == nil {
			return nilArg(fmt.Sprintf("WithTypedFallback(%q, nil) for %v: the fallback is nil", k.name, k.t))
		}
	}
	return nil
}

// WithSeed fixes the jitter seed (default: from the OS random source).
func WithSeed(seed uint64) Option { return func(o *options) { o.seed = &seed } }

// WithCoreModule runs these bytes as the core module instead of the embedded one.
func WithCoreModule(wasm []byte) Option { return func(o *options) { o.core = wasm } }

// The bounds on the guest (docs/architecture.md, "Bounds on the guest"), the same in
// every host: a guest call whose work does not depend on the size of anything may run
// DefaultGuestCallLimit; one that walks the document or the state (load, reload,
// export-state, import-state) may run that plus GuestTimePerByte for every byte it
// walks: the document's, and the state's (the size of the last state exported or
// imported, plus StateBytesPerKeyedCall for every keyed call since). The linear
// memory may grow to DefaultMemoryLimitPages.
//
// The values are the GUARDS of wit/constants.json (docs/hosts.md, section 7): one
// unit of guest work is 1 ns here.
const (
	DefaultGuestCallLimit   = cGuardGuestWorkUnits * time.Nanosecond
	GuestTimePerByte        = cGuardGuestWorkUnitsPerByte * time.Nanosecond
	StateBytesPerKeyedCall  = 1024
	DefaultMemoryLimitPages = cGuardGuestMemoryBytes / (64 << 10) // 512 MiB
	DefaultSnapshotInterval = cGuardSnapshotIntervalMs * time.Millisecond
)

// WithGuestCallLimit sets the base bound of every call into the guest (default
// DefaultGuestCallLimit); a call over its bound is interrupted and treated as a trap.
// Calls that walk the document or the state get GuestTimePerByte more for every byte.
// The engine instruments the core module with an interrupt check at every loop head
// (interrupt.go) and runs one watchdog goroutine that sets it, waking every limit/4
// (between 1 ms and 250 ms), so a call is interrupted at most about bound + limit/4
// after it started; Close stops the watchdog. 0 turns the bound off, for a core module
// you trust: no instrumentation, no watchdog, but a guest call cannot be interrupted.
func WithGuestCallLimit(d time.Duration) Option { return func(o *options) { o.callLimit = d } }

// WithMemoryLimitPages bounds the guest's linear memory, in 64 KiB pages (default
// DefaultMemoryLimitPages = 512 MiB).
func WithMemoryLimitPages(pages uint32) Option { return func(o *options) { o.memoryPages = pages } }

// WithSnapshotInterval sets how often (at most) the engine exports its state on the
// hot path, to restore it after a trap (default 1 s; 0 disables the periodic
// snapshots). Whatever the interval, the engine also exports its state whenever a
// breaker changes state, and after SetBreakerState, Reload and ImportState, so that a
// trap never brings back a breaker that was open as closed.
func WithSnapshotInterval(d time.Duration) Option { return func(o *options) { o.snapEvery = d } }

// WithListener adds an event listener.
func WithListener(l Listener) Option {
	return func(o *options) { o.listeners = append(o.listeners, l) }
}

// Step is one exchange of the step protocol, as WithTrace sees it.
type Step struct {
	Op      string // start, acquire, report, report-fallback, hold-success, cancel, hedge-step, report-attempt
	Call    uint64
	Now     uint64
	Outcome Outcome // for report and report-attempt
	Verdict Verdict // the core's answer (0 for hold-success, cancel, hedge-step and report-attempt)
	// Attempt is the attempt a report-attempt reports.
	Attempt int
	// Commands is the answer of hedge-step and report-attempt.
	Commands []HedgeCommand
}

// WithTrace calls f after every step of Do and the Transport (for demos and debugging).
func WithTrace(f func(Step)) Option { return func(o *options) { o.trace = f } }

// WithLogger logs every event to l (at Info; faults, rejections and give-ups at Warn).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithFallback registers a fallback under the name a policy's fallback chain uses.
func WithFallback(name string, f Fallback) Option {
	return func(o *options) {
		if o.fallbacks == nil {
			o.fallbacks = map[string]Fallback{}
		}
		o.fallbacks[name] = f
	}
}

// WithTypedFallback registers a fallback under the name a policy's fallback chain uses,
// for the calls whose result is a T (see RegisterTypedFallback).
func WithTypedFallback[T any](name string, f TypedFallback[T]) Option {
	return func(o *options) {
		if o.typedFbs == nil {
			o.typedFbs = map[fbKey]Fallback{}
		}
		o.typedFbs[fbKey{name, reflect.TypeFor[T]()}] = f.untyped()
	}
}

// Engine is one policy engine (policies plus their breaker, budget and limiter
// state) running in one guest instance. It is safe for use by many goroutines:
// guest calls are serialized by a mutex.
type Engine struct {
	o     options
	seed  uint64
	epoch time.Time // real time at Load: the watchdog's origin, and Now's without WithClock
	// vepoch is the injected clock's reading at Load (Now's origin with WithClock)
	vepoch time.Time

	mu      sync.Mutex
	doc     string
	rt      wazero.Runtime
	cm      wazero.CompiledModule
	adapter wazero.CompiledModule
	table   *handleTable
	xtable  *handleTable
	in      *instance // nil while the engine could not be re-instantiated
	rep     uint32
	gen     uint64
	closed  bool
	hold    heldSuccess
	// the calls parked in bulkhead queues (park.go), under mu, and how many
	// (written under mu, read without it by holdSuccess)
	parked  map[uint64]*parker
	nParked atomic.Int64
	// wakes taken for Do that name calls not parked here (the raw API's calls),
	// kept for TakeWakes in grant order, at most maxUnclaimedWakes (park.go)
	unclaimed []uint64
	// successes held back by finished calls, not yet moved to hold (see holdSuccess);
	// under pmu alone, so a finishing call never waits behind a guest call
	pmu     sync.Mutex
	pending []pendingSuccess
	spare   []pendingSuccess // pending's other buffer, swapped in by takePendingLocked
	// when the engine last re-instantiated after a fault (0: never)
	lastRecovery uint64
	snap         []byte
	snapAt       uint64
	// the size of the state the instance holds, for the bounds of slow calls: the last
	// state exported or imported, and the keyed calls since (each may add a key)
	stateBytes int
	keyedCalls int
	infos      []PolicyInfo
	policies   map[string]*Policy
	// events drained (and faults recorded) under the lock, delivered by unlockEmit
	queued []Event

	// bounding of guest calls (see watch)
	watch *watch
	// the start (engine ns) of the last guest call, to keep starts distinct
	lastStart int64

	// inject is the test seam of conformance/hosts (export_test.go): nil in use
	inject func(ctx context.Context, call uint64, op string) (trap bool, verdict uint64, replace bool)
	// injectHedge may replace the answer of a hedged call's crossing (export_test.go); nil in use
	injectHedge func(ctx context.Context, call uint64, op string, a HedgeAnswer) HedgeAnswer
	// hedgeSeam follows the goroutines of hedged calls for the host scenarios (hedge.go); nil in use
	hedgeSeam *hedgeSeam

	nextCall atomic.Uint64
	fbMu     sync.RWMutex
	fbs      map[string]Fallback
	tfbs     map[fbKey]Fallback // the typed fallbacks, by name and result type
}

type heldSuccess struct {
	call, at, elapsed uint64
	policy            uint32 // the call's queue, woken when the success is applied
	key               string
}

// watch bounds guest calls: one goroutine per engine (started by Load, stopped by
// Close) wakes every tick and, when the guest call in progress started more than
// limit ago, sets the interrupt global of its instance (interrupt.go), so the
// call traps at its next loop head. A guest call costs two atomic stores.
type watch struct {
	epoch time.Time
	limit int64
	// the bound of the guest call in progress (limit, or more for a slow call)
	bound atomic.Int64
	tick  time.Duration
	// the start (ns since epoch, > 0) of the guest call in progress; 0 when
	// none is; -1 once the watchdog interrupted it
	start atomic.Int64
	// the interrupt global of the current instance
	intr  atomic.Pointer[api.MutableGlobal]
	fired atomic.Bool
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
}

func newWatch(epoch time.Time, limit time.Duration) *watch {
	tick := min(max(limit/4, time.Millisecond), 250*time.Millisecond)
	w := &watch{epoch: epoch, limit: int64(limit), tick: tick, stop: make(chan struct{}), done: make(chan struct{})}
	w.bound.Store(int64(limit))
	go w.run()
	return w
}

func (w *watch) run() {
	defer close(w.done)
	t := time.NewTicker(w.tick)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		s := w.start.Load()
		if s <= 0 || int64(time.Since(w.epoch))-s <= w.bound.Load() {
			continue
		}
		// The instance is read after the start it belongs to (the engine sets it
		// before the call), and is the call's own if the call is still in progress
		// at the swap: instances are replaced only between guest calls.
		g := w.intr.Load()
		if w.start.CompareAndSwap(s, -1) {
			w.fired.Store(true)
			if g != nil {
				(*g).Set(1)
			}
		}
	}
}

func (w *watch) close() {
	w.once.Do(func() { close(w.stop) })
	<-w.done
}

// Load parses, validates and fills defaults of a policy document (YAML or JSON)
// in a new engine. An invalid document gives a LoadErrors error.
func Load(ctx context.Context, document string, opts ...Option) (*Engine, error) {
	if ctx == nil {
		return nil, nilArg("Load: ctx is nil (use context.Background())")
	}
	e := &Engine{o: options{callLimit: DefaultGuestCallLimit, perByte: GuestTimePerByte, memoryPages: DefaultMemoryLimitPages,
		snapEvery: DefaultSnapshotInterval},
		doc: document, epoch: time.Now()}
	for _, opt := range opts {
		if opt == nil {
			return nil, nilArg("Load: an Option is nil")
		}
		opt(&e.o)
	}
	if err := e.o.check(); err != nil {
		return nil, err
	}
	if err := documentUTF8(document); err != nil {
		return nil, err
	}
	if e.o.seed != nil {
		e.seed = *e.o.seed
	} else {
		var b [8]byte
		_, _ = rand.Read(b[:])
		e.seed = binary.LittleEndian.Uint64(b[:])
	}
	e.fbs = map[string]Fallback{}
	for k, v := range e.o.fallbacks {
		e.fbs[k] = v
	}
	e.tfbs = map[fbKey]Fallback{}
	for k, v := range e.o.typedFbs {
		e.tfbs[k] = v
	}
	wasm := e.o.core
	if wasm == nil {
		wasm = embeddedCore
	}
	if len(wasm) == 0 {
		return nil, errors.New("levee: no core module: this build has none embedded (built with -tags levee_noembed: pass WithCoreModule)")
	}
	if e.o.callLimit > 0 {
		var err error
		if wasm, err = instrumentInterrupt(wasm); err != nil {
			return nil, err
		}
	}
	cm, adapter, err := e.compileModules(ctx, wasm)
	if err != nil {
		_ = e.rt.Close(ctx)
		return nil, err
	}
	if err := checkModule(cm); err != nil {
		_ = e.rt.Close(ctx)
		return nil, err
	}
	e.cm, e.adapter = cm, adapter
	e.table, e.xtable = &handleTable{}, &handleTable{resource: "executor"}
	if err := defineResourceImports(ctx, e.rt, e.table, e.xtable); err != nil {
		_ = e.rt.Close(ctx)
		return nil, err
	}
	e.epoch = time.Now() // the clock starts once the module is compiled
	if e.o.clock != nil {
		e.vepoch = e.o.clock.Now()
	}
	if e.o.callLimit > 0 {
		e.watch = newWatch(e.epoch, e.o.callLimit)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	lerrs, err := e.instantiateLocked()
	if err != nil || lerrs != nil {
		e.closeLocked(ctx)
		if err != nil {
			return nil, err
		}
		return nil, LoadErrors(lerrs)
	}
	return e, nil
}

// enter starts the guest-call bound and returns the context guest calls run
// under (one without Done, so wazero starts no goroutine).
func (e *Engine) enter() context.Context {
	if e.watch != nil {
		return e.enterAt(uint64(time.Since(e.epoch)))
	}
	return context.Background()
}

// enterAt is enter with a reading of the clock the caller has just taken (the
// engine's Now; with an injected clock, the watchdog reads real time itself).
func (e *Engine) enterAt(now uint64) context.Context {
	if w := e.watch; w != nil {
		if e.o.clock != nil {
			now = uint64(time.Since(e.epoch))
		}
		s := max(int64(now), e.lastStart+1)
		e.lastStart = s
		w.start.Store(s)
	}
	return context.Background()
}

// enterWork is enter for a guest call that walks bytes of document or state: its
// bound grows by GuestTimePerByte a byte.
func (e *Engine) enterWork(bytes int) context.Context {
	if w := e.watch; w != nil {
		w.bound.Store(w.limit + int64(e.o.perByte)*int64(max(bytes, 0)))
	}
	return e.enter()
}

// stateWork is the bytes of state a call that walks the whole state may walk.
func (e *Engine) stateWork() int { return e.stateBytes + StateBytesPerKeyedCall*e.keyedCalls }

func (e *Engine) leave() {
	if w := e.watch; w != nil {
		w.start.Store(0)
		if w.bound.Load() != w.limit {
			w.bound.Store(w.limit)
		}
	}
}

// setInstanceLocked makes in the current instance (nil: none).
func (e *Engine) setInstanceLocked(in *instance) {
	e.in = in
	e.setIntr(in)
}

// setIntr points the watchdog at in's interrupt global; only between guest calls.
func (e *Engine) setIntr(in *instance) {
	if e.watch == nil {
		return
	}
	if in != nil && in.interrupt != nil {
		e.watch.intr.Store(&in.interrupt)
	} else {
		e.watch.intr.Store(nil)
	}
}

// instantiateLocked makes a fresh instance and loads the document into it.
func (e *Engine) instantiateLocked() ([]LoadError, error) {
	ctx := e.enter()
	defer e.leave()
	in, err := newInstance(ctx, e.rt, e.cm, e.adapter, e.table, e.xtable)
	if err != nil {
		return nil, fmt.Errorf("%w: instantiate: %w", ErrEngineFault, err)
	}
	// the watchdog interrupts the new instance from now on
	e.leave()
	e.setIntr(in)
	ctx = e.enterWork(len(e.doc))
	rep, lerrs, err := in.load(ctx, e.doc, e.seed)
	e.leave()
	ctx = e.enter()
	if err != nil {
		in.close(context.Background())
		return nil, fmt.Errorf("%w: load: %w", ErrEngineFault, err)
	}
	if lerrs != nil {
		in.close(context.Background())
		return lerrs, nil
	}
	e.setInstanceLocked(in)
	e.rep = rep
	e.stateBytes, e.keyedCalls = 0, 0
	if err := e.refreshInfosLocked(ctx); err != nil {
		e.setInstanceLocked(nil)
		in.close(context.Background())
		return nil, fmt.Errorf("%w: %w", ErrEngineFault, err)
	}
	return nil, nil
}

func (e *Engine) refreshInfosLocked(ctx context.Context) error {
	n, err := e.in.policyCount(ctx, e.rep)
	if err != nil {
		return err
	}
	infos := make([]PolicyInfo, n)
	for i := range infos {
		info, ok, err := e.in.policyInfo(ctx, e.rep, uint32(i))
		if err != nil {
			return err
		}
		if !ok {
			return trapf("policy-info(%d) is none for an index below policy-count %d", i, n)
		}
		infos[i] = info
	}
	e.infos = infos
	for name, p := range e.policies {
		p.info, p.ok = PolicyInfo{}, false
		for i, info := range infos {
			if info.Name == name {
				p.index, p.info, p.ok = uint32(i), info, true
			}
		}
		p.publish()
	}
	return nil
}

// faultLocked re-instantiates the engine after the guest failed, restores the
// last snapshot of its state, and queues an EventEngineFault.
func (e *Engine) faultLocked(cause error) error { return e.faultKindLocked(cause, faultTrap) }

// faultKindLocked is faultLocked for a trap or a contract breach.
func (e *Engine) faultKindLocked(cause error, kind fault) error {
	if e.in != nil {
		e.in.close(context.Background())
		e.setInstanceLocked(nil)
	}
	if e.watch != nil && e.watch.fired.Swap(false) {
		cause = fmt.Errorf("guest call over its time bound of %v: %w", e.o.callLimit, cause)
	}
	e.gen++
	e.lastRecovery = max(e.Now(), 1)
	e.hold = heldSuccess{}
	e.unclaimed = nil // their calls went with the instance
	ev := Event{At: e.Now(), Kind: EventEngineFault, Fault: kind.String(), Err: cause}
	if _, err := e.instantiateLocked(); err != nil {
		ev.Err = fmt.Errorf("%w; re-instantiation failed: %w", cause, err)
	} else if e.snap != nil {
		ctx := e.enterWork(len(e.snap))
		lerr, err := e.in.importState(ctx, e.rep, e.snap)
		e.leave()
		if err == nil && lerr == nil {
			e.stateBytes = len(e.snap)
		}
		if err != nil || lerr != nil {
			ev.Err = fmt.Errorf("%w; snapshot not restored: %v %v", cause, err, lerr)
			if err != nil {
				e.in.close(context.Background())
				e.setInstanceLocked(nil)
			}
		}
	}
	if !errors.Is(ev.Err, ErrEngineFault) {
		ev.Err = fmt.Errorf("%w: %w", ErrEngineFault, ev.Err)
	}
	e.queued = append(e.queued, ev)
	if errors.Is(cause, ErrEngineFault) {
		return cause
	}
	return fmt.Errorf("%w: %w", ErrEngineFault, cause)
}

// readyLocked makes sure an instance is there and sends a held-back success unless keep.
func (e *Engine) readyLocked(keep bool) error {
	if e.closed {
		return ErrClosed
	}
	if e.in == nil {
		// The last re-instantiation failed: try again, at most every 100 ms.
		if now := e.Now(); now-e.lastRecovery < uint64(100*time.Millisecond) && e.lastRecovery != 0 {
			return fmt.Errorf("%w: engine unavailable since a failed re-instantiation", ErrEngineFault)
		}
		if err := e.faultLocked(errors.New("engine unavailable")); e.in == nil {
			return err
		}
	} else if e.watch != nil && e.watch.fired.Load() {
		// the last guest call overran its bound (and perhaps still returned)
		return e.faultLocked(errors.New("interrupted"))
	}
	if !keep {
		e.takePendingLocked()
		return e.sendHeldLocked()
	}
	return nil
}

// drainLocked drains the events a verdict said are pending, under the lock that
// made them, and queues them for unlockEmit. A breaker transition among them takes a
// snapshot at once: a trap after this point restores the breaker as it now is.
func (e *Engine) drainLocked() {
	if e.in == nil {
		return
	}
	ctx := e.enter()
	evs, err := e.in.drainEvents(ctx, e.rep)
	e.leave()
	if err != nil {
		_ = e.faultLocked(err)
		return
	}
	e.queued = append(e.queued, evs...)
	for i := range evs {
		if evs[i].Kind == EventBreakerTransition {
			e.snapshotLocked(e.Now())
			return
		}
	}
}

// unlockEmit releases the lock and delivers the events queued under it.
func (e *Engine) unlockEmit() { e.unlockEmitCtx(context.Background()) }

// unlockEmitCtx is unlockEmit on the goroutine of a call whose context is ctx
// (the telemetry sink and the logger receive it).
func (e *Engine) unlockEmitCtx(ctx context.Context) {
	queued := e.queued
	e.queued = nil
	e.mu.Unlock()
	if queued != nil {
		e.emit(ctx, queued)
	}
}

// op runs f under the lock with a ready instance and the call bound; an error
// of the guest re-instantiates the engine.
func (e *Engine) op(keep bool, f func(ctx context.Context, in *instance) error) error {
	return e.opKeep(context.Background(), keep, f)
}

// opCtx is op for a call whose context is cctx (its events are delivered with it).
func (e *Engine) opCtx(cctx context.Context, f func(ctx context.Context, in *instance) error) error {
	return e.opKeep(cctx, false, f)
}

func (e *Engine) opKeep(cctx context.Context, keep bool, f func(ctx context.Context, in *instance) error) error {
	e.mu.Lock()
	defer e.unlockEmitCtx(cctx)
	if err := e.readyLocked(keep); err != nil {
		return err
	}
	ctx := e.enter()
	err := f(ctx, e.in)
	e.leave()
	if err != nil {
		return e.faultLocked(err)
	}
	return nil
}

// Now is the engine's monotonic clock in ns (the `now` of the step protocol):
// the time since Load on the engine's Clock.
func (e *Engine) Now() uint64 {
	if c := e.o.clock; c != nil {
		return uint64(max(c.Now().Sub(e.vepoch), 0))
	}
	return uint64(time.Since(e.epoch))
}

// Clock is the clock the engine runs on (SystemClock{} unless WithClock).
func (e *Engine) Clock() Clock {
	if e.o.clock != nil {
		return e.o.clock
	}
	return SystemClock{}
}

// wallSecs is the clock's wall time in seconds (for a Retry-After HTTP date).
func (e *Engine) wallSecs() uint64 {
	if c := e.o.clock; c != nil {
		return uint64(max(c.Now().Unix(), 0))
	}
	return uint64(time.Now().Unix())
}

// NewCallID returns a fresh non-zero call id.
func (e *Engine) NewCallID() uint64 { return e.nextCall.Add(1) }

// Seed is the engine's jitter seed.
func (e *Engine) Seed() uint64 { return e.seed }

// Close releases the guest. A held-back success is sent first and the events
// still recorded are delivered.
func (e *Engine) Close(ctx context.Context) error {
	if e == nil {
		return errNilEngine
	}
	if ctx == nil {
		return nilArg("Close: ctx is nil (use context.Background())")
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	var evs []Event
	if e.in != nil && e.readyLocked(false) == nil && e.in != nil {
		gctx := e.enter()
		evs, _ = e.in.drainEvents(gctx, e.rep)
		_ = e.in.drop(gctx, e.rep)
		e.leave()
	}
	e.closeLocked(ctx)
	e.unlockEmit()
	if len(evs) > 0 {
		e.emit(ctx, evs)
	}
	return nil
}

func (e *Engine) closeLocked(ctx context.Context) {
	e.closed = true
	e.setInstanceLocked(nil)
	if e.watch != nil {
		e.watch.close()
	}
	_ = e.rt.Close(ctx)
}

// --- the step protocol, one method per WIT function ---

// Reload replaces the policies, keeping the state that still applies.
func (e *Engine) Reload(document string) error {
	if err := documentUTF8(document); err != nil {
		return err
	}
	var lerrs []LoadError
	err := e.op(false, func(ctx context.Context, in *instance) error {
		var err error
		e.leave()
		ctx = e.enterWork(len(document) + e.stateWork())
		if lerrs, err = in.reload(ctx, e.rep, document); err != nil || lerrs != nil {
			return err
		}
		e.doc = document
		if err := e.refreshInfosLocked(ctx); err != nil {
			return err
		}
		e.leave()
		e.snapshotLocked(e.Now())
		e.enter()
		return nil
	})
	if err != nil {
		return err
	}
	if lerrs != nil {
		return LoadErrors(lerrs)
	}
	return nil
}

// PolicyCount is the number of policies.
func (e *Engine) PolicyCount() (n uint32, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error { n, err = in.policyCount(ctx, e.rep); return err })
	return n, err
}

// PolicyIndex is the index of a named policy.
func (e *Engine) PolicyIndex(name string) (i uint32, ok bool, err error) {
	if !utf8.ValidString(name) {
		return 0, false, nil // no policy has that name
	}
	err = e.op(false, func(ctx context.Context, in *instance) error {
		i, ok, err = in.policyIndex(ctx, e.rep, name)
		return err
	})
	return i, ok, err
}

// PolicyInfo is what a host needs to know of a policy.
func (e *Engine) PolicyInfo(policy uint32) (info PolicyInfo, ok bool, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		info, ok, err = in.policyInfo(ctx, e.rep, policy)
		return err
	})
	return info, ok, err
}

// PolicyJSON is the policy with every default filled in, as JSON.
func (e *Engine) PolicyJSON(policy uint32) (s string, ok bool, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		s, ok, err = in.policyJSON(ctx, e.rep, policy)
		return err
	})
	return s, ok, err
}

// Analyze gives the worst cases of a policy when layers layers run it.
func (e *Engine) Analyze(policy, layers uint32) (a Analysis, ok bool, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		a, ok, err = in.analyze(ctx, e.rep, policy, layers)
		return err
	})
	return a, ok, err
}

// Start begins a call and acquires its first attempt (settle* as the WIT says;
// a success held back by Do is settled first, through report).
func (e *Engine) Start(call uint64, policy uint32, key string, flags uint32, now, settleCall, settleAt, settleElapsed uint64) (v Verdict, err error) {
	if err := keyUTF8(key); err != nil {
		return 0, err
	}
	err = e.op(false, func(ctx context.Context, in *instance) error {
		if key != "" {
			e.keyedCalls++
		}
		v, err = in.start(ctx, e.rep, call, policy, key, flags, now, settleCall, settleAt, settleElapsed)
		e.rawWakesLocked(v, err)
		return err
	})
	return v, err
}

// Acquire acquires the next attempt of a call.
func (e *Engine) Acquire(call, now uint64) (v Verdict, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		v, err = in.acquire(ctx, e.rep, call, now)
		e.rawWakesLocked(v, err)
		return err
	})
	return v, err
}

// Report reports the outcome of the attempt in flight.
func (e *Engine) Report(call, now, elapsed uint64, kind OutcomeKind, code int32, text string, wallSecs uint64, flags uint32) (v Verdict, err error) {
	text = strings.ToValidUTF8(text, "\uFFFD") // a raw header: the core says what it means
	err = e.op(false, func(ctx context.Context, in *instance) error {
		v, err = in.report(ctx, e.rep, call, now, elapsed, kind, code, text, wallSecs, flags)
		e.rawWakesLocked(v, err)
		return err
	})
	return v, err
}

// ReportFallback reports whether the chosen fallback succeeded.
func (e *Engine) ReportFallback(call, now uint64, ok bool) (v Verdict, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		v, err = in.reportFallback(ctx, e.rep, call, now, ok)
		e.rawWakesLocked(v, err)
		return err
	})
	return v, err
}

// HedgeStep advances a hedged call to now: after its hedge verdict (once attempt 1
// runs), and when a wait command's time has come (docs/policy.md, "Hedging").
func (e *Engine) HedgeStep(call, now uint64) (a HedgeAnswer, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		a, err = in.hedgeStep(ctx, e.rep, call, now)
		return err
	})
	return a, err
}

// ReportAttempt reports that attempt attempt of a hedged call closed, with its outcome
// (as Report; an attempt the core cancelled may be reported with any outcome).
func (e *Engine) ReportAttempt(call uint64, attempt uint32, now, elapsed uint64, kind OutcomeKind, code int32, text string,
	wallSecs uint64, flags uint32) (a HedgeAnswer, err error) {
	text = strings.ToValidUTF8(text, "\uFFFD") // a raw header: the core says what it means
	err = e.op(false, func(ctx context.Context, in *instance) error {
		a, err = in.reportAttempt(ctx, e.rep, call, attempt, now, elapsed, kind, code, text, wallSecs, flags)
		if err == nil {
			e.wakesIfParkedLocked() // the answer has no wakes bit
		}
		return err
	})
	return a, err
}

// Cancel abandons a call.
func (e *Engine) Cancel(call, now uint64) error {
	return e.op(false, func(ctx context.Context, in *instance) error {
		err := in.cancel(ctx, e.rep, call, now)
		if err == nil {
			e.wakesIfParkedLocked()
		}
		return err
	})
}

// cancelIn is Cancel of a call Do drives: the slot or the grant it held goes
// to the oldest waiter, which is woken.
func (e *Engine) cancelIn(cctx context.Context, call uint64) error {
	return e.opCtx(cctx, func(ctx context.Context, in *instance) error {
		err := in.cancel(ctx, e.rep, call, e.Now())
		if err == nil {
			e.wakesIfParkedLocked()
		}
		return err
	})
}

// TakeWakes takes the calls granted a bulkhead slot since the last take, in grant order
// (a verdict's WakesPending says some are): the calls of the raw API, to acquire again.
// The calls Do has parked are never in it: whichever takes the core's list (Do after a
// crossing that announces wakes, or this) wakes Do's own parked calls and keeps the rest
// for this, so the raw API and Do may share an engine. A call may be named that has
// acquired or ended since (an acquire then answers as for any call).
func (e *Engine) TakeWakes() (calls []uint64, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		fresh, err := in.takeWakes(ctx, e.rep)
		if err != nil {
			return err
		}
		e.routeWakesLocked(fresh)
		calls, e.unclaimed = e.unclaimed, nil
		return nil
	})
	return calls, err
}

// CallInfo is what the engine knows of a live call.
func (e *Engine) CallInfo(call uint64) (ci CallInfo, ok bool, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error { ci, ok, err = in.callInfo(ctx, e.rep, call); return err })
	return ci, ok, err
}

// DrainEvents takes the recorded events, oldest first. Do and the Transport drain
// and deliver events to listeners themselves; a caller of DrainEvents takes them away.
func (e *Engine) DrainEvents() (evs []Event, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error { evs, err = in.drainEvents(ctx, e.rep); return err })
	return evs, err
}

// BreakerState reads a breaker's state at now.
func (e *Engine) BreakerState(policy uint32, key string, now uint64) (s BreakerState, ok bool, err error) {
	if err := CheckKey(key); err != nil {
		return 0, false, err
	}
	err = e.op(false, func(ctx context.Context, in *instance) error {
		if key != "" {
			e.keyedCalls++
		}
		s, ok, err = in.breakerState(ctx, e.rep, policy, key, now)
		return err
	})
	return s, ok, err
}

// SetBreakerState forces a breaker state; the guest's refusal comes back as msg with ok false.
func (e *Engine) SetBreakerState(policy uint32, key string, state BreakerState, now uint64) (msg string, ok bool, err error) {
	if err := CheckKey(key); err != nil {
		return "", false, err
	}
	err = e.op(false, func(ctx context.Context, in *instance) error {
		if key != "" {
			e.keyedCalls++
		}
		msg, ok, err = in.setBreakerState(ctx, e.rep, policy, key, state, now)
		if err == nil && ok {
			e.leave()
			e.snapshotLocked(e.Now())
			e.enter()
		}
		return err
	})
	return msg, ok, err
}

// ExportState exports the whole engine state (and keeps it as the snapshot restored after a trap).
func (e *Engine) ExportState() (b []byte, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		e.leave()
		ctx = e.enterWork(e.stateWork())
		b, err = in.exportState(ctx, e.rep)
		if err == nil {
			e.snap, e.snapAt = b, e.Now()
			e.stateBytes, e.keyedCalls = len(b), 0
		}
		return err
	})
	return b, err
}

// ImportState restores exported state; an invalid state gives a *LoadError and changes nothing.
func (e *Engine) ImportState(state []byte) error {
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) error {
		var err error
		e.leave()
		ctx = e.enterWork(len(state) + e.stateWork())
		lerr, err = in.importState(ctx, e.rep, state)
		if err == nil && lerr == nil {
			e.stateBytes, e.keyedCalls = len(state), 0
			e.leave()
			e.snapshotLocked(e.Now())
			e.enter()
		}
		return err
	})
	if err != nil {
		return err
	}
	if lerr != nil {
		return lerr
	}
	return nil
}

// ErrInvalidUTF8 is wrapped by the error for a key (or a document) that is not valid
// UTF-8: WIT strings are UTF-8, so it is refused at the host boundary and never
// reaches the guest.
var ErrInvalidUTF8 = errors.New("levee: not valid UTF-8")

// ErrKeyTooLong is wrapped by the error for a key longer than MaxKeyBytes: the core
// would decide it against the shared overflow entry, so the host refuses it first.
var ErrKeyTooLong = errors.New("levee: key too long")

// MaxKeyBytes is the longest key (in UTF-8 bytes) a call, a breaker, a durable call or
// a fleet may name (docs/policy.md, Keys; the GUARDS of wit/constants.json).
const MaxKeyBytes = cGuardMaxKeyBytes

// CheckKey returns the error the entries that take a caller's key (Do, the Transport,
// BreakerState, SetBreakerState, the durable executor, the fleet) give for this key, nil
// when it may be used: longer than MaxKeyBytes (ErrKeyTooLong), or not UTF-8
// (ErrInvalidUTF8). The crossings of the WIT itself (Start, DurableBegin, FleetMerge,
// FleetApply) check only UTF-8 and hand a longer key to the core, which decides it
// against its overflow entry (the conformance vectors drive them).
func CheckKey(key string) error {
	if len(key) > MaxKeyBytes {
		text := strings.NewReplacer("{bytes}", strconv.Itoa(len(key)), "{max}", strconv.Itoa(MaxKeyBytes)).Replace(cTextKeyTooLong)
		return fmt.Errorf("%w: %s", ErrKeyTooLong, text)
	}
	return keyUTF8(key)
}

// keyUTF8 refuses a key that is not UTF-8 (no WIT string may be).
func keyUTF8(key string) error {
	if utf8.ValidString(key) {
		return nil
	}
	return fmt.Errorf("%w: the key %q", ErrInvalidUTF8, key)
}

// documentUTF8 refuses a document that is not UTF-8 as the core refuses any invalid
// document: a LoadErrors naming where.
func documentUTF8(document string) error {
	if utf8.ValidString(document) {
		return nil
	}
	at := 0
	for at < len(document) {
		r, n := utf8.DecodeRuneInString(document[at:])
		if r == utf8.RuneError && n <= 1 {
			break
		}
		at += n
	}
	line := 1 + strings.Count(document[:at], "\n")
	return LoadErrors{{Path: "", Message: fmt.Sprintf("the document is not valid UTF-8 (line %d, byte %d): %v", line, at, ErrInvalidUTF8)}}
}

// Durable calls (docs/durable.md). Each returns the core's step, or a *LoadError
// that names what is wrong with the record (the executor quarantines it).

func durableResult(s DurableStep, lerr *LoadError, err error) (DurableStep, error) {
	if err != nil {
		return DurableStep{}, err
	}
	if lerr != nil {
		return DurableStep{}, lerr
	}
	return s, nil
}

// DurableBegin begins a durable call of policy (flags bit 0: not idempotent).
func (e *Engine) DurableBegin(policy uint32, key, idempotencyKey string, flags uint32, wallNow uint64) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableBegin(ctx, e.rep, policy, key, idempotencyKey, flags, wallNow)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableStep takes a call up as owner (see the WIT's durable-step).
func (e *Engine) DurableStep(record []byte, owner string, wallNow, elapsed uint64) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableStep(ctx, fnDurableStep, e.rep, record, owner, wallNow, elapsed)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableRenew extends the lease of the attempt owner runs.
func (e *Engine) DurableRenew(record []byte, owner string, wallNow, elapsed uint64) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableStep(ctx, fnDurableRenew, e.rep, record, owner, wallNow, elapsed)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableOutcome reports the outcome of the attempt owner ran.
func (e *Engine) DurableOutcome(record []byte, owner string, wallNow, elapsed uint64, kind OutcomeKind, code int32,
	text, message string, flags uint32) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableOutcome(ctx, e.rep, record, owner, wallNow, elapsed, kind, code, text, message, flags)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableCancel cancels a call that has not finished.
func (e *Engine) DurableCancel(record []byte, wallNow uint64) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableFinal(ctx, fnDurableCancel, e.rep, record, wallNow)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableRevive gives a dead or cancelled call a fresh set of attempts, due now.
func (e *Engine) DurableRevive(record []byte, wallNow uint64) (DurableStep, error) {
	var s DurableStep
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		s, lerr, err = in.durableFinal(ctx, fnDurableRevive, e.rep, record, wallNow)
		return err
	})
	return durableResult(s, lerr, err)
}

// DurableInspect describes a record as canonical JSON.
func (e *Engine) DurableInspect(record []byte) (string, error) {
	var out string
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		out, lerr, err = in.durableInspect(ctx, e.rep, record)
		return err
	})
	if err != nil {
		return "", err
	}
	if lerr != nil {
		return "", lerr
	}
	return out, nil
}
