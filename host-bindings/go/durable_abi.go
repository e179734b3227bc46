package levee

// Bindings of the WIT's `executor` resource (docs/durable.md, "The executor"): the durable
// executor's machine, which holds every decision of its loop. The store side (SQLite,
// PostgreSQL) and the loop that carries out the commands are the package
// github.com/levee-dev/levee/host-bindings/go/durable. Nothing here decides anything: the
// commands are the core's.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/tetratelabs/wazero/api"
)

// DurableOperatorTries is how many times an operator's cancel or retry is tried against
// concurrent writers (wit/constants.json, durable.OPERATOR_TRIES).
const DurableOperatorTries = cDurableOperatorTries

// The WIT types of the executor, in declaration order.
var (
	tExecutorConfig = recordOf("executor-config", "owner", tString, "concurrency", tU32, "poll", tU64,
		"claim-hold", tU64, "until-idle", tBool)
	tClaimedCall = recordOf("claimed-call", "id", tS64, "handler", tString, "bytes", listOf(tU8), "db-now", tU64)
	tRowWrite    = recordOf("row-write", "id", tS64, "status", tString, "next-at", tU64, "attempts", tU32,
		"bytes", listOf(tU8), "lease", tBool, "keep-result", tBool, "error", optionOf(tString))
	tWriteResult    = variantOf("write-result", writeResultNames[:], []*witType{nil, nil, tString})
	tExecClaim      = recordOf("exec-claim", "limit", tU32, "hold", tU64)
	tExecRun        = recordOf("exec-run", "id", tS64, "attempt", tU32, "timeout", tU64, "renew-every", tU64)
	tExecQuarantine = recordOf("exec-quarantine", "id", tS64, "error", tString)
	tLogLevel       = enumOf("log-level", logLevelNames[:]...)
	tExecLog        = recordOf("exec-log", "level", tLogLevel, "id", tS64, "text", tString)
	tExecWritten    = recordOf("exec-written", "id", tS64, "result", tWriteResult)
	tExecFinished   = recordOf("exec-finished", "id", tS64, "kind", tOutcomeKind, "code", tS32, "text", tString,
		"message", tString, "flags", tU32)
	tExecEvent = variantOf("exec-event", execEventNames[:], []*witType{nil, listOf(tClaimedCall), tString,
		optionOf(tU64), tExecWritten, tS64, tExecFinished})
	tExecCommand = variantOf("exec-command", execCommandNames[:], []*witType{tExecClaim, tRowWrite, tExecRun, tS64,
		tExecQuarantine, nil, tU64, nil, tExecLog})
	tOwnExecutor = ownOf("executor")
	// borrow<executor> lowered into the instance that implements the resource is its rep (an i32).
	tBorrowExecutor = &witType{kind: kOwn, name: "borrow<executor>", size: 4, align: 4, flat: []flatType{fI32}}
)

func xmethod(name string, params []*witType, results []*witType) *funcSig {
	return newFuncSig(ifaceEngineAPI+"#[method]executor."+name, append(ts(tBorrowExecutor), params...), results)
}

const exportExecDtor = ifaceEngineAPI + "#[dtor]executor"

var writeResultNames = [...]string{"applied", "lost", "failed"}
var logLevelNames = [...]string{"warn", "error"}
var execEventNames = [...]string{"poll", "claimed", "claim-failed", "next-due", "written", "renew", "finished"}
var execCommandNames = [...]string{"claim", "write", "run", "abandon", "quarantine", "next-due", "sleep", "idle", "log"}

// ExecutorConfig configures the durable executor's machine; a zero takes the core's default.
type ExecutorConfig struct {
	Owner       string // this process's name in leases
	Concurrency uint32 // calls run at once
	Poll        uint64 // the longest sleep between two looks at the store, ns
	ClaimHold   uint64 // how long a claim holds the calls it returns, ns
	UntilIdle   bool   // answer ExecIdle once nothing is pending or running
}

// ClaimedCall is a row the store's claim returned.
type ClaimedCall struct {
	ID      int64
	Handler string
	Record  []byte
	DBNow   uint64 // the store's wall clock while the claim ran, ns since the Unix epoch
}

// RowWrite is a row to write, fenced by this process's lease (the WIT's row-write).
type RowWrite struct {
	ID         int64
	Status     string
	NextAt     uint64
	Attempts   uint32
	Record     []byte
	Lease      bool    // the lease-owner column is this process's name (else cleared)
	KeepResult bool    // store the handler's result
	Error      *string // the error column; nil for none
}

