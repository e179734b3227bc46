package leveetest

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

// Recorder is a levee.Telemetry that keeps everything it receives, for tests
// (levee.WithTelemetry(rec)). With a Label function, every entry also keeps
// what it returns for the context of the entry (say, which call of the test
// made it). It is safe for use by many goroutines.
type Recorder struct {
	// Label, when set, labels every entry from its context (RecordedEvent.Label, ...For).
	Label func(ctx context.Context) any

	mu      sync.Mutex
	entries []Entry
	events  []RecordedEvent
	counts  map[string]int64
	samples map[string]Samples
	gauges  map[string]int64
}

// RecordedEvent is one event the sink received.
type RecordedEvent struct {
	Name  string
	Attrs map[string]any // string, int64, uint64, float64 or bool
	Label any
}

// Entry is anything the sink received, in order: Kind is event, add, record or gauge.
type Entry struct {
	Kind  string
	Name  string
	Value float64
	Attrs []slog.Attr
	Label any
}

// Samples is what a histogram received under one set of attributes.
type Samples struct {
	Count int
	Sum   float64
}

// NewRecorder is an empty Recorder.
func NewRecorder() *Recorder {
	return &Recorder{counts: map[string]int64{}, samples: map[string]Samples{}, gauges: map[string]int64{}}
}

// SeriesName is how a Recorder names a metric series: `name{attr=value,...}`,
// the attributes sorted by name (the format of conformance/hosts).
func SeriesName(name string, attrs []slog.Attr) string {
	parts := make([]string, len(attrs))
	for i, a := range attrs {
		parts[i] = a.Key + "=" + fmt.Sprint(a.Value.Resolve().Any())
	}
	sort.Strings(parts)
	return name + "{" + strings.Join(parts, ",") + "}"
}

func attrMap(attrs []slog.Attr) map[string]any {
	m := make(map[string]any, len(attrs))
	for _, a := range attrs {
		m[a.Key] = a.Value.Resolve().Any()
	}
	return m
}

func (r *Recorder) label(ctx context.Context) any {
	if r.Label == nil {
		return nil
	}
	return r.Label(ctx)
}

// Event records an event.
func (r *Recorder) Event(ctx context.Context, name string, attrs []slog.Attr) {
	l := r.label(ctx)
	r.mu.Lock()
	r.events = append(r.events, RecordedEvent{Name: name, Attrs: attrMap(attrs), Label: l})
	r.entries = append(r.entries, Entry{Kind: "event", Name: name, Attrs: attrs, Label: l})
	r.mu.Unlock()
}

// Add records a counter increment.
func (r *Recorder) Add(ctx context.Context, counter string, value int64, attrs []slog.Attr) {
	l := r.label(ctx)
	r.mu.Lock()
	r.counts[SeriesName(counter, attrs)] += value
	r.entries = append(r.entries, Entry{Kind: "add", Name: counter, Value: float64(value), Attrs: attrs, Label: l})
	r.mu.Unlock()
}

// Record records a histogram sample.
func (r *Recorder) Record(ctx context.Context, histogram string, value float64, attrs []slog.Attr) {
	l := r.label(ctx)
	k := SeriesName(histogram, attrs)
	r.mu.Lock()
	s := r.samples[k]
	s.Count++
	s.Sum += value
	r.samples[k] = s
	r.entries = append(r.entries, Entry{Kind: "record", Name: histogram, Value: value, Attrs: attrs, Label: l})
	r.mu.Unlock()
}

// Gauge records a gauge's new value.
func (r *Recorder) Gauge(ctx context.Context, gauge string, value int64, attrs []slog.Attr) {
	l := r.label(ctx)
	r.mu.Lock()
	r.gauges[SeriesName(gauge, attrs)] = value
	r.entries = append(r.entries, Entry{Kind: "gauge", Name: gauge, Value: float64(value), Attrs: attrs, Label: l})
	r.mu.Unlock()
}

// Entries is everything received so far, in order.
func (r *Recorder) Entries() []Entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Entry(nil), r.entries...)
}

// Events is every event so far, in order.
func (r *Recorder) Events() []RecordedEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]RecordedEvent(nil), r.events...)
}

// Counters is the sum of the increments of every counter series.
func (r *Recorder) Counters() map[string]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int64, len(r.counts))
	for k, v := range r.counts {
		out[k] = v
	}
	return out
}

// Histograms is the samples of every histogram series.
func (r *Recorder) Histograms() map[string]Samples {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]Samples, len(r.samples))
	for k, v := range r.samples {
		out[k] = v
	}
	return out
}

// Gauges is the last value of every gauge series.
func (r *Recorder) Gauges() map[string]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int64, len(r.gauges))
	for k, v := range r.gauges {
		out[k] = v
	}
	return out
}

var _ levee.Telemetry = (*Recorder)(nil)
