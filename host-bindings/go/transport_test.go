package levee

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const httpDoc = `
policies:
  http:
    attempts: 3
    attempt-timeout: 300ms
    deadline: 10s
    backoff: { kind: exponential, base: 5ms, multiplier: 2, cap: 20ms, jitter: full }
  breaker:
    attempts: 1
    breaker:
      window: { kind: count, size: 4 }
      minimum-calls: 4
      failure-rate: 50
      open-duration: 150ms
      half-open-permits: 1
  fallback:
    attempts: 2
    backoff: { kind: constant, base: 5ms, cap: 5ms, jitter: none }
    fallbacks: [stale]
`

// script is an httptest handler that answers from a list of responses, then 200.
type script struct {
	mu     sync.Mutex
	steps  []func(w http.ResponseWriter, r *http.Request)
	hits   atomic.Int64
	bodies []string
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := int(s.hits.Add(1)) - 1
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.bodies = append(s.bodies, string(b))
	var f func(w http.ResponseWriter, r *http.Request)
	if n < len(s.steps) {
		f = s.steps[n]
	}
	s.mu.Unlock()
	if f == nil {
		_, _ = io.WriteString(w, "ok")
		return
	}
	f(w, r)
}

func status(code int, header ...string) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, _ *http.Request) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.WriteHeader(code)
		_, _ = io.WriteString(w, http.StatusText(code))
	}
}

func newClient(t *testing.T, policy string, opts ...Option) (*http.Client, *recorder, *Engine) {
	rec := &recorder{}
	e := mustLoad(t, httpDoc, append([]Option{WithListener(rec.listen)}, opts...)...)
	return &http.Client{Transport: &Transport{Policy: mustPolicy(t, e, policy)}}, rec, e
}

func get(t *testing.T, c *http.Client, url string) (*http.Response, string, error) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b), nil
}

func TestHTTP503Then200(t *testing.T) {
	s := &script{steps: []func(http.ResponseWriter, *http.Request){status(503)}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, rec, _ := newClient(t, "http")
	resp, body, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || body != "ok" || s.hits.Load() != 2 {
		t.Fatalf("resp %v body %q err %v hits %d", resp, body, err, s.hits.Load())
	}
	if rec.count(EventRetryScheduled) != 1 {
		t.Fatalf("events %+v", rec.evs)
	}
}

func TestHTTPAttemptsAreMarked(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Header.Get(HeaderAttempt))
		n := len(seen)
		mu.Unlock()
		if n < 3 {
			w.WriteHeader(503)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	defer srv.Close()
	c, _, _ := newClient(t, "http")
	req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	if resp.StatusCode != 200 || strings.Join(seen, ",") != "1,2,3" {
		t.Fatalf("status %d, x-levee-attempt per attempt %q", resp.StatusCode, seen)
	}
	if req.Header.Get(HeaderAttempt) != "" {
		t.Fatalf("the caller's request was changed: %v", req.Header)
	}
}

func retryDelay(t *testing.T, rec *recorder) time.Duration {
	t.Helper()
	ev, ok := rec.find(EventRetryScheduled)
	if !ok {
		t.Fatalf("no retry-scheduled: %+v", rec.evs)
	}
	return time.Duration(ev.Duration)
}

func TestHTTP429RetryAfterSeconds(t *testing.T) {
	s := &script{steps: []func(http.ResponseWriter, *http.Request){status(429, "Retry-After", "1")}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, rec, _ := newClient(t, "http")
	start := time.Now()
	resp, _, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || s.hits.Load() != 2 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s.hits.Load())
	}
	if d := retryDelay(t, rec); d < time.Second || d > 2*time.Second {
		t.Fatalf("delay %v for Retry-After: 1", d)
	}
	if time.Since(start) < time.Second {
		t.Fatalf("the host did not wait the delay")
	}
}

func TestHTTP429RetryAfterDate(t *testing.T) {
	date := time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
	s := &script{steps: []func(http.ResponseWriter, *http.Request){status(429, "Retry-After", date)}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, rec, _ := newClient(t, "http")
	resp, _, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || s.hits.Load() != 2 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s.hits.Load())
	}
	if d := retryDelay(t, rec); d < 500*time.Millisecond || d > 3*time.Second {
		t.Fatalf("delay %v for Retry-After: %s", d, date)
	}
}

