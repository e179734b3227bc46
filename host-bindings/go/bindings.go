package levee

// Bindings of the WIT interface `levee:policy/engine-api@0.1.0` to the core
// module, through the Canonical ABI of abi.go. Every function of the WIT has
// one method on *instance here, with the WIT's parameters and results in their
// Go forms. Nothing in this file decides anything about policies.

import (
	"context"
	"fmt"
	"math"
	"sync"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
)

// The WIT types of `levee:policy/types@0.1.0`, in declaration order.
var (
	tReason       = enumOf("reason", reasonNames...)
	tOutcomeKind  = enumOf("outcome-kind", outcomeKindNames...)
	tBreakerState = enumOf("breaker-state", breakerStateNames...)
	tEventKind    = enumOf("event-kind", eventKindNames...)
	tEvent        = recordOf("event",
		"at", tU64, "kind", tEventKind, "policy", tU32, "key", tString, "call", tU64,
		"attempt", tU32, "reason", tReason, "duration", tU64, "state-from", tBreakerState,
		"state-to", tBreakerState, "name", tString, "value", tS64)
	tLoadError  = recordOf("load-error", "path", tString, "message", tString)
	tStatePage  = recordOf("state-page", "bytes", listOf(tU8), "next", tU64)
	tPolicyInfo = recordOf("policy-info", "name", tString, "max-attempts", tU32,
		"attempt-timeout", tU64, "deadline", tU64, "fallbacks", listOf(tString))
	tCallInfo = recordOf("call-info", "policy", tU32, "key", tString, "attempts", tU32,
		"deadline", tU64, "last-reason", tReason, "in-flight", tBool)
	tAnalysis = recordOf("analysis", "worst-attempts", tU32, "worst-latency", optionOf(tU64),
		"amplification", tF64, "amplification-with-budget", tF64)
	tDurableAction = enumOf("durable-action", durableActionNames...)
	tDurableReason = enumOf("durable-reason", durableReasonNames...)
	tDurableStep   = recordOf("durable-step", "action", tDurableAction, "attempt", tU32, "wait", tU64,
		"timeout", tU64, "next-at", tU64, "lease-until", tU64, "reason", tDurableReason,
		"policy-changed", tBool, "bytes", listOf(tU8))
	tHedgeStart   = recordOf("hedge-start", "attempt", tU32, "timeout", tU64)
	tHedgeEnd     = recordOf("hedge-end", "attempt", tU32, "verdict", tU64)
	tHedgeCommand = variantOf("hedge-command", hedgeCommandNames[:], []*witType{tHedgeStart, tU32, tU64, tHedgeEnd})
	tHedgeAnswer  = recordOf("hedge-answer", "commands", listOf(tHedgeCommand), "events-pending", tBool)
	tOwnEngine    = ownOf("engine")
	// borrow<engine> lowered into the instance that implements the resource is its rep (an i32).
	tBorrowEngine = &witType{kind: kOwn, name: "borrow<engine>", size: 4, align: 4, flat: []flatType{fI32}}
)

const (
	ifaceEngineAPI = "levee:policy/engine-api@0.1.0"
	// importResourceModule is where the core module imports the handle functions of its exported resource.
	importResourceModule = "[export]" + ifaceEngineAPI
)

// The functions of `engine-api`, in WIT order.
const (
	fnLoad = iota
	fnReload
	fnPolicyCount
	fnPolicyIndex
	fnPolicyInfo
	fnPolicyJSON
	fnAnalyze
	fnStart
	fnID
	fnAcquire
	fnReport
	fnReportFallback
	fnHedgeStep
	fnReportAttempt
	fnCancel
	fnTakeWakes
	fnCallInfo
	fnDrainEvents
	fnBreakerState
	fnSetBreakerState
	fnExportState
	fnExportSnapshot
	fnImportState
	fnExportStatePage
	fnImportStateBegin
	fnImportStatePage
	fnImportStateEnd
	fnDurableBegin
	fnDurableStep
	fnDurableRenew
	fnDurableOutcome
	fnDurableCancel
	fnDurableRevive
	fnDurableInspect
	fnFleetPlan
	fnFleetMerge
	fnFleetApply
	fnFleetInspect
	// the `executor` resource (durable_abi.go)
	fnExecNew
	fnExecRegister
	fnExecRunning
	fnExecFeed
	fnExecForget
	fnExecOperator
	// start-unkeyed is a plain function of the interface, after the resource: the Go host
	// passes borrows as reps and skips lowering an empty key already, so it gains nothing
	// from it and binds it only to keep the bindings exactly the WIT's.
	fnStartUnkeyed
	nFuncs
)

func ts(t ...*witType) []*witType { return t }

func method(name string, params []*witType, results []*witType) *funcSig {
	return newFuncSig(ifaceEngineAPI+"#[method]engine."+name, append(ts(tBorrowEngine), params...), results)
}