// WriteResultKind is what became of a write.
type WriteResultKind uint8

const (
	WriteApplied WriteResultKind = iota
	WriteLost
	WriteFailed
)

func (k WriteResultKind) String() string { return enumName(writeResultNames[:], int(k)) }

// WriteResult is what became of a write; Error is the store's error for WriteFailed.
type WriteResult struct {
	Kind  WriteResultKind
	Error string
}

// ExecEventKind names a case of ExecEvent.
type ExecEventKind uint8

const (
	ExecPoll ExecEventKind = iota
	ExecClaimed
	ExecClaimFailed
	ExecNextDueIn
	ExecWritten
	ExecRenew
	ExecFinished
)

func (k ExecEventKind) String() string { return enumName(execEventNames[:], int(k)) }

// ExecEvent is what happened, for Executor.Feed. The fields that do not apply to Kind are zero.
type ExecEvent struct {
	Kind ExecEventKind
	Rows []ClaimedCall // ExecClaimed
	// Error is the store's error (ExecClaimFailed)
	Error string
	// Pending and DueIn: the next call is due in DueIn ns; Pending false: none is (ExecNextDueIn)
	Pending bool
	DueIn   uint64
	ID      int64       // ExecWritten, ExecRenew, ExecFinished
	Result  WriteResult // ExecWritten
	// ExecFinished: the outcome as for Engine.Report, Message the error's text for the record
	// (empty for a timeout), Flags bit 0: overloaded
	Outcome OutcomeKind
	Code    int32
	Text    string
	Message string
	Flags   uint32
}

// ExecCommandKind names a case of ExecCommand.
type ExecCommandKind uint8

const (
	ExecClaim ExecCommandKind = iota
	ExecWrite
	ExecRun
	ExecAbandon
	ExecQuarantine
	ExecNextDue
	ExecSleep
	ExecIdle
	ExecLog
)

func (k ExecCommandKind) String() string { return enumName(execCommandNames[:], int(k)) }

// LogLevel is how bad an ExecLog is.
type LogLevel uint8

const (
	LogWarn LogLevel = iota
	LogError
)

func (l LogLevel) String() string { return enumName(logLevelNames[:], int(l)) }

// ExecCommand is what the host does next. The fields that do not apply to Kind are zero.
type ExecCommand struct {
	Kind ExecCommandKind
	// ExecClaim: claim up to Limit calls, holding them for Hold ns
	Limit uint32
	Hold  uint64
	Row   RowWrite // ExecWrite (its ID is the call's)
	// ID is the call of ExecRun, ExecAbandon, ExecQuarantine and ExecLog (0 for none)
	ID int64
	// ExecRun: the attempt, its timeout (0: none) and the renewal period, ns
	Attempt    uint32
	Timeout    uint64
	RenewEvery uint64
	Error      string // ExecQuarantine
	Until      uint64 // ExecSleep: on the host's monotonic clock, ns
	Level      LogLevel
	Text       string // ExecLog
}

// ErrExecutorReset is the answer of an Executor whose component instance was replaced after
// a trap: a new machine (same configuration and handlers) took its place and the event was
// not fed. The host abandons every call it held, then feeds ExecPoll.
var ErrExecutorReset = errors.New("levee: the executor was rebuilt after an engine fault; the calls it held are abandoned")

// Executor is the durable executor's machine (the WIT's `executor` resource) in the
// engine's component instance. Its methods are safe for concurrent use.
type Executor struct {
	e      *Engine
	cfg    ExecutorConfig
	mu     sync.Mutex
	names  []string
	rep    uint32
	gen    uint64
	live   bool
	closed bool
}

// NewExecutor makes a durable executor's machine.
func (e *Engine) NewExecutor(cfg ExecutorConfig) (*Executor, error) {
	x := &Executor{e: e, cfg: cfg}
	err := e.op(false, func(ctx context.Context, in *instance) error { return x.makeLocked(ctx, in) })
	if err != nil {
		return nil, err
	}
	return x, nil
}

// makeLocked constructs the machine in in and registers the names (under the engine's lock).
func (x *Executor) makeLocked(ctx context.Context, in *instance) error {
	x.live = false
	rep, err := in.execNew(ctx, x.cfg)
	if err != nil {
		return err
	}
	x.rep, x.gen, x.live = rep, x.e.gen, true
	for _, n := range x.names {
		if err := in.execRegister(ctx, rep, n); err != nil {
			return err
		}
	}
	return nil
}