func TestHTTP400NotRetried(t *testing.T) {
	s := &script{steps: []func(http.ResponseWriter, *http.Request){status(400), status(400)}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, rec, _ := newClient(t, "http")
	resp, _, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 400 || s.hits.Load() != 1 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s.hits.Load())
	}
	if rec.count(EventRetryScheduled) != 0 {
		t.Fatalf("events %+v", rec.evs)
	}
}

func TestHTTPPerAttemptTimeout(t *testing.T) {
	slow := func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(2 * time.Second):
		}
	}
	s := &script{steps: []func(http.ResponseWriter, *http.Request){slow}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, rec, _ := newClient(t, "http")
	resp, body, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || body != "ok" || s.hits.Load() != 2 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s.hits.Load())
	}
	if rec.count(EventRetryScheduled) != 1 {
		t.Fatalf("events %+v", rec.evs)
	}
}

// A caller's timeout is never the dependency's failure: http.Client{Timeout} around the
// Transport (the usual idiom) cuts a request through both the request's context and its
// legacy Cancel channel, from two timers; whichever fires first, every call must end as
// cancelled, none be reported to the core as a failure (none may open the breaker).
func TestHTTPClientTimeoutIsACancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(2 * time.Second):
		}
	}))
	defer srv.Close()
	var reports atomic.Int64
	var mu sync.Mutex
	var reported []Outcome
	tr := WithTrace(func(s Step) {
		if s.Op == "report" {
			reports.Add(1)
			mu.Lock()
			reported = append(reported, s.Outcome)
			mu.Unlock()
		}
	})
	c, rec, _ := newClient(t, "breaker", tr)
	c.Timeout = 5 * time.Millisecond
	for i := 0; i < 100; i++ {
		// (net/http rewraps the error of a call it timed out as text: the reason is in it)
		_, err := c.Get(srv.URL)
		var ue *url.Error
		if !errors.As(err, &ue) || !ue.Timeout() || !strings.Contains(err.Error(), ReasonCancelled.String()) {
			t.Fatalf("call %d: %v, want a cancelled call", i, err)
		}
	}
	if n := reports.Load(); n != 0 || rec.count(EventBreakerTransition) != 0 {
		t.Fatalf("%d calls cut by the client's timeout were reported to the core (%v); transitions %d",
			n, reported, rec.count(EventBreakerTransition))
	}
	// What the README recommends instead: a context deadline keeps the *Error in the chain.
	c.Timeout = 0
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	_, err := c.Do(req)
	var le *Error
	if !errors.Is(err, ErrCancelled) || !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &le) || !le.Timeout() {
		t.Fatalf("a context deadline: %v", err)
	}
	if reports.Load() != 0 {
		t.Fatalf("a call cut by its context deadline was reported to the core")
	}
}

// A request cancelled through its legacy Cancel channel alone is a cancelled call too.
func TestHTTPRequestCancelChannelIsACancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(2 * time.Second):
		}
	}))
	defer srv.Close()
	var reports atomic.Int64
	c, rec, _ := newClient(t, "breaker", WithTrace(func(s Step) {
		if s.Op == "report" {
			reports.Add(1)
		}
	}))
	for i := 0; i < 10; i++ {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		ch := make(chan struct{})
		req.Cancel = ch //nolint:staticcheck // the legacy channel is what is tested
		time.AfterFunc(5*time.Millisecond, func() { close(ch) })
		_, err := c.Do(req)
		if !errors.Is(err, ErrCancelled) {
			t.Fatalf("call %d: %v, want a cancelled call", i, err)
		}
	}
	if reports.Load() != 0 || rec.count(EventBreakerTransition) != 0 {
		t.Fatalf("%d cancelled calls reported to the core", reports.Load())
	}
}

func TestHTTPConnectionErrorRetried(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close() // nothing listens there any more
	c, rec, _ := newClient(t, "http")
	_, err := c.Get(url)
	if !errors.Is(err, ErrRetriesExhausted) || rec.count(EventRetryScheduled) != 2 {
		t.Fatalf("err %v events %+v", err, rec.evs)
	}
}

