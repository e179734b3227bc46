// Package leveeotel sends Levee's telemetry (docs/telemetry.md) to OpenTelemetry:
// the counters, histograms and the breaker-state gauge through a
// metric.MeterProvider, the `levee.call` and `levee.attempt` spans through a
// trace.TracerProvider, and the events as span events of the current call's
// span (or dropped when no span records).
//
//	eng, err := levee.Load(ctx, doc, levee.WithTelemetry(leveeotel.New()))
//
// New uses the global providers (otel.GetMeterProvider, otel.GetTracerProvider)
// unless WithMeterProvider / WithTracerProvider name others. It lives in its own
// package so that a program that does not import it does not link OpenTelemetry.
package leveeotel

import (
	"context"
	"log/slog"
	"sync"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the meter and the tracer.
const ScopeName = "github.com/levee-dev/levee/host-bindings/go"

type config struct {
	mp metric.MeterProvider
	tp trace.TracerProvider
}

// Option configures New.
type Option func(*config)

// WithMeterProvider takes the instruments from mp (default: the global one).
func WithMeterProvider(mp metric.MeterProvider) Option { return func(c *config) { c.mp = mp } }

// WithTracerProvider starts the spans on tp (default: the global one).
func WithTracerProvider(tp trace.TracerProvider) Option { return func(c *config) { c.tp = tp } }

// Telemetry is a levee.Telemetry and levee.Tracer on OpenTelemetry.
type Telemetry struct {
	meter  metric.Meter
	tracer trace.Tracer

	mu       sync.RWMutex
	counters map[string]metric.Int64Counter
	hists    map[string]metric.Float64Histogram
	gauges   map[string]metric.Int64Gauge
}

// New builds the adapter; instruments that the meter refuses are skipped (the
// OpenTelemetry API never fails a caller over telemetry).
func New(opts ...Option) *Telemetry {
	c := config{}
	for _, o := range opts {
		o(&c)
	}
	if c.mp == nil {
		c.mp = otel.GetMeterProvider()
	}
	if c.tp == nil {
		c.tp = otel.GetTracerProvider()
	}
	t := &Telemetry{meter: c.mp.Meter(ScopeName, metric.WithInstrumentationVersion(levee.Version)),
		tracer:   c.tp.Tracer(ScopeName, trace.WithInstrumentationVersion(levee.Version)),
		counters: map[string]metric.Int64Counter{}, hists: map[string]metric.Float64Histogram{},
		gauges: map[string]metric.Int64Gauge{}}
	// the instruments of docs/telemetry.md, from the contract's data (wit/constants.json)
	for _, in := range levee.Instruments() {
		switch in.Kind {
		case "counter":
			if i, err := t.meter.Int64Counter(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description)); err == nil {
				t.counters[in.Name] = i
			}
		case "histogram":
			if i, err := t.meter.Float64Histogram(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description)); err == nil {
				t.hists[in.Name] = i
			}
		case "gauge":
			if i, err := t.meter.Int64Gauge(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description)); err == nil {
				t.gauges[in.Name] = i
			}
		}
	}
	return t
}

// KeyValues converts the attributes of the schema to OpenTelemetry's.
func KeyValues(attrs []slog.Attr) []attribute.KeyValue {
	kvs := make([]attribute.KeyValue, 0, len(attrs))
	for _, a := range attrs {
		v := a.Value.Resolve()
		switch v.Kind() {
		case slog.KindString:
			kvs = append(kvs, attribute.String(a.Key, v.String()))
		case slog.KindInt64:
			kvs = append(kvs, attribute.Int64(a.Key, v.Int64()))
		case slog.KindUint64:
			kvs = append(kvs, attribute.Int64(a.Key, int64(v.Uint64())))
		case slog.KindFloat64:
			kvs = append(kvs, attribute.Float64(a.Key, v.Float64()))
		case slog.KindBool:
			kvs = append(kvs, attribute.Bool(a.Key, v.Bool()))
		case slog.KindDuration:
			kvs = append(kvs, attribute.Float64(a.Key, v.Duration().Seconds()))
		default:
			kvs = append(kvs, attribute.String(a.Key, v.String()))
		}
	}
	return kvs
}

func instrument[T any](t *Telemetry, m map[string]T, name string) (T, bool) {
	t.mu.RLock()
	i, ok := m[name]
	t.mu.RUnlock()
	return i, ok
}

// Event adds the event to the span of ctx (the call's levee.call span when the
// call's crossing drained it) if that span records; an event no call's context
// carries (drained by Flush or Close) has no span to go to: subscribe a
// levee.Listener or a log/slog logger (levee.WithLogger) to keep every event.
func (t *Telemetry) Event(ctx context.Context, name string, attrs []slog.Attr) {
	if s := trace.SpanFromContext(ctx); s.IsRecording() {
		s.AddEvent(name, trace.WithAttributes(KeyValues(attrs)...))
	}
}

// Add increments a counter.
func (t *Telemetry) Add(ctx context.Context, counter string, value int64, attrs []slog.Attr) {
	if i, ok := instrument(t, t.counters, counter); ok {
		i.Add(ctx, value, metric.WithAttributes(KeyValues(attrs)...))
	}
}

// Record records a histogram sample.
func (t *Telemetry) Record(ctx context.Context, histogram string, value float64, attrs []slog.Attr) {
	if i, ok := instrument(t, t.hists, histogram); ok {
		i.Record(ctx, value, metric.WithAttributes(KeyValues(attrs)...))
	}
}

// Gauge records a gauge's new value.
func (t *Telemetry) Gauge(ctx context.Context, gauge string, value int64, attrs []slog.Attr) {
	if i, ok := instrument(t, t.gauges, gauge); ok {
		i.Record(ctx, value, metric.WithAttributes(KeyValues(attrs)...))
	}
}

// StartSpan starts a span (levee.Tracer).
func (t *Telemetry) StartSpan(ctx context.Context, name string, attrs []slog.Attr) (context.Context, levee.Span) {
	kind := trace.SpanKindInternal
	if name == levee.SpanCall {
		kind = trace.SpanKindClient
	}
	ctx, s := t.tracer.Start(ctx, name, trace.WithAttributes(KeyValues(attrs)...), trace.WithSpanKind(kind))
	return ctx, span{s}
}

type span struct{ s trace.Span }

func (s span) SetAttributes(attrs ...slog.Attr) { s.s.SetAttributes(KeyValues(attrs)...) }

func (s span) End(err error) {
	if err != nil {
		s.s.RecordError(err)
		s.s.SetStatus(codes.Error, err.Error())
	}
	s.s.End()
}

var (
	_ levee.Telemetry = (*Telemetry)(nil)
	_ levee.Tracer    = (*Telemetry)(nil)
)