var sigs = [nFuncs]*funcSig{
	fnLoad:           newFuncSig(ifaceEngineAPI+"#[static]engine.load", ts(tString, tU64), ts(resultOf(tOwnEngine, listOf(tLoadError)))),
	fnReload:         method("reload", ts(tString), ts(resultOf(nil, listOf(tLoadError)))),
	fnPolicyCount:    method("policy-count", nil, ts(tU32)),
	fnPolicyIndex:    method("policy-index", ts(tString), ts(optionOf(tU32))),
	fnPolicyInfo:     method("policy-info", ts(tU32), ts(optionOf(tPolicyInfo))),
	fnPolicyJSON:     method("policy-json", ts(tU32), ts(optionOf(tString))),
	fnAnalyze:        method("analyze", ts(tU32, tU32), ts(optionOf(tAnalysis))),
	fnStart:          method("start", ts(tU64, tU32, tString, tU32, tU64, tU64, tU64, tU64), ts(tU64)),
	fnID:             method("id", nil, ts(tU32)),
	fnAcquire:        method("acquire", ts(tU64, tU64), ts(tU64)),
	fnReport:         method("report", ts(tU64, tU64, tU64, tOutcomeKind, tS32, tString, tU64, tU32), ts(tU64)),
	fnReportFallback: method("report-fallback", ts(tU64, tU64, tBool), ts(tU64)),
	fnHedgeStep:      method("hedge-step", ts(tU64, tU64), ts(tHedgeAnswer)),
	fnReportAttempt: method("report-attempt", ts(tU64, tU32, tU64, tU64, tOutcomeKind, tS32, tString, tU64, tU32),
		ts(tHedgeAnswer)),
	fnCancel:       method("cancel", ts(tU64, tU64), nil),
	fnTakeWakes:    method("take-wakes", nil, ts(listOf(tU64))),
	fnCallInfo:     method("call-info", ts(tU64), ts(optionOf(tCallInfo))),
	fnDrainEvents:  method("drain-events", nil, ts(listOf(tEvent))),
	fnBreakerState: method("breaker-state", ts(tU32, tString, tU64), ts(optionOf(tBreakerState))),
	fnSetBreakerState: method("set-breaker-state", ts(tU32, tString, tBreakerState, tU64),
		ts(resultOf(nil, tString))),
	fnExportState:      method("export-state", nil, ts(listOf(tU8))),
	fnExportSnapshot:   method("export-snapshot", nil, ts(listOf(tU8))),
	fnImportState:      method("import-state", ts(listOf(tU8)), ts(resultOf(nil, tLoadError))),
	fnExportStatePage:  method("export-state-page", ts(tU64, tBool), ts(tStatePage)),
	fnImportStateBegin: method("import-state-begin", nil, nil),
	fnImportStatePage:  method("import-state-page", ts(listOf(tU8)), ts(resultOf(nil, tLoadError))),
	fnImportStateEnd:   method("import-state-end", nil, ts(resultOf(nil, tLoadError))),
	fnDurableBegin:     method("durable-begin", ts(tU32, tString, tString, tU32, tU64), ts(resultOf(tDurableStep, tLoadError))),
	fnDurableStep:      method("durable-step", ts(listOf(tU8), tString, tU64, tU64), ts(resultOf(tDurableStep, tLoadError))),
	fnDurableRenew:     method("durable-renew", ts(listOf(tU8), tString, tU64, tU64), ts(resultOf(tDurableStep, tLoadError))),
	fnDurableOutcome: method("durable-outcome", ts(listOf(tU8), tString, tU64, tU64, tOutcomeKind, tS32, tString, tString, tU32),
		ts(resultOf(tDurableStep, tLoadError))),
	fnDurableCancel:  method("durable-cancel", ts(listOf(tU8), tU64), ts(resultOf(tDurableStep, tLoadError))),
	fnDurableRevive:  method("durable-revive", ts(listOf(tU8), tU64), ts(resultOf(tDurableStep, tLoadError))),
	fnDurableInspect: method("durable-inspect", ts(listOf(tU8)), ts(resultOf(tString, tLoadError))),
	fnFleetPlan:      method("fleet-plan", ts(tU32), ts(optionOf(tString))),
	fnFleetMerge: method("fleet-merge", ts(tU32, tString, tString, tU64, tU64, listOf(tU8)),
		ts(resultOf(listOf(tU8), tLoadError))),
	fnFleetApply: method("fleet-apply", ts(tU32, tString, tString, tU64, tU64, listOf(tU8)),
		ts(resultOf(nil, tLoadError))),
	fnFleetInspect: method("fleet-inspect", ts(listOf(tU8)), ts(resultOf(tString, tLoadError))),
	fnExecNew:      newFuncSig(ifaceEngineAPI+"#[constructor]executor", ts(tExecutorConfig), ts(tOwnExecutor)),
	fnExecRegister: xmethod("register", ts(tString), nil),
	fnExecRunning:  xmethod("running", nil, ts(tU32)),
	fnExecFeed:     xmethod("feed", ts(tBorrowEngine, tU64, tExecEvent), ts(listOf(tExecCommand))),
	fnExecForget:   xmethod("forget", ts(tS64), nil),
	fnExecOperator: newFuncSig(ifaceEngineAPI+"#[static]executor.operator",
		ts(tBorrowEngine, tS64, listOf(tU8), tBool, tU64), ts(resultOf(tRowWrite, tLoadError))),
	fnStartUnkeyed: newFuncSig(ifaceEngineAPI+"#start-unkeyed", ts(tU32, tU64, tU32, tU32, tU64, tU64, tU64, tU64),
		ts(tU64)),
}

const (
	exportDtor    = ifaceEngineAPI + "#[dtor]engine"
	exportRealloc = "cabi_realloc"
	exportMemory  = "memory"
	postPrefix    = "cabi_post_"
)

// handleTable is the component instance's table of `engine` handles, which
// the core module manages through the `[resource-*]engine` imports. Index 0
// is never used, as in the Canonical ABI.
type handleTable struct {
	// the resource's name, for errors ("" is engine)
	resource string
	mu       sync.Mutex
	reps     []uint32 // index = handle; value = rep
	used     []bool
	free     []uint32
}