func TestHTTPBreakerTripsAndRecovers(t *testing.T) {
	var healthy atomic.Bool
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		if !healthy.Load() {
			w.WriteHeader(500)
		}
	}))
	defer srv.Close()
	c, rec, _ := newClient(t, "breaker")
	for i := 0; i < 4; i++ {
		resp, _, err := get(t, c, srv.URL)
		if err != nil || resp.StatusCode != 500 {
			t.Fatalf("call %d: %v %v", i, resp, err)
		}
	}
	_, err := c.Get(srv.URL)
	if !errors.Is(err, ErrBreakerOpen) || hits.Load() != 4 {
		t.Fatalf("breaker did not open: %v (hits %d)", err, hits.Load())
	}
	healthy.Store(true)
	time.Sleep(200 * time.Millisecond) // past open-duration
	resp, _, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("half-open probe: %v %v", resp, err)
	}
	resp, _, err = get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after recovery: %v %v", resp, err)
	}
	var path []string
	rec.mu.Lock()
	for _, ev := range rec.evs {
		if ev.Kind == EventBreakerTransition {
			path = append(path, ev.StateFrom.String()+"->"+ev.StateTo.String())
		}
	}
	rec.mu.Unlock()
	want := "closed->open open->half-open half-open->closed"
	if strings.Join(path, " ") != want {
		t.Fatalf("transitions %v, want %s", path, want)
	}
}

func TestHTTPFallbackUsedAndReported(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }))
	defer srv.Close()
	c, rec, _ := newClient(t, "fallback", WithFallback("stale", func(_ context.Context, cause error) (any, error) {
		return &http.Response{StatusCode: 200, Header: http.Header{"X-From": {"fallback"}},
			Body: io.NopCloser(strings.NewReader("stale copy"))}, nil
	}))
	resp, body, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || body != "stale copy" || resp.Header.Get("X-From") != "fallback" {
		t.Fatalf("resp %v body %q err %v", resp, body, err)
	}
	ev, ok := rec.find(EventFallbackChosen)
	if !ok || ev.Name != "stale" {
		t.Fatalf("fallback not reported: %+v", rec.evs)
	}
}

func TestHTTPBodies(t *testing.T) {
	// A replayable body (GetBody) is sent again on the retry.
	s := &script{steps: []func(http.ResponseWriter, *http.Request){status(503)}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	c, _, _ := newClient(t, "http")
	req, _ := http.NewRequest("PUT", srv.URL, bytes.NewReader([]byte("payload")))
	resp, err := c.Do(req)
	if err != nil || resp.StatusCode != 200 || s.hits.Load() != 2 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s.hits.Load())
	}
	resp.Body.Close()
	if s.bodies[0] != "payload" || s.bodies[1] != "payload" {
		t.Fatalf("bodies %q", s.bodies)
	}
	// A body that cannot be replayed: the request is not retried.
	s2 := &script{steps: []func(http.ResponseWriter, *http.Request){status(503)}}
	srv2 := httptest.NewServer(s2)
	defer srv2.Close()
	req, _ = http.NewRequest("PUT", srv2.URL, io.NopCloser(strings.NewReader("once")))
	req.GetBody = nil
	resp, err = c.Do(req)
	if err != nil || resp.StatusCode != 503 || s2.hits.Load() != 1 {
		t.Fatalf("resp %v err %v hits %d", resp, err, s2.hits.Load())
	}
	resp.Body.Close()
	// POST is not idempotent: not retried without an idempotency key...
	s3 := &script{steps: []func(http.ResponseWriter, *http.Request){status(503), status(503)}}
	srv3 := httptest.NewServer(s3)
	defer srv3.Close()
	resp, err = c.Post(srv3.URL, "text/plain", strings.NewReader("order"))
	if err != nil || resp.StatusCode != 503 || s3.hits.Load() != 1 {
		t.Fatalf("POST: resp %v err %v hits %d", resp, err, s3.hits.Load())
	}
	resp.Body.Close()
	// ...and retried with one.
	req, _ = http.NewRequest("POST", srv3.URL, strings.NewReader("order"))
	req.Header.Set("Idempotency-Key", "abc")
	resp, err = c.Do(req)
	if err != nil || resp.StatusCode != 200 || s3.hits.Load() != 3 {
		t.Fatalf("POST with key: resp %v err %v hits %d", resp, err, s3.hits.Load())
	}
	resp.Body.Close()
}