// do runs f on a live machine. A machine of an instance replaced since is rebuilt, and the
// answer is ErrExecutorReset.
func (x *Executor) do(f func(ctx context.Context, in *instance) error) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return ErrClosed
	}
	reset := false
	err := x.e.op(false, func(ctx context.Context, in *instance) error {
		if !x.live || x.gen != x.e.gen {
			reset = true
			return x.makeLocked(ctx, in)
		}
		return f(ctx, in)
	})
	if err == nil && reset {
		return ErrExecutorReset
	}
	return err
}

// Register lets calls of handler name run in this process.
func (x *Executor) Register(name string) error {
	err := x.do(func(ctx context.Context, in *instance) error { return in.execRegister(ctx, x.rep, name) })
	x.mu.Lock()
	x.names = append(x.names, name) // a rebuilt machine registers it
	x.mu.Unlock()
	if errors.Is(err, ErrExecutorReset) {
		return nil // the rebuilt machine has it now
	}
	return err
}

// Running is the number of calls the machine holds (claimed, running or being written).
func (x *Executor) Running() (n uint32, err error) {
	err = x.do(func(ctx context.Context, in *instance) (err error) {
		n, err = in.execRunning(ctx, x.rep)
		return err
	})
	return n, err
}

// Forget drops call id (the host stopped its handler at shutdown).
func (x *Executor) Forget(id int64) error {
	return x.do(func(ctx context.Context, in *instance) error { return in.execForget(ctx, x.rep, id) })
}

// Feed tells the machine what happened at now (the engine's monotonic clock, ns) and answers
// the commands to carry out, in order. ErrExecutorReset: see there.
func (x *Executor) Feed(now uint64, ev ExecEvent) (cmds []ExecCommand, err error) {
	err = x.do(func(ctx context.Context, in *instance) (err error) {
		cmds, err = in.execFeed(ctx, x.rep, x.e.rep, now, ev)
		return err
	})
	return cmds, err
}

// Close drops the machine.
func (x *Executor) Close() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return nil
	}
	x.closed = true
	return x.e.op(false, func(ctx context.Context, in *instance) error {
		if !x.live || x.gen != x.e.gen {
			x.live = false
			return nil
		}
		x.live = false
		return in.execDrop(ctx, x.rep)
	})
}

// ExecOperator is what an operator's cancel (revive false) or retry (revive true) of call id
// writes, compare-and-set against record, the bytes read. A *LoadError: the call is finished
// already, or its record is not one the core can use (nothing is to be changed).
func (e *Engine) ExecOperator(id int64, record []byte, revive bool, wallNow uint64) (RowWrite, error) {
	var w RowWrite
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		w, lerr, err = in.execOperator(ctx, e.rep, id, record, revive, wallNow)
		return err
	})
	if err != nil {
		return RowWrite{}, err
	}
	if lerr != nil {
		return RowWrite{}, lerr
	}
	return w, nil
}

// --- the instance side ---