func (t *handleTable) name() string {
	if t.resource == "" {
		return "engine"
	}
	return t.resource
}

func (t *handleTable) reset() {
	t.mu.Lock()
	t.reps, t.used, t.free = []uint32{0}, []bool{false}, nil
	t.mu.Unlock()
}

func (t *handleTable) add(rep uint32) uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n := len(t.free); n > 0 {
		h := t.free[n-1]
		t.free = t.free[:n-1]
		t.reps[h], t.used[h] = rep, true
		return h
	}
	t.reps = append(t.reps, rep)
	t.used = append(t.used, true)
	return uint32(len(t.reps) - 1)
}

func (t *handleTable) get(h uint32) (uint32, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if h == 0 || int(h) >= len(t.reps) || !t.used[h] {
		return 0, trapf("unknown %s handle %d", t.name(), h)
	}
	return t.reps[h], nil
}

func (t *handleTable) remove(h uint32) (uint32, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if h == 0 || int(h) >= len(t.reps) || !t.used[h] {
		return 0, trapf("unknown %s handle %d", t.name(), h)
	}
	rep := t.reps[h]
	t.used[h] = false
	t.free = append(t.free, h)
	return rep, nil
}

// defineResourceImports provides `[resource-new]`, `[resource-rep]` and
// `[resource-drop]` for `engine` and `executor` (canon resource.new / resource.rep /
// resource.drop), each resource with its own table.
func defineResourceImports(ctx context.Context, r wazero.Runtime, table, xtable *handleTable) error {
	b := r.NewHostModuleBuilder(importResourceModule)
	for _, res := range []struct {
		name  string
		table *handleTable
		dtor  string
	}{{"engine", table, exportDtor}, {"executor", xtable, exportExecDtor}} {
		t, dtorName := res.table, res.dtor
		b.NewFunctionBuilder().WithGoFunction(api.GoFunc(func(_ context.Context, stack []uint64) {
			stack[0] = uint64(t.add(api.DecodeU32(stack[0])))
		}), []api.ValueType{api.ValueTypeI32}, []api.ValueType{api.ValueTypeI32}).Export("[resource-new]" + res.name)
		b.NewFunctionBuilder().WithGoFunction(api.GoFunc(func(_ context.Context, stack []uint64) {
			rep, err := t.get(api.DecodeU32(stack[0]))
			if err != nil {
				panic(err)
			}
			stack[0] = uint64(rep)
		}), []api.ValueType{api.ValueTypeI32}, []api.ValueType{api.ValueTypeI32}).Export("[resource-rep]" + res.name)
		b.NewFunctionBuilder().WithGoModuleFunction(api.GoModuleFunc(func(ctx context.Context, m api.Module, stack []uint64) {
			rep, err := t.remove(api.DecodeU32(stack[0]))
			if err != nil {
				panic(err)
			}
			// An owned handle of the instance's own resource type: run its destructor.
			if dtor := m.ExportedFunction(dtorName); dtor != nil {
				if _, err := dtor.Call(ctx, uint64(rep)); err != nil {
					panic(err)
				}
			}
		}), []api.ValueType{api.ValueTypeI32}, nil).Export("[resource-drop]" + res.name)
	}
	_, err := b.Instantiate(ctx)
	return err
}

// instance is one instantiation of the core module, with its functions resolved
// and checked against the flattened WIT signatures. Not safe for concurrent use.
type instance struct {
	mod     api.Module
	memory  api.Memory
	realloc api.Function
	fns     [nFuncs]api.Function
	post    [nFuncs]api.Function // nil when the core module exports no post-return for it
	dtor    api.Function
	table   *handleTable
	// the executor resource's destructor and handle table (durable_abi.go)
	xdtor  api.Function
	xtable *handleTable
	stack  [maxFlatParams]uint64
	// the fused adapter for keyed starts (adapter.go) and its scratch buffer in guest memory
	adapter    api.Module
	fusedStart api.Function
	scratch    uint32
	scratchCap uint32
	// the interrupt global (interrupt.go); nil when the module is not instrumented
	interrupt api.MutableGlobal
}

// maxScratch bounds the scratch buffer; longer keys take the two-call path.
const maxScratch = 4096

// checkModule verifies a compiled core module against the WIT before it is used.
func checkModule(cm wazero.CompiledModule) error {
	exports := cm.ExportedFunctions()
	for _, s := range sigs {
		def, ok := exports[s.export]
		if !ok {
			return fmt.Errorf("levee: core module lacks export %q", s.export)
		}
		if err := s.checkAgainst(def); err != nil {
			return err
		}
		if s.paramsInMemory {
			return fmt.Errorf("levee: %s passes params in memory, which this host does not lower", s.export)
		}
		if p, ok := exports[postPrefix+s.export]; ok {
			pt := p.ParamTypes()
			if len(pt) != len(s.flatResults) || len(p.ResultTypes()) != 0 {
				return fmt.Errorf("levee: post-return %q has params %v, want the results %v", p.Name(), pt, s.flatResults)
			}
		}
	}
	r, ok := exports[exportRealloc]
	if !ok || len(r.ParamTypes()) != 4 || len(r.ResultTypes()) != 1 {
		return fmt.Errorf("levee: core module lacks cabi_realloc(i32, i32, i32, i32) -> i32")
	}
	if _, ok := cm.ExportedMemories()[exportMemory]; !ok {
		return fmt.Errorf("levee: core module exports no memory")
	}
	for _, imp := range cm.ImportedFunctions() {
		mod, name, _ := imp.Import()
		if mod != importResourceModule {
			return fmt.Errorf("levee: core module imports %s.%s; a Levee core has no imports but its resource's", mod, name)
		}
	}
	return nil
}