func TestHTTPConcurrentClientsAndSlog(t *testing.T) {
	var buf syncBuffer
	logger := slog.New(slog.NewTextHandler(&buf, nil))
	var seen sync.Map
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// the first request for every fourth path fails once
		if _, dup := seen.LoadOrStore(r.URL.Path, true); !dup && len(r.URL.Path)%4 == 0 {
			w.WriteHeader(503)
		}
	}))
	defer srv.Close()
	c, _, _ := newClient(t, "http", WithLogger(logger))
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := 0; g < 6; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				resp, err := c.Get(fmt.Sprintf("%s/%s/%d", srv.URL, strings.Repeat("x", g), i))
				if err != nil || resp.StatusCode != 200 {
					t.Errorf("call failed: %v %v", resp, err)
					bad.Add(1)
				}
				if resp != nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		}(g)
	}
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d calls failed", bad.Load())
	}
	if out := buf.String(); !strings.Contains(out, "levee retry-scheduled") || !strings.Contains(out, "policy=http") {
		t.Fatalf("slog output: %q", out)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// The HTTP key rule of docs/hosts.md, section 6.
func TestHTTPKey(t *testing.T) {
	for in, want := range map[string]string{
		"https://API.example.com/a":          "api.example.com:443",
		"https://api.example.com:443/b":      "api.example.com:443",
		"http://svc.test/r":                  "svc.test:80",
		"http://svc.test:8080/r":             "svc.test:8080",
		"ws://svc.test/":                     "svc.test:80",
		"wss://svc.test/":                    "svc.test:443",
		"http://user:pw@[::1]/x":             "[::1]:80",
		"https://[2001:DB8::1]:8443/x?q=1#f": "[2001:db8::1]:8443",
	} {
		u, err := url.Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		if got := HTTPKey(u); got != want {
			t.Errorf("HTTPKey(%s) = %q, want %q", in, got, want)
		}
	}
}

// Methods are case-sensitive; "" is GET (net/http sends GET).
func TestMethodFlags(t *testing.T) {
	get := MethodFlag("GET")
	if MethodFlag("get") == get || MethodFlag("get") != cMethodOther<<flagMethodShift {
		t.Fatal("lower-case get must be 'other'")
	}
	if MethodFlag(httpMethod(&http.Request{})) != get {
		t.Fatal("an empty method is GET")
	}
	if MethodFlag("") != 0 {
		t.Fatal("no method is none")
	}
}

func TestIdempotencyHeaders(t *testing.T) {
	for _, c := range []struct {
		h    http.Header
		want bool
	}{
		{http.Header{"Idempotency-Key": {"k"}}, true},
		{http.Header{"X-Idempotency-Key": {"k"}}, true},
		{http.Header{"x-idempotency-key": {"k"}}, true}, // set on the map, not canonicalised
		{http.Header{"Idempotency-Key": {""}}, false},
		{http.Header{"Idempotency-Keys": {"k"}}, false},
		{http.Header{}, false},
	} {
		if got := hasIdempotencyKey(c.h); got != c.want {
			t.Errorf("hasIdempotencyKey(%v) = %v", c.h, got)
		}
	}
}

// Issue 39: the same fallback name typed for the Transport's *http.Response and for a
// DoValue's string: each call gets its own.
func TestHTTPTypedFallbackBesideAnotherType(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }))
	defer srv.Close()
	c, _, e := newClient(t, "fallback")
	if err := RegisterTypedFallback(e, "stale", func(_ context.Context, _ error) (*http.Response, error) {
		return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader("stale")), Header: http.Header{}}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := RegisterTypedFallback(e, "stale", func(context.Context, error) (string, error) { return "stale string", nil }); err != nil {
		t.Fatal(err)
	}
	resp, body, err := get(t, c, srv.URL)
	if err != nil || resp.StatusCode != 200 || body != "stale" {
		t.Fatalf("%v %q %v", resp, body, err)
	}
	s, err := DoValue(context.Background(), mustPolicy(t, e, "fallback"), func(context.Context) (string, error) {
		return "", HTTPStatusError(503, "")
	})
	if err != nil || s != "stale string" {
		t.Fatalf("%q %v", s, err)
	}
}
