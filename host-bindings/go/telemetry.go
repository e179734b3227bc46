package levee

import (
	"context"
	"fmt"
	"log/slog"
	"time"
)

// Telemetry is the sink of docs/telemetry.md: the events, counters, histograms
// and gauges of one schema that every Levee host emits, with the same names,
// units (seconds) and attributes. Package leveeotel adapts it to OpenTelemetry
// (metrics and, through Tracer, spans); a test can record it as it is.
//
// The methods are called outside the engine's lock, from the goroutines of the
// calls, in the order each call makes them; they must be safe for concurrent use.
//
// ctx is the context of the call whose crossing or attempt produced the entry
// (its span's, under a Tracer), or context.Background() for what no call made
// (an event drained by Flush, Close or another Engine method).
type Telemetry interface {
	// Event is an event (the core's, in the order it recorded them, or engine-fault).
	Event(ctx context.Context, name string, attrs []slog.Attr)
	// Add is a counter increment.
	Add(ctx context.Context, counter string, value int64, attrs []slog.Attr)
	// Record is a histogram sample (seconds for the durations of the schema).
	Record(ctx context.Context, histogram string, value float64, attrs []slog.Attr)
	// Gauge is a gauge's new value.
	Gauge(ctx context.Context, gauge string, value int64, attrs []slog.Attr)
}

// Tracer is implemented by a Telemetry that also records spans: `levee.call`
// per call and `levee.attempt` per attempt, a child of the call's span. The
// context an attempt runs under is the one StartSpan returns.
type Tracer interface {
	StartSpan(ctx context.Context, name string, attrs []slog.Attr) (context.Context, Span)
}

// The span names of the schema (docs/telemetry.md; the contract's data), for a Tracer that
// treats them apart (leveeotel makes SpanCall a client span).
const (
	SpanCall    = cSpanCall
	SpanAttempt = cSpanAttempt
)

// Span is a span a Tracer started.
type Span interface {
	SetAttributes(attrs ...slog.Attr)
	// End ends the span; a non-nil err marks it as an error.
	End(err error)
}

// WithTelemetry sends the schema of docs/telemetry.md to t (and spans, when t is
// also a Tracer). Without it, nothing is built for telemetry on the call path.
func WithTelemetry(t Telemetry) Option {
	return func(o *options) {
		o.tel = t
		o.tracer, _ = t.(Tracer)
	}
}

// Instrument is one metric instrument of the schema (docs/telemetry.md): its name, its
// kind ("counter", "histogram" or "gauge"), its unit (UCUM: "s", "{call}", "1") and its
// description, as the contract's data (wit/constants.json) gives them.
type Instrument struct {
	Name, Kind, Unit, Description string
}

// Instruments lists the schema's metric instruments, for a sink that creates them up front
// (the OpenTelemetry adapter, leveeotel, does).
func Instruments() []Instrument {
	out := make([]Instrument, len(cInstruments))
	for i, in := range cInstruments {
		out[i] = Instrument{Name: in[0], Kind: in[1], Unit: in[2], Description: in[3]}
	}
	return out
}

// WithoutBreakerKey drops `levee.key` from the `levee.breaker.state` gauge (keys
// can number in the millions: one time series per downstream host).
func WithoutBreakerKey() Option { return func(o *options) { o.noGaugeKey = true } }

// RetryInfo is what an OnRetry hook receives, before the sleep of each retry.
type RetryInfo struct {
	Policy, Key string
	// Attempt is the attempt that failed (1 for the first).
	Attempt int
	// Delay is the sleep about to start.
	Delay time.Duration
	// Err is what the failed attempt returned, when it was an error (nil for a
	// response of the Transport: see Result).
	Err error
	// Result is the response the failed attempt returned (the Transport's
	// *http.Response), nil otherwise.
	Result any
	// Reason is ReasonNone for a retry.
	Reason Reason
}