func newInstance(ctx context.Context, r wazero.Runtime, cm, adapter wazero.CompiledModule, table, xtable *handleTable) (*instance, error) {
	table.reset()
	xtable.reset()
	mod, err := r.InstantiateModule(ctx, cm, wazero.NewModuleConfig().WithName(coreModuleName).WithStartFunctions())
	if err != nil {
		return nil, err
	}
	in := &instance{mod: mod, memory: mod.ExportedMemory(exportMemory), realloc: mod.ExportedFunction(exportRealloc), table: table,
		xtable: xtable}
	for i, s := range sigs {
		in.fns[i] = mod.ExportedFunction(s.export)
		in.post[i] = mod.ExportedFunction(postPrefix + s.export) // nil if absent
	}
	in.dtor = mod.ExportedFunction(exportDtor)
	in.xdtor = mod.ExportedFunction(exportExecDtor)
	if g, ok := mod.ExportedGlobal(interruptExport).(api.MutableGlobal); ok {
		in.interrupt = g
	}
	if adapter != nil {
		am, err := r.InstantiateModule(ctx, adapter, wazero.NewModuleConfig().WithName("").WithStartFunctions())
		if err != nil {
			_ = mod.Close(ctx)
			return nil, err
		}
		in.adapter, in.fusedStart = am, am.ExportedFunction("start")
	}
	return in, nil
}

func (in *instance) close(ctx context.Context) {
	if in.adapter != nil {
		_ = in.adapter.Close(ctx)
	}
	_ = in.mod.Close(ctx)
}

// call runs a core function with flat params; results land in in.stack.
func (in *instance) call(ctx context.Context, fn int, params ...uint64) error {
	copy(in.stack[:], params)
	return in.fns[fn].CallWithStack(ctx, in.stack[:])
}

func (in *instance) view() mem {
	b, _ := in.memory.Read(0, in.memory.Size())
	return mem{b: b}
}

// lowerBytes allocates with cabi_realloc(0, 0, 1, len) and copies b into the guest
// (store_string_copy for UTF-8 strings; store_list for list<u8>). A zero-length
// value gets pointer 1 without a call: no byte of it is ever read.
func (in *instance) lowerBytes(ctx context.Context, s string, b []byte) (uint32, uint32, error) {
	n := len(s) + len(b)
	if n == 0 {
		return 1, 0, nil
	}
	if n > maxStringByteLength {
		return 0, 0, fmt.Errorf("levee: value of %d bytes is too long for the Canonical ABI", n)
	}
	var st [4]uint64
	st[0], st[1], st[2], st[3] = 0, 0, 1, uint64(n)
	if err := in.realloc.CallWithStack(ctx, st[:]); err != nil {
		return 0, 0, err
	}
	ptr := api.DecodeU32(st[0])
	if uint64(ptr)+uint64(n) > uint64(in.memory.Size()) {
		return 0, 0, trapf("cabi_realloc returned %d for %d bytes, out of bounds", ptr, n)
	}
	if s != "" {
		in.memory.WriteString(ptr, s)
	} else {
		in.memory.Write(ptr, b)
	}
	return ptr, uint32(n), nil
}