func b2u(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

func (in *instance) execNew(ctx context.Context, cfg ExecutorConfig) (uint32, error) {
	l, err := in.lowerAll(ctx, cfg.Owner)
	if err != nil {
		return 0, err
	}
	if err := in.call(ctx, fnExecNew, l[0], l[1], uint64(cfg.Concurrency), cfg.Poll, cfg.ClaimHold, b2u(cfg.UntilIdle)); err != nil {
		return 0, err
	}
	// lift_own: the handle leaves the instance's table; the host keeps the rep.
	return in.xtable.remove(api.DecodeU32(in.stack[0]))
}

func (in *instance) execDrop(ctx context.Context, rep uint32) error {
	if in.xdtor == nil {
		return nil
	}
	_, err := in.xdtor.Call(ctx, uint64(rep))
	return err
}

func (in *instance) execRegister(ctx context.Context, rep uint32, name string) error {
	l, err := in.lowerAll(ctx, name)
	if err != nil {
		return err
	}
	return in.call(ctx, fnExecRegister, uint64(rep), l[0], l[1])
}

func (in *instance) execRunning(ctx context.Context, rep uint32) (uint32, error) {
	if err := in.call(ctx, fnExecRunning, uint64(rep)); err != nil {
		return 0, err
	}
	return api.DecodeU32(in.stack[0]), nil
}

func (in *instance) execForget(ctx context.Context, rep uint32, id int64) error {
	return in.call(ctx, fnExecForget, uint64(rep), uint64(id))
}

// allocIn is cabi_realloc(0, 0, align, size), checked to lie within memory.
func (in *instance) allocIn(ctx context.Context, align, size int) (uint32, error) {
	var st [4]uint64
	st[0], st[1], st[2], st[3] = 0, 0, uint64(align), uint64(size)
	if err := in.realloc.CallWithStack(ctx, st[:]); err != nil {
		return 0, err
	}
	ptr := api.DecodeU32(st[0])
	if int(ptr)%align != 0 || uint64(ptr)+uint64(size) > uint64(in.memory.Size()) {
		return 0, trapf("cabi_realloc returned %d for %d bytes aligned to %d", ptr, size, align)
	}
	return ptr, nil
}

// lowerClaimed stores a list<claimed-call> (store_list: the elements at their record
// layout in one allocation, their strings and byte lists in their own).
func (in *instance) lowerClaimed(ctx context.Context, rows []ClaimedCall) (uint32, uint32, error) {
	if len(rows) == 0 {
		return uint32(tClaimedCall.align), 0, nil
	}
	if uint64(len(rows))*uint64(tClaimedCall.size) > maxStringByteLength {
		return 0, 0, fmt.Errorf("levee: %d claimed rows are too many for the Canonical ABI", len(rows))
	}
	type lowered struct{ hp, hn, bp, bn uint32 }
	low := make([]lowered, len(rows))
	for i, r := range rows {
		l, err := in.lowerAll(ctx, r.Handler, r.Record)
		if err != nil {
			return 0, 0, err
		}
		low[i] = lowered{uint32(l[0]), uint32(l[1]), uint32(l[2]), uint32(l[3])}
	}
	ptr, err := in.allocIn(ctx, tClaimedCall.align, len(rows)*tClaimedCall.size)
	if err != nil {
		return 0, 0, err
	}
	buf := make([]byte, len(rows)*tClaimedCall.size)
	o := tClaimedCall.offsets
	for i, r := range rows {
		b := buf[i*tClaimedCall.size:]
		binary.LittleEndian.PutUint64(b[o[0]:], uint64(r.ID))
		binary.LittleEndian.PutUint32(b[o[1]:], low[i].hp)
		binary.LittleEndian.PutUint32(b[o[1]+4:], low[i].hn)
		binary.LittleEndian.PutUint32(b[o[2]:], low[i].bp)
		binary.LittleEndian.PutUint32(b[o[2]+4:], low[i].bn)
		binary.LittleEndian.PutUint64(b[o[3]:], r.DBNow)
	}
	if !in.memory.Write(ptr, buf) {
		return 0, 0, trapf("claimed rows at %d out of bounds", ptr)
	}
	return ptr, uint32(len(rows)), nil
}

// lowerExecEvent flattens an exec-event (lower_flat_variant): the discriminant, then the
// case's flat values in the joined types (an i32 in an i64 slot is zero-extended), the
// rest zero.
func (in *instance) lowerExecEvent(ctx context.Context, ev ExecEvent) ([]uint64, error) {
	flat := make([]uint64, len(tExecEvent.flat))
	if int(ev.Kind) >= len(execEventNames) {
		return nil, fmt.Errorf("levee: exec-event kind %d", ev.Kind)
	}
	flat[0] = uint64(ev.Kind)
	p := flat[1:]
	switch ev.Kind {
	case ExecClaimed:
		ptr, n, err := in.lowerClaimed(ctx, ev.Rows)
		if err != nil {
			return nil, err
		}
		p[0], p[1] = uint64(ptr), uint64(n)
	case ExecClaimFailed:
		l, err := in.lowerAll(ctx, ev.Error)
		if err != nil {
			return nil, err
		}
		p[0], p[1] = l[0], l[1]
	case ExecNextDueIn:
		if ev.Pending {
			p[0], p[1] = 1, ev.DueIn
		}
	case ExecWritten:
		p[0] = uint64(ev.ID)
		if int(ev.Result.Kind) >= len(writeResultNames) {
			return nil, fmt.Errorf("levee: write-result kind %d", ev.Result.Kind)
		}
		p[1] = uint64(ev.Result.Kind)
		if ev.Result.Kind == WriteFailed {
			l, err := in.lowerAll(ctx, ev.Result.Error)
			if err != nil {
				return nil, err
			}
			p[2], p[3] = l[0], l[1]
		}
	case ExecRenew:
		p[0] = uint64(ev.ID)
	case ExecFinished:
		if int(ev.Outcome) >= len(outcomeKindNames) {
			return nil, fmt.Errorf("levee: outcome kind %d", ev.Outcome)
		}
		l, err := in.lowerAll(ctx, ev.Text, ev.Message)
		if err != nil {
			return nil, err
		}
		p[0], p[1], p[2] = uint64(ev.ID), uint64(ev.Outcome), uint64(uint32(ev.Code))
		p[3], p[4], p[5], p[6], p[7] = l[0], l[1], l[2], l[3], uint64(ev.Flags)
	}
	return flat, nil
}

// maxExecCommands bounds the commands of one feed: a claim answers at most a write or a
// quarantine per row (at most the machine's concurrency, a u32) and two more. A longer list
// is a guest fault, refused before anything is allocated for it.
const maxExecCommands = 1 << 20

func (in *instance) execFeed(ctx context.Context, rep, engine uint32, now uint64, ev ExecEvent) ([]ExecCommand, error) {
	flat, err := in.lowerExecEvent(ctx, ev)
	if err != nil {
		return nil, err
	}
	params := append([]uint64{uint64(rep), uint64(engine), now}, flat...)
	if err := in.call(ctx, fnExecFeed, params...); err != nil {
		return nil, err
	}
	ptr := api.DecodeU32(in.stack[0])
	m := in.view()
	if err := m.check(ptr, 8, 4); err != nil {
		return nil, err
	}
	if n := m.u32(ptr + 4); n > maxExecCommands {
		return nil, trapf("feed answered %d commands (at most %d)", n, maxExecCommands)
	}
	v, err := in.liftRet(ctx, fnExecFeed)
	if err != nil {
		return nil, err
	}
	return asList(v, asExecCommand), nil
}

func asRowWrite(v any) RowWrite {
	f := v.([]any)
	b, _ := f[4].([]byte)
	w := RowWrite{ID: f[0].(int64), Status: f[1].(string), NextAt: f[2].(uint64), Attempts: f[3].(uint32),
		Record: append([]byte(nil), b...), Lease: f[5].(bool), KeepResult: f[6].(bool)}
	if o := f[7].(variantVal); o.disc == 1 {
		s := o.payload.(string)
		w.Error = &s
	}
	return w
}

func asExecCommand(v any) ExecCommand {
	cv := v.(variantVal)
	c := ExecCommand{Kind: ExecCommandKind(cv.disc)}
	switch c.Kind {
	case ExecClaim:
		r := cv.payload.([]any)
		c.Limit, c.Hold = r[0].(uint32), r[1].(uint64)
	case ExecWrite:
		c.Row = asRowWrite(cv.payload)
		c.ID = c.Row.ID
	case ExecRun:
		r := cv.payload.([]any)
		c.ID, c.Attempt, c.Timeout, c.RenewEvery = r[0].(int64), r[1].(uint32), r[2].(uint64), r[3].(uint64)
	case ExecAbandon:
		c.ID = cv.payload.(int64)
	case ExecQuarantine:
		r := cv.payload.([]any)
		c.ID, c.Error = r[0].(int64), r[1].(string)
	case ExecSleep:
		c.Until = cv.payload.(uint64)
	case ExecLog:
		r := cv.payload.([]any)
		c.Level, c.ID, c.Text = LogLevel(r[0].(variantVal).disc), r[1].(int64), r[2].(string)
	}
	return c
}

func (in *instance) execOperator(ctx context.Context, engine uint32, id int64, record []byte, revive bool,
	wallNow uint64) (RowWrite, *LoadError, error) {
	l, err := in.lowerAll(ctx, record)
	if err != nil {
		return RowWrite{}, nil, err
	}
	if err := in.call(ctx, fnExecOperator, uint64(engine), uint64(id), l[0], l[1], b2u(revive), wallNow); err != nil {
		return RowWrite{}, nil, err
	}
	v, err := in.liftRet(ctx, fnExecOperator)
	if err != nil {
		return RowWrite{}, nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		le := asLoadError(r.payload)
		return RowWrite{}, &le, nil
	}
	return asRowWrite(r.payload), nil, nil
}