// OnRetry calls f before the sleep of each retry of this call (tenacity's
// before_sleep, failsafe-go's OnRetry). A hook that panics is logged and
// ignored: it never changes the call.
func OnRetry(f func(RetryInfo)) CallOption { return CallOption{kind: optOnRetry, onRetry: f} }

// WithPolicyOnRetry calls f before the sleep of each retry of every call of the
// named policy (a call's own OnRetry runs after it).
func WithPolicyOnRetry(policy string, f func(RetryInfo)) Option {
	return func(o *options) {
		if o.onRetry == nil {
			o.onRetry = map[string]func(RetryInfo){}
		}
		o.onRetry[policy] = f
	}
}

func (e *Engine) callHook(f func(RetryInfo), ri RetryInfo) {
	defer func() {
		if r := recover(); r != nil && e.o.logger != nil {
			e.o.logger.Warn("levee: an on_retry hook panicked (ignored)", slog.String("policy", ri.Policy),
				slog.String("panic", fmt.Sprint(r)))
		}
	}()
	f(ri)
}

func secs(ns uint64) float64 { return float64(ns) / 1e9 }

// telEvent sends one engine event to the sink, with the metrics it counts.
func (e *Engine) telEvent(ctx context.Context, t Telemetry, ev *Event) {
	policy := e.policyName(ev.Policy)
	name := ev.Kind.String()
	attrs := make([]slog.Attr, 0, 6)
	key := ev.Key
	if ev.Kind == EventKeyOverflow {
		key = ev.Name // the caller's key, not the shared entry's (docs/telemetry.md)
	}
	attrs = append(attrs, slog.String(cAttrPolicy, policy), slog.String(cAttrKey, key))
	if ev.Call != 0 {
		attrs = append(attrs, slog.Uint64(cAttrCall, ev.Call))
	}
	pol := []slog.Attr{slog.String(cAttrPolicy, policy)}
	switch ev.Kind {
	case EventRetryScheduled:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)), slog.Float64(cAttrDelay, secs(ev.Duration)))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricRetries, 1, pol)
		t.Record(ctx, cMetricRetryDelay, secs(ev.Duration), pol)
	case EventGaveUp:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)), slog.String(cAttrReason, ev.Reason.String()))
		t.Event(ctx, name, attrs)
	case EventRejected:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)), slog.String(cAttrReason, ev.Reason.String()),
			slog.Float64(cAttrDelay, secs(ev.Duration)))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricRejections, 1, []slog.Attr{slog.String(cAttrPolicy, policy), slog.String(cAttrReason, ev.Reason.String())})
	case EventBudgetRefused:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)), slog.Int64(cAttrBudgetLevel, ev.Value))
		t.Event(ctx, name, attrs)
	case EventBreakerTransition:
		attrs = append(attrs, slog.String(cAttrBreakerFrom, ev.StateFrom.String()), slog.String(cAttrBreakerTo, ev.StateTo.String()))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricBreakerTransitions, 1, []slog.Attr{slog.String(cAttrBreakerFrom, ev.StateFrom.String()),
			slog.String(cAttrBreakerTo, ev.StateTo.String()), slog.String(cAttrPolicy, policy)})
		g := []slog.Attr{slog.String(cAttrPolicy, policy)}
		if !e.o.noGaugeKey {
			g = []slog.Attr{slog.String(cAttrKey, ev.Key), slog.String(cAttrPolicy, policy)}
		}
		t.Gauge(ctx, cMetricBreakerState, int64(ev.StateTo), g)
	case EventFallbackChosen:
		attrs = append(attrs, slog.String(cAttrFallback, ev.Name), slog.String(cAttrReason, ev.Reason.String()))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricFallbacks, 1, []slog.Attr{slog.String(cAttrFallback, ev.Name), slog.String(cAttrPolicy, policy),
			slog.String(cAttrReason, ev.Reason.String())})
	case EventHedgeStarted:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricHedges, 1, pol)
	case EventRateLimitWait:
		attrs = append(attrs, slog.Int64(cAttrAttempt, int64(ev.Attempt)), slog.Float64(cAttrDelay, secs(ev.Duration)))
		t.Event(ctx, name, attrs)
	case EventEngineFault:
		attrs = append(attrs, slog.String(cAttrFault, ev.Fault))
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricEngineFaults, 1, []slog.Attr{slog.String(cAttrFault, ev.Fault)})
	case EventKeyEvicted:
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricKeysEvicted, 1, pol)
	case EventKeyOverflow:
		t.Event(ctx, name, attrs)
		t.Add(ctx, cMetricKeysOverflow, 1, pol)
	default: // call-evicted, permit-expired
		t.Event(ctx, name, attrs)
	}
}