// liftRet reads the results a retptr function left at the returned pointer,
// then runs its post-return (which frees what the guest lent).
func (in *instance) liftRet(ctx context.Context, fn int) (any, error) {
	ptr := api.DecodeU32(in.stack[0])
	t := sigs[fn].results[0]
	v, err := in.view().loadChecked(ptr, t)
	if err != nil {
		return nil, err
	}
	if p := in.post[fn]; p != nil {
		var st [1]uint64
		st[0] = uint64(ptr)
		if err := p.CallWithStack(ctx, st[:]); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// --- typed conversions of lifted values ---

func asLoadError(v any) LoadError {
	f := v.([]any)
	return LoadError{Path: f[0].(string), Message: f[1].(string)}
}

func asLoadErrors(v any) []LoadError { return asList(v, asLoadError) }

// asList converts a lifted list, each element with conv.
func asList[T any](v any, conv func(any) T) []T {
	l := v.([]any)
	out := make([]T, len(l))
	for i, e := range l {
		out[i] = conv(e)
	}
	return out
}

func asEvent(v any) Event {
	f := v.([]any)
	return Event{
		At: f[0].(uint64), Kind: EventKind(f[1].(variantVal).disc), Policy: f[2].(uint32),
		Key: f[3].(string), Call: f[4].(uint64), Attempt: f[5].(uint32),
		Reason: Reason(f[6].(variantVal).disc), Duration: f[7].(uint64),
		StateFrom: BreakerState(f[8].(variantVal).disc), StateTo: BreakerState(f[9].(variantVal).disc),
		Name: f[10].(string), Value: f[11].(int64),
	}
}

func asPolicyInfo(v any) PolicyInfo {
	f := v.([]any)
	fb := f[4].([]any)
	names := make([]string, len(fb))
	for i, n := range fb {
		names[i] = n.(string)
	}
	return PolicyInfo{Name: f[0].(string), MaxAttempts: f[1].(uint32), AttemptTimeout: f[2].(uint64),
		Deadline: f[3].(uint64), Fallbacks: names}
}

func asCallInfo(v any) CallInfo {
	f := v.([]any)
	return CallInfo{Policy: f[0].(uint32), Key: f[1].(string), Attempts: f[2].(uint32), Deadline: f[3].(uint64),
		LastReason: Reason(f[4].(variantVal).disc), InFlight: f[5].(bool)}
}

func asAnalysis(v any) Analysis {
	f := v.([]any)
	a := Analysis{WorstAttempts: f[0].(uint32), Amplification: f[2].(float64), AmplificationWithBudget: f[3].(float64)}
	if o := f[1].(variantVal); o.disc == 1 {
		wl := o.payload.(uint64)
		a.WorstLatency = &wl
	}
	return a
}

// --- the WIT functions ---

// load is `[static]engine.load`: it returns the engine's rep (the own handle is
// lifted out of the instance's table, as lift_own does), or the load errors.
func (in *instance) load(ctx context.Context, document string, seed uint64) (uint32, []LoadError, error) {
	p, n, err := in.lowerBytes(ctx, document, nil)
	if err != nil {
		return 0, nil, err
	}
	if err := in.call(ctx, fnLoad, uint64(p), uint64(n), seed); err != nil {
		return 0, nil, err
	}
	v, err := in.liftRet(ctx, fnLoad)
	if err != nil {
		return 0, nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		return 0, asLoadErrors(r.payload), nil
	}
	rep, err := in.table.remove(r.payload.(uint32))
	if err != nil {
		return 0, nil, err
	}
	return rep, nil, nil
}

func (in *instance) drop(ctx context.Context, rep uint32) error {
	if in.dtor == nil {
		return nil
	}
	_, err := in.dtor.Call(ctx, uint64(rep))
	return err
}

func (in *instance) reload(ctx context.Context, rep uint32, document string) ([]LoadError, error) {
	p, n, err := in.lowerBytes(ctx, document, nil)
	if err != nil {
		return nil, err
	}
	if err := in.call(ctx, fnReload, uint64(rep), uint64(p), uint64(n)); err != nil {
		return nil, err
	}
	v, err := in.liftRet(ctx, fnReload)
	if err != nil {
		return nil, err
	}
	if r := v.(variantVal); r.disc == 1 {
		return asLoadErrors(r.payload), nil
	}
	return nil, nil
}

func (in *instance) policyCount(ctx context.Context, rep uint32) (uint32, error) {
	if err := in.call(ctx, fnPolicyCount, uint64(rep)); err != nil {
		return 0, err
	}
	return api.DecodeU32(in.stack[0]), nil
}

// listCall calls fn and converts the list it returns, each element with conv.
func listCall[T any](ctx context.Context, in *instance, fn int, conv func(any) T, params ...uint64) ([]T, error) {
	if err := in.call(ctx, fn, params...); err != nil {
		return nil, err
	}
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return nil, err
	}
	return asList(v, conv), nil
}

func (in *instance) optionCall(ctx context.Context, fn int, params ...uint64) (any, bool, error) {
	if err := in.call(ctx, fn, params...); err != nil {
		return nil, false, err
	}
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return nil, false, err
	}
	o := v.(variantVal)
	return o.payload, o.disc == 1, nil
}

func (in *instance) policyIndex(ctx context.Context, rep uint32, name string) (uint32, bool, error) {
	p, n, err := in.lowerBytes(ctx, name, nil)
	if err != nil {
		return 0, false, err
	}
	v, ok, err := in.optionCall(ctx, fnPolicyIndex, uint64(rep), uint64(p), uint64(n))
	if !ok || err != nil {
		return 0, false, err
	}
	return v.(uint32), true, nil
}

func (in *instance) policyInfo(ctx context.Context, rep, policy uint32) (PolicyInfo, bool, error) {
	v, ok, err := in.optionCall(ctx, fnPolicyInfo, uint64(rep), uint64(policy))
	if !ok || err != nil {
		return PolicyInfo{}, false, err
	}
	return asPolicyInfo(v), true, nil
}

func (in *instance) policyJSON(ctx context.Context, rep, policy uint32) (string, bool, error) {
	v, ok, err := in.optionCall(ctx, fnPolicyJSON, uint64(rep), uint64(policy))
	if !ok || err != nil {
		return "", false, err
	}
	return v.(string), true, nil
}

func (in *instance) analyze(ctx context.Context, rep, policy, layers uint32) (Analysis, bool, error) {
	v, ok, err := in.optionCall(ctx, fnAnalyze, uint64(rep), uint64(policy), uint64(layers))
	if !ok || err != nil {
		return Analysis{}, false, err
	}
	return asAnalysis(v), true, nil
}

// start, acquire, report, report-fallback: primitives in, one u64 out (the hot path).
func (in *instance) start(ctx context.Context, rep uint32, call uint64, policy uint32, key string, flags uint32,
	now, settleCall, settleAt, settleElapsed uint64) (Verdict, error) {
	st := &in.stack
	fn := in.fns[fnStart]
	var p, n uint32
	if key != "" && in.fusedStart != nil && len(key) <= maxScratch {
		// One call: the adapter lowers the key from the scratch buffer (adapter.go).
		if uint32(len(key)) > in.scratchCap {
			if err := in.growScratch(ctx, uint32(len(key))); err != nil {
				return 0, err
			}
		}
		if !in.memory.WriteString(in.scratch, key) {
			return 0, trapf("scratch buffer at %d out of bounds", in.scratch)
		}
		fn, p, n = in.fusedStart, in.scratch, uint32(len(key))
	} else if key == "" {
		p, n = 1, 0 // as lowerBytes gives a zero-length value, without the call
	} else {
		var err error
		if p, n, err = in.lowerBytes(ctx, key, nil); err != nil {
			return 0, err
		}
	}
	st[0], st[1], st[2], st[3], st[4], st[5] = uint64(rep), call, uint64(policy), uint64(p), uint64(n), uint64(flags)
	st[6], st[7], st[8], st[9] = now, settleCall, settleAt, settleElapsed
	if err := fn.CallWithStack(ctx, st[:]); err != nil {
		return 0, err
	}
	return Verdict(st[0]), nil
}

