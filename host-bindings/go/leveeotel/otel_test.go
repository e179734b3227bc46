package leveeotel_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveeotel"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func TestMetricsAndSpans(t *testing.T) {
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e, err := levee.Load(ctx, `
policies:
  api:
    attempts: 3
    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }
`, leveetest.NoWaits(), levee.WithTelemetry(leveeotel.New(leveeotel.WithMeterProvider(mp), leveeotel.WithTracerProvider(tp))))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("api")
	n := 0
	if err := levee.Do(ctx, p, func(context.Context) error {
		n++
		if n == 1 {
			return context.DeadlineExceeded
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					got[m.Name+" "+attrs(dp.Attributes)] += dp.Value
				}
			case metricdata.Histogram[float64]:
				for _, dp := range d.DataPoints {
					got[m.Name+" "+attrs(dp.Attributes)] += int64(dp.Count)
					if m.Unit != "s" {
						t.Errorf("%s has unit %q", m.Name, m.Unit)
					}
				}
			}
		}
	}
	want := map[string]int64{
		"levee.calls levee.policy=api,levee.result=success,levee.retried=true": 1,
		"levee.attempts levee.outcome=timeout,levee.policy=api":                1,
		"levee.attempts levee.outcome=success,levee.policy=api":                1,
		"levee.attempt.duration levee.outcome=timeout,levee.policy=api":        1,
		"levee.attempt.duration levee.outcome=success,levee.policy=api":        1,
		"levee.retries levee.policy=api":                                       1,
		"levee.retry.delay levee.policy=api":                                   1,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	var call sdktrace.ReadOnlySpan
	attempts := 0
	for _, s := range spans.Ended() {
		switch s.Name() {
		case "levee.call":
			call = s
		case "levee.attempt":
			attempts++
		}
	}
	if call == nil || attempts != 2 {
		t.Fatalf("spans: call %v, %d attempts", call != nil, attempts)
	}
	if evs := call.Events(); len(evs) != 1 || evs[0].Name != "retry-scheduled" {
		t.Fatalf("call span events: %v", evs)
	}
	for _, s := range spans.Ended() {
		if s.Name() == "levee.attempt" && s.Parent().SpanID() != call.SpanContext().SpanID() {
			t.Fatal("an attempt span is not a child of the call span")
		}
	}
}

func attrs(set attribute.Set) string {
	s := ""
	for _, kv := range set.ToSlice() {
		if s != "" {
			s += ","
		}
		s += string(kv.Key) + "=" + kv.Value.Emit()
	}
	return s
}

type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// The Transport's retries carry http.request.resend_count (n - 1), absent on the first.
func TestHTTPAttemptSpans(t *testing.T) {
	ctx := context.Background()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e, err := levee.Load(ctx, "policies:\n  api:\n    attempts: 3\n    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }\n",
		leveetest.NoWaits(), levee.WithTelemetry(leveeotel.New(leveeotel.WithTracerProvider(tp))))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("api")
	n := 0
	base := rtFunc(func(r *http.Request) (*http.Response, error) {
		n++
		code := 503
		if n == 3 {
			code = 200
		}
		return &http.Response{StatusCode: code, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
	})
	client := &http.Client{Transport: &levee.Transport{Base: base, Policy: p}}
	resp, err := client.Get("http://svc.test/x")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%v %v", resp, err)
	}
	var resend []int64
	for _, s := range spans.Ended() {
		if s.Name() != "levee.attempt" {
			continue
		}
		v := int64(0)
		for _, kv := range s.Attributes() {
			if kv.Key == "http.request.resend_count" {
				v = kv.Value.AsInt64()
			}
		}
		resend = append(resend, v)
	}
	if len(resend) != 3 || resend[0] != 0 || resend[1] != 1 || resend[2] != 2 {
		t.Fatalf("resend counts %v", resend)
	}
}

// A hedged call: levee.hedges counts the hedge, each attempt has its span under the
// call's (the cancelled one's too, ended when it returns), and the attempt the core
// cancelled is not counted in levee.attempts.
func TestHedgedCall(t *testing.T) {
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e, err := levee.Load(ctx, "policies:\n  api:\n    hedge: { attempts: 2, delay: 0 }\n",
		levee.WithTelemetry(leveeotel.New(leveeotel.WithMeterProvider(mp), leveeotel.WithTracerProvider(tp))))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("api")
	var n atomic.Int32
	if err := levee.Do(ctx, p, func(ctx context.Context) error {
		if n.Add(1) == 1 {
			<-ctx.Done() // the first hangs until the core cancels it
			return ctx.Err()
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var call sdktrace.ReadOnlySpan
	attempts := 0
	for deadline := time.Now().Add(5 * time.Second); attempts < 2 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		call, attempts = nil, 0
		for _, s := range spans.Ended() {
			switch s.Name() {
			case "levee.call":
				call = s
			case "levee.attempt":
				attempts++
			}
		}
	}
	if call == nil || attempts != 2 {
		t.Fatalf("spans: call %v, %d attempts", call != nil, attempts)
	}
	for _, s := range spans.Ended() {
		if s.Name() == "levee.attempt" && s.Parent().SpanID() != call.SpanContext().SpanID() {
			t.Fatal("an attempt span is not a child of the call span")
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range d.DataPoints {
					got[m.Name+" "+attrs(dp.Attributes)] += dp.Value
				}
			}
		}
	}
	want := map[string]int64{
		"levee.hedges levee.policy=api":                                        1,
		"levee.attempts levee.outcome=success,levee.policy=api":                1,
		"levee.calls levee.policy=api,levee.result=success,levee.retried=true": 1,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("metrics %v, want %v", got, want)
	}
}