// callTel is the telemetry of one call (nil when the engine has no sink).
type callTel struct {
	ctx    context.Context // the call's (with its span)
	t      Telemetry
	tr     Tracer
	policy string
	key    string
	span   Span
	pol    []slog.Attr // levee.policy alone
	http   bool
	lg     *slog.Logger // where a panic of the sink is reported
}

// recovered reports a panic of the sink (what it was doing) and ignores it: observer code
// never reaches the call (docs/hosts.md). Deferred by every method that calls the sink.
func (c *callTel) recovered(what string) {
	if r := recover(); r != nil && c.lg != nil {
		c.lg.Warn("levee: a telemetry sink panicked in "+what+" (ignored)", slog.String("policy", c.policy),
			slog.String("panic", fmt.Sprint(r)))
	}
}

func (e *Engine) startCallTel(ctx context.Context, policy, key string, http bool) (context.Context, *callTel) {
	t := e.o.tel
	if t == nil {
		return ctx, nil
	}
	c := &callTel{ctx: ctx, t: t, tr: e.o.tracer, policy: policy, key: key, http: http, pol: []slog.Attr{slog.String(cAttrPolicy, policy)},
		lg: e.o.logger}
	if c.tr != nil {
		if sctx, span := c.startSpan(ctx, cSpanCall, []slog.Attr{slog.String(cAttrPolicy, policy), slog.String(cAttrKey, key)}); sctx != nil {
			ctx, c.span, c.ctx = sctx, span, sctx
		}
	}
	return ctx, c
}

// startSpan is the tracer's StartSpan; a panic gives no span (nil, nil).
func (c *callTel) startSpan(ctx context.Context, name string, attrs []slog.Attr) (sctx context.Context, span Span) {
	defer c.recovered("StartSpan")
	return c.tr.StartSpan(ctx, name, attrs)
}

// attemptSpan starts the span of attempt n (degraded: of the recovery path).
func (c *callTel) attemptSpan(ctx context.Context, n int, degraded bool) (context.Context, Span) {
	if c == nil || c.tr == nil {
		return ctx, nil
	}
	attrs := []slog.Attr{slog.Int64(cAttrAttempt, int64(n))}
	if c.http && n > 1 {
		attrs = append(attrs, slog.Int64(cAttrResendCount, int64(n-1)))
	}
	if degraded {
		attrs = append(attrs, slog.Bool(cAttrDegraded, true))
	}
	if sctx, span := c.startSpan(ctx, cSpanAttempt, attrs); sctx != nil {
		return sctx, span
	}
	return ctx, nil
}

// endAttemptSpan ends the span of an attempt with its outcome.
func (c *callTel) endAttemptSpan(s Span, o Outcome, err error) {
	if s == nil {
		return
	}
	defer c.recovered("a span")
	s.SetAttributes(slog.String(cAttrOutcome, o.Kind.String()))
	if o.Kind == OutcomeSuccess {
		err = nil
	}
	s.End(err)
}

// reported counts an attempt reported to the core (or held back to be).
func (c *callTel) reported(o OutcomeKind, elapsed uint64) {
	if c == nil {
		return
	}
	defer c.recovered("Add or Record")
	attrs := []slog.Attr{slog.String(cAttrOutcome, o.String()), slog.String(cAttrPolicy, c.policy)}
	c.t.Add(c.ctx, cMetricAttempts, 1, attrs)
	c.t.Record(c.ctx, cMetricAttemptDuration, secs(elapsed), attrs)
}