// growScratch (re)allocates the host's scratch buffer in the guest with cabi_realloc.
func (in *instance) growScratch(ctx context.Context, need uint32) error {
	c := max(uint32(64), in.scratchCap)
	for c < need {
		c *= 2
	}
	c = min(c, maxScratch)
	var st [4]uint64
	st[0], st[1], st[2], st[3] = uint64(in.scratch), uint64(in.scratchCap), 1, uint64(c)
	if err := in.realloc.CallWithStack(ctx, st[:]); err != nil {
		return err
	}
	ptr := api.DecodeU32(st[0])
	if uint64(ptr)+uint64(c) > uint64(in.memory.Size()) {
		return trapf("cabi_realloc returned %d for %d bytes, out of bounds", ptr, c)
	}
	in.scratch, in.scratchCap = ptr, c
	return nil
}

func (in *instance) acquire(ctx context.Context, rep uint32, call, now uint64) (Verdict, error) {
	st := &in.stack
	st[0], st[1], st[2] = uint64(rep), call, now
	if err := in.fns[fnAcquire].CallWithStack(ctx, st[:]); err != nil {
		return 0, err
	}
	return Verdict(st[0]), nil
}

func (in *instance) report(ctx context.Context, rep uint32, call, now, elapsed uint64, kind OutcomeKind, code int32,
	text string, wallSecs uint64, flags uint32) (Verdict, error) {
	p, n, err := in.lowerBytes(ctx, text, nil)
	if err != nil {
		return 0, err
	}
	st := &in.stack
	st[0], st[1], st[2], st[3], st[4] = uint64(rep), call, now, elapsed, uint64(kind)
	st[5], st[6], st[7], st[8], st[9] = api.EncodeI32(code), uint64(p), uint64(n), wallSecs, uint64(flags)
	if err := in.fns[fnReport].CallWithStack(ctx, st[:]); err != nil {
		return 0, err
	}
	return Verdict(st[0]), nil
}

func (in *instance) reportFallback(ctx context.Context, rep uint32, call, now uint64, ok bool) (Verdict, error) {
	b := uint64(0)
	if ok {
		b = 1
	}
	st := &in.stack
	st[0], st[1], st[2], st[3] = uint64(rep), call, now, b
	if err := in.fns[fnReportFallback].CallWithStack(ctx, st[:]); err != nil {
		return 0, err
	}
	return Verdict(st[0]), nil
}

// maxHedgeCommands bounds the commands of one hedge-answer: the core answers at most a
// start or a cancel per attempt (11 at most), a wait and an end. A longer list is a
// guest fault, refused before anything is allocated for it.
const maxHedgeCommands = 2*11 + 2

// hedgeStep is `hedge-step`; the answer is lifted and checked by liftHedgeAnswer.
func (in *instance) hedgeStep(ctx context.Context, rep uint32, call, now uint64) (HedgeAnswer, error) {
	st := &in.stack
	st[0], st[1], st[2] = uint64(rep), call, now
	if err := in.fns[fnHedgeStep].CallWithStack(ctx, st[:]); err != nil {
		return HedgeAnswer{}, err
	}
	return in.liftHedgeAnswer(ctx, fnHedgeStep)
}

// reportAttempt is `report-attempt`.
func (in *instance) reportAttempt(ctx context.Context, rep uint32, call uint64, attempt uint32, now, elapsed uint64,
	kind OutcomeKind, code int32, text string, wallSecs uint64, flags uint32) (HedgeAnswer, error) {
	p, n, err := in.lowerBytes(ctx, text, nil)
	if err != nil {
		return HedgeAnswer{}, err
	}
	st := &in.stack
	st[0], st[1], st[2], st[3], st[4], st[5] = uint64(rep), call, uint64(attempt), now, elapsed, uint64(kind)
	st[6], st[7], st[8], st[9], st[10] = api.EncodeI32(code), uint64(p), uint64(n), wallSecs, uint64(flags)
	if err := in.fns[fnReportAttempt].CallWithStack(ctx, st[:]); err != nil {
		return HedgeAnswer{}, err
	}
	return in.liftHedgeAnswer(ctx, fnReportAttempt)
}

