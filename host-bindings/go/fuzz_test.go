package levee

// FuzzOutcomeMapping fuzzes the host's outcome mapping end to end: a request's key (any
// bytes, invalid UTF-8 included) and a script of responses (status, raw Retry-After
// bytes, the overloaded mark) go through the Transport over a scripted RoundTripper, so
// every step is the real one (the outcome of a response, report, the core's verdicts, the
// clamps). Properties: RoundTrip returns a response the upstream sent, or an error that is
// a *Error or ErrInvalidUTF8; never more attempts than the policy allows; the engine never
// faults. `go test` runs the seeds; `go test -fuzz FuzzOutcomeMapping` explores.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"testing"
)

const fuzzDoc = `
policies:
  retry:
    attempts: 4
    backoff: { kind: constant, base: 0ms, jitter: none }
    retry-after: { cap: 1ms, over-cap: clamp }
    retry-on: [timeout, connection-error, "http:429", "http:5xx"]
  breaker:
    attempts: 2
    backoff: { kind: constant, base: 0ms, jitter: none }
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1ms }
    retry-after: { cap: 1ms, over-cap: clamp }
`

type scripted struct {
	script []byte // 4 bytes a response: status (2), Retry-After length (1), overloaded (1); then the headers
	given  []*http.Response
}

func (s *scripted) RoundTrip(req *http.Request) (*http.Response, error) {
	i := len(s.given)
	rec := s.script
	for j := 0; j < i && len(rec) >= 4; j++ {
		rec = rec[4+min(int(rec[2])%25, len(rec)-4):]
	}
	status, ra, over := 503, "", false
	if len(rec) >= 4 {
		status = 100 + (int(rec[0])<<8|int(rec[1]))%500
		n := min(int(rec[2])%25, len(rec)-4)
		ra, over = string(rec[4:4+n]), rec[3]&1 == 1
	}
	h := http.Header{}
	if ra != "" {
		h["Retry-After"] = []string{ra}
	}
	if over {
		h.Set("X-Envoy-Overloaded", "true")
	}
	r := &http.Response{StatusCode: status, Header: h, Body: io.NopCloser(bytes.NewReader([]byte("x"))), Request: req}
	s.given = append(s.given, r)
	return r, nil
}

func FuzzOutcomeMapping(f *testing.F) {
	f.Add("db-1", false, []byte{0x01, 0x93, 1, 0, '1'})                           // 503, Retry-After: 1
	f.Add("\xff\xfe", false, []byte{0, 0xc8, 0, 0})                               // an invalid key
	f.Add("", true, []byte{0x01, 0x31, 3, 1, '\xff', 'a', ' ', 0x01, 0x93, 0, 0}) // 429 with bad bytes, overloaded
	f.Add("k", true, []byte("Wed, 21 Oct 2015 07:28:00 GMT"))
	rec := &recorder{}
	e, err := Load(context.Background(), fuzzDoc, WithSeed(1), WithSnapshotInterval(0), WithListener(rec.listen))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = e.Close(context.Background()) })
	policies := map[bool]*Policy{false: mustPolicy(f, e, "retry"), true: mustPolicy(f, e, "breaker")}
	f.Fuzz(func(t *testing.T, key string, breaker bool, script []byte) {
		p := policies[breaker]
		s := &scripted{script: script}
		tr := &Transport{Base: s, Policy: p, Key: func(*http.Request) string { return key }}
		req, _ := http.NewRequestWithContext(context.Background(), "GET", "http://127.0.0.1/", nil)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			var le *Error
			if !errors.As(err, &le) && !errors.Is(err, ErrInvalidUTF8) {
				t.Fatalf("an untyped error: %v", err)
			}
		} else {
			found := false
			for _, g := range s.given {
				found = found || g == resp
			}
			if !found {
				t.Fatalf("a response the upstream never sent: %+v", resp)
			}
			_ = resp.Body.Close()
		}
		if max := int(p.Info().MaxAttempts); len(s.given) > max {
			t.Fatalf("%d attempts, the policy allows %d", len(s.given), max)
		}
		if n := rec.count(EventEngineFault); n != 0 {
			t.Fatalf("the engine faulted: %+v", rec.evs)
		}
	})
}