// end counts the call's end: result is one of cResults; reason on failure.
func (c *callTel) end(result string, retried bool, reason Reason, err error) {
	if c == nil {
		return
	}
	defer c.recovered("the call's end")
	attrs := make([]slog.Attr, 0, 4)
	attrs = append(attrs, slog.String(cAttrPolicy, c.policy))
	if result == "failure" && reason != ReasonNone {
		attrs = append(attrs, slog.String(cAttrReason, reason.String()))
	}
	attrs = append(attrs, slog.String(cAttrResult, result), slog.Bool(cAttrRetried, retried))
	c.t.Add(c.ctx, cMetricCalls, 1, attrs)
	if c.span != nil {
		sa := []slog.Attr{slog.String(cAttrResult, result)}
		if reason != ReasonNone {
			sa = append(sa, slog.String(cAttrReason, reason.String()))
		}
		c.span.SetAttributes(sa...)
		if result == "success" || result == "fallback" {
			err = nil
		}
		c.span.End(err)
	}
}

// RetryAnswer is what a retry predicate says of an attempt (docs/hosts.md, section 9).
type RetryAnswer uint8

const (
	// Unset leaves the attempt to the policy's rules.
	Unset RetryAnswer = iota
	// Retry calls the attempt a failure to retry (a result, too).
	Retry
	// NoRetry says the attempt must not be retried (it wins over the policy's retry-on).
	NoRetry
)

// RetryIf sets this call's retry predicate (it wins over the policy's, see
// WithPolicyRetryIf): f sees each reported attempt's result (DoValue's value,
// the Transport's *http.Response, nil otherwise) or error, and its answer goes
// to the core as a report flag; the core puts it in place of the policy's
// retry-on and never-retry only (overload, pushback, idempotency, the attempts,
// Retry-After, the deadline and the budget still decide). A predicate that
// panics is logged and counts as Unset.
func RetryIf(f func(result any, err error) RetryAnswer) CallOption {
	return CallOption{kind: optRetryIf, retryIf: f}
}

// WithPolicyRetryIf sets the retry predicate of every call of the named policy
// (a call's RetryIf wins).
func WithPolicyRetryIf(policy string, f func(result any, err error) RetryAnswer) Option {
	return func(o *options) {
		if o.retryIf == nil {
			o.retryIf = map[string]func(any, error) RetryAnswer{}
		}
		o.retryIf[policy] = f
	}
}

// askPredicate is the report flags of the call's retry predicate for an attempt.
func (c *callRun) askPredicate(err error) (flags uint32) {
	f := c.co.retryIf
	if f == nil {
		if f = c.p.e.o.retryIf[c.p.name]; f == nil {
			return 0
		}
	}
	var result any
	if rr, ok := c.a.(interface{ lastResult() any }); ok {
		result = rr.lastResult()
	}
	return c.askPredicateWith(f, result, err)
}

// askPredicateFor is askPredicate for an attempt of a hedged call, whose result (res, as
// hedgedAttempter.hedged returned it) is its own.
func (c *callRun) askPredicateFor(res any, err error) uint32 {
	f := c.co.retryIf
	if f == nil {
		if f = c.p.e.o.retryIf[c.p.name]; f == nil {
			return 0
		}
	}
	switch r := res.(type) {
	case nil:
	case interface{ value() any }:
		res = r.value()
	}
	return c.askPredicateWith(f, res, err)
}

func (c *callRun) askPredicateWith(f func(any, error) RetryAnswer, result any, err error) (flags uint32) {
	defer func() {
		if r := recover(); r != nil {
			flags = 0
			if lg := c.p.e.o.logger; lg != nil {
				lg.Warn("levee: a retry predicate panicked (counted as unset)", slog.String("policy", c.p.name),
					slog.String("panic", fmt.Sprint(r)))
			}
		}
	}()
	switch f(result, err) {
	case Retry:
		return cReportCallerRetry
	case NoRetry:
		return cReportCallerNoRetry
	}
	return 0
}