// liftHedgeAnswer lifts the hedge-answer a retptr function left, as drainEvents lifts its
// list: the record, the list's bounds and alignment and each variant's discriminant are
// checked by the Canonical ABI loads; the list's length is bounded before it is read.
func (in *instance) liftHedgeAnswer(ctx context.Context, fn int) (HedgeAnswer, error) {
	ptr := api.DecodeU32(in.stack[0])
	m := in.view()
	if err := m.check(ptr, tHedgeAnswer.size, tHedgeAnswer.align); err != nil {
		return HedgeAnswer{}, err
	}
	if n := m.u32(ptr + uint32(tHedgeAnswer.offsets[0]) + 4); n > maxHedgeCommands {
		return HedgeAnswer{}, trapf("hedge-answer with %d commands (at most %d)", n, maxHedgeCommands)
	}
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return HedgeAnswer{}, err
	}
	f := v.([]any)
	l := f[0].([]any)
	a := HedgeAnswer{Commands: make([]HedgeCommand, len(l)), EventsPending: f[1].(bool)}
	for i, c := range l {
		cv := c.(variantVal)
		hc := HedgeCommand{Kind: HedgeCommandKind(cv.disc)}
		switch hc.Kind {
		case HedgeStart:
			r := cv.payload.([]any)
			hc.Attempt, hc.Timeout = r[0].(uint32), r[1].(uint64)
		case HedgeCancel:
			hc.Attempt = cv.payload.(uint32)
		case HedgeWait:
			hc.Delay = cv.payload.(uint64)
		case HedgeEnd:
			r := cv.payload.([]any)
			hc.Attempt, hc.Verdict = r[0].(uint32), Verdict(r[1].(uint64))
		}
		a.Commands[i] = hc
	}
	return a, nil
}

func (in *instance) cancel(ctx context.Context, rep uint32, call, now uint64) error {
	return in.call(ctx, fnCancel, uint64(rep), call, now)
}

// takeWakes lifts the calls granted a bulkhead slot since the last take, in grant order.
func (in *instance) takeWakes(ctx context.Context, rep uint32) ([]uint64, error) {
	return listCall(ctx, in, fnTakeWakes, func(c any) uint64 { return c.(uint64) }, uint64(rep))
}

func (in *instance) callInfo(ctx context.Context, rep uint32, call uint64) (CallInfo, bool, error) {
	v, ok, err := in.optionCall(ctx, fnCallInfo, uint64(rep), call)
	if !ok || err != nil {
		return CallInfo{}, false, err
	}
	return asCallInfo(v), true, nil
}

func (in *instance) drainEvents(ctx context.Context, rep uint32) ([]Event, error) {
	return listCall(ctx, in, fnDrainEvents, asEvent, uint64(rep))
}

func (in *instance) breakerState(ctx context.Context, rep, policy uint32, key string, now uint64) (BreakerState, bool, error) {
	p, n, err := in.lowerBytes(ctx, key, nil)
	if err != nil {
		return 0, false, err
	}
	v, ok, err := in.optionCall(ctx, fnBreakerState, uint64(rep), uint64(policy), uint64(p), uint64(n), now)
	if !ok || err != nil {
		return 0, false, err
	}
	return BreakerState(v.(variantVal).disc), true, nil
}

// setBreakerState returns the guest's error message ("" when ok).
func (in *instance) setBreakerState(ctx context.Context, rep, policy uint32, key string, state BreakerState, now uint64) (string, bool, error) {
	p, n, err := in.lowerBytes(ctx, key, nil)
	if err != nil {
		return "", false, err
	}
	if err := in.call(ctx, fnSetBreakerState, uint64(rep), uint64(policy), uint64(p), uint64(n), uint64(state), now); err != nil {
		return "", false, err
	}
	v, err := in.liftRet(ctx, fnSetBreakerState)
	if err != nil {
		return "", false, err
	}
	if r := v.(variantVal); r.disc == 1 {
		return r.payload.(string), false, nil
	}
	return "", true, nil
}

// exportState is export-state, page by page (exportPages).
func (in *instance) exportState(ctx context.Context, rep uint32) ([]byte, error) {
	return in.exportPages(ctx, rep, false)
}

// exportSnapshot is export-state restricted to the keys that hold protection (the
// recovery snapshot): same format, readable by import-state. Page by page.
func (in *instance) exportSnapshot(ctx context.Context, rep uint32) ([]byte, error) {
	return in.exportPages(ctx, rep, true)
}

// exportPages calls export-state-page from cursor 0 until the document is complete:
// each crossing copies at most cGuardStatePageBytes and the guest never holds the
// whole document (docs/hosts.md, "State of any size"). The caller holds the engine's
// lock across the pages. A page over its bound, or a cursor that does not move on by
// the page's bytes, breaks the contract: a trap, recovered from as one.
func (in *instance) exportPages(ctx context.Context, rep uint32, snapshot bool) ([]byte, error) {
	var out []byte
	var cursor uint64
	flag := uint64(0)
	if snapshot {
		flag = 1
	}
	for {
		if err := in.call(ctx, fnExportStatePage, uint64(rep), cursor, flag); err != nil {
			return nil, err
		}
		v, err := in.liftRet(ctx, fnExportStatePage)
		if err != nil {
			return nil, err
		}
		f := v.([]any)
		page, _ := f[0].([]byte)
		next, _ := f[1].(uint64)
		n := uint64(len(page))
		if n > cGuardStatePageBytes || (next != 0 && (n == 0 || next != cursor+n)) {
			return nil, trapf("export-state-page broke the contract: %d bytes from cursor %d, next %d", n, cursor, next)
		}
		out = append(out, page...)
		if next == 0 {
			return out, nil
		}
		cursor = next
	}
}

// importState is import-state-begin, the state in pages of at most
// cGuardStatePageBytes (import-state-page), import-state-end: a state of any size;
// on a *LoadError nothing changed.
func (in *instance) importState(ctx context.Context, rep uint32, state []byte) (*LoadError, error) {
	if err := in.call(ctx, fnImportStateBegin, uint64(rep)); err != nil {
		return nil, err
	}
	for at := 0; at < len(state); at += cGuardStatePageBytes {
		page := state[at:min(at+cGuardStatePageBytes, len(state))]
		p, n, err := in.lowerBytes(ctx, "", page)
		if err != nil {
			return nil, err
		}
		if err := in.call(ctx, fnImportStatePage, uint64(rep), uint64(p), uint64(n)); err != nil {
			return nil, err
		}
		if lerr, err := in.liftLoadResult(ctx, fnImportStatePage); lerr != nil || err != nil {
			return lerr, err
		}
	}
	if err := in.call(ctx, fnImportStateEnd, uint64(rep)); err != nil {
		return nil, err
	}
	return in.liftLoadResult(ctx, fnImportStateEnd)
}

// liftLoadResult lifts the result<_, load-error> of fn.
func (in *instance) liftLoadResult(ctx context.Context, fn int) (*LoadError, error) {
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return nil, err
	}
	if r := v.(variantVal); r.disc == 1 {
		le := asLoadError(r.payload)
		return &le, nil
	}
	return nil, nil
}

// --- durable calls (docs/durable.md) ---

func asDurableStep(v any) DurableStep {
	f := v.([]any)
	b, _ := f[8].([]byte)
	return DurableStep{
		Action: DurableAction(f[0].(variantVal).disc), Attempt: f[1].(uint32), Wait: f[2].(uint64),
		Timeout: f[3].(uint64), NextAt: f[4].(uint64), LeaseUntil: f[5].(uint64),
		Reason: DurableReason(f[6].(variantVal).disc), PolicyChanged: f[7].(bool), Record: append([]byte(nil), b...),
	}
}

// durableCall runs a durable-* function whose flat parameters are built by params (which
// may lower strings and lists first) and lifts its result<durable-step, load-error>.
func (in *instance) durableCall(ctx context.Context, fn int, params []uint64) (DurableStep, *LoadError, error) {
	if err := in.call(ctx, fn, params...); err != nil {
		return DurableStep{}, nil, err
	}
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return DurableStep{}, nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		le := asLoadError(r.payload)
		return DurableStep{}, &le, nil
	}
	return asDurableStep(r.payload), nil, nil
}

// lowerAll lowers strings and byte lists in order, returning (ptr, len) pairs.
func (in *instance) lowerAll(ctx context.Context, vals ...any) ([]uint64, error) {
	out := make([]uint64, 0, 2*len(vals))
	for _, v := range vals {
		var p, n uint32
		var err error
		switch x := v.(type) {
		case string:
			p, n, err = in.lowerBytes(ctx, x, nil)
		case []byte:
			if len(x) > math.MaxInt32 {
				return nil, fmt.Errorf("levee: record of %d bytes is too long", len(x))
			}
			p, n, err = in.lowerBytes(ctx, "", x)
		}
		if err != nil {
			return nil, err
		}
		out = append(out, uint64(p), uint64(n))
	}
	return out, nil
}

func (in *instance) durableBegin(ctx context.Context, rep, policy uint32, key, idem string, flags uint32,
	wallNow uint64) (DurableStep, *LoadError, error) {
	l, err := in.lowerAll(ctx, key, idem)
	if err != nil {
		return DurableStep{}, nil, err
	}
	return in.durableCall(ctx, fnDurableBegin, []uint64{uint64(rep), uint64(policy), l[0], l[1], l[2], l[3], uint64(flags), wallNow})
}

func (in *instance) durableStep(ctx context.Context, fn int, rep uint32, record []byte, owner string,
	wallNow, elapsed uint64) (DurableStep, *LoadError, error) {
	l, err := in.lowerAll(ctx, record, owner)
	if err != nil {
		return DurableStep{}, nil, err
	}
	return in.durableCall(ctx, fn, []uint64{uint64(rep), l[0], l[1], l[2], l[3], wallNow, elapsed})
}

func (in *instance) durableOutcome(ctx context.Context, rep uint32, record []byte, owner string, wallNow, elapsed uint64,
	kind OutcomeKind, code int32, text, message string, flags uint32) (DurableStep, *LoadError, error) {
	l, err := in.lowerAll(ctx, record, owner, text, message)
	if err != nil {
		return DurableStep{}, nil, err
	}
	return in.durableCall(ctx, fnDurableOutcome, []uint64{uint64(rep), l[0], l[1], l[2], l[3], wallNow, elapsed,
		uint64(kind), uint64(uint32(code)), l[4], l[5], l[6], l[7], uint64(flags)})
}

func (in *instance) durableFinal(ctx context.Context, fn int, rep uint32, record []byte, wallNow uint64) (DurableStep, *LoadError, error) {
	l, err := in.lowerAll(ctx, record)
	if err != nil {
		return DurableStep{}, nil, err
	}
	return in.durableCall(ctx, fn, []uint64{uint64(rep), l[0], l[1], wallNow})
}

func (in *instance) durableInspect(ctx context.Context, rep uint32, record []byte) (string, *LoadError, error) {
	l, err := in.lowerAll(ctx, record)
	if err != nil {
		return "", nil, err
	}
	if err := in.call(ctx, fnDurableInspect, uint64(rep), l[0], l[1]); err != nil {
		return "", nil, err
	}
	v, err := in.liftRet(ctx, fnDurableInspect)
	if err != nil {
		return "", nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		le := asLoadError(r.payload)
		return "", &le, nil
	}
	return r.payload.(string), nil, nil
}
