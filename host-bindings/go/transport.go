package levee

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// Transport is an http.RoundTripper that runs every request under a policy.
// Each attempt's response is reported to the core as its HTTP status with the
// raw Retry-After header (and x-envoy-overloaded); network errors as
// connection errors; an attempt over its timeout as a timeout. The core
// decides what is retried. A request with a body is retried only when the body
// can be replayed through GetBody; otherwise the call ends with its first
// response or error.
//
// An attempt is the whole response (docs/http.md): its body is read inside the
// attempt, under the attempt's timeout, so a body that trickles past it is a
// timeout and a connection closed mid-body a connection error of that attempt;
// the response returned has its body in memory. To stream a body too large to
// hold, run the request under Do yourself.
//
// When the policy gives up after a response, the last response is returned as
// it is (a 503 is a response, not a transport error). When no response is left
// (a rejection, a network error, a retry cut short), RoundTrip returns a *Error.
// A fallback of a Transport's call must return an *http.Response: register it typed,
// RegisterTypedFallback[*http.Response], to keep the name free for other result types.
//
// Every attempt carries its number in HeaderAttempt: the application decides the request's
// retries, so a Levee filter in an Envoy on the way adds none (docs/envoy.md).
type Transport struct {
	// Base does the requests (nil: http.DefaultTransport).
	Base http.RoundTripper
	// Policy is applied to every request.
	Policy *Policy
	// Key names the key of a request for per-key breakers and limits
	// (nil: HTTPKey of the request's URL, its origin as host:port).
	Key func(*http.Request) string
	// OnRetry is called before the sleep of each retry (see OnRetry).
	OnRetry func(RetryInfo)
	// RetryIf is the retry predicate of every request (see RetryIf); it sees the
	// *http.Response of each attempt that got one, or the attempt's error.
	RetryIf func(result any, err error) RetryAnswer
}

// HTTPKey is the key of an HTTP call by the rule of docs/hosts.md: the URL's
// origin as host:port, the host lower-cased, an IPv6 literal in brackets, no
// userinfo, and the port always written (the scheme's default when the URL has
// none: http 80, https 443, ws 80, wss 443).
func HTTPKey(u *url.URL) string {
	if u == nil {
		return ""
	}
	host := u.Hostname()
	if utf8.ValidString(host) { // invalid UTF-8 stays as it is, for the key check to refuse
		host = strings.ToLower(host)
	}
	port := u.Port()
	if port == "" {
		port = cDefaultPorts[strings.ToLower(u.Scheme)]
	}
	return net.JoinHostPort(host, port)
}

// httpMethod is the method net/http sends: as given, "" being GET.
func httpMethod(req *http.Request) string {
	if req.Method == "" {
		return http.MethodGet
	}
	return req.Method
}

// replayable says whether the request's body can be sent again (none, or GetBody).
func replayable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

// hasIdempotencyKey says whether a header of IDEMPOTENCY_HEADERS is set and not
// empty, its name compared case-insensitively (also when set on the map directly,
// without canonicalisation).
func hasIdempotencyKey(h http.Header) bool {
	for k, vs := range h {
		for _, name := range cIdempotencyHeaders {
			if strings.EqualFold(k, name) {
				for _, v := range vs {
					if v != "" {
						return true
					}
				}
			}
		}
	}
	return false
}

// HeaderAttempt is the cross-layer header: the attempt number (1 on the first),
// sent on every attempt.
const HeaderAttempt = "X-Levee-Attempt"

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req == nil {
		return nil, nilArg("RoundTrip: the request is nil")
	}
	if req.URL == nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, nilArg("RoundTrip: the request's URL is nil")
	}
	if t.Policy == nil {
		if req.Body != nil {
			_ = req.Body.Close() // a RoundTripper closes the body, even on an error
		}
		return nil, ErrNoPolicy
	}
	var key string
	if t.Key != nil {
		key = t.Key(req)
	} else {
		key = HTTPKey(req.URL)
	}
	flags := MethodFlag(httpMethod(req))
	if !replayable(req) {
		// a body that cannot be sent twice: never a second attempt, whatever the headers say
		flags |= FlagNotIdempotent
	} else if hasIdempotencyKey(req.Header) {
		flags |= FlagIdempotencyKey
	}
	h := &httpAttempt{base: t.base(), req: req, body: req.Body}
	opts := [...]CallOption{WithKey(key), withFlags(flags), {kind: optHTTP}, {}, {}}
	n := 3
	if t.OnRetry != nil {
		opts[n] = OnRetry(t.OnRetry)
		n++
	}
	if t.RetryIf != nil {
		opts[n] = RetryIf(t.RetryIf)
		n++
	}
	ctx := req.Context()
	if req.Cancel != nil {
		// The legacy Request.Cancel channel (http.Client{Timeout} sets one around a
		// RoundTripper it does not know, next to a context deadline, each on its own timer):
		// folded into the call's context, and the attempts get only that context, so a
		// caller's cancel reaches the attempt through the context the call checks, never as
		// an attempt's "request canceled" error the core would count against the dependency.
		var stop context.CancelFunc
		ctx, stop = withCancelChan(ctx, req.Cancel)
		defer stop()
	}
	fbv, used, err := t.Policy.run(ctx, h, opts[:n])
	if used && err == nil {
		h.discard()
		if r, ok := fbv.(*http.Response); ok && r != nil {
			return r, nil
		}
		return nil, &Error{Policy: t.Policy.name, Reason: ReasonFallbacksFailed, Attempts: h.n,
			FallbackErr: errFallbackNotResponse}
	}
	if h.resp != nil {
		if e, ok := err.(*Error); ok && e.Reason == ReasonCancelled {
			h.discard()
			return nil, err
		}
		resp := h.resp
		if h.cancel != nil {
			resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: h.cancel}
		}
		return resp, nil
	}
	if err == nil {
		err = h.lastErr
	}
	return nil, err
}

// ErrNoPolicy is the error of a Transport whose Policy is nil.
var ErrNoPolicy = transportError("levee: the Transport has no Policy (set Transport.Policy to a policy of an engine)")

type transportError string

func (e transportError) Error() string { return string(e) }

var errFallbackNotResponse = transportError("levee: the fallback of a Transport returned no *http.Response")

type httpAttempt struct {
	base    http.RoundTripper
	req     *http.Request
	body    io.ReadCloser
	resp    *http.Response
	cancel  context.CancelFunc
	lastErr error
	n       int
}

func (h *httpAttempt) resultType() reflect.Type { return reflect.TypeFor[*http.Response]() }

func (h *httpAttempt) checkFallback(v any) error {
	if r, ok := v.(*http.Response); !ok || r == nil {
		return errFallbackNotResponse
	}
	return nil
}

func (h *httpAttempt) attempt(e *Engine, ctx context.Context, timeout time.Duration) (Outcome, error) {
	h.discard()
	h.n++
	o, err, resp := h.roundTrip(e, ctx, timeout, h.body, h.n)
	h.lastErr = err
	if resp != nil {
		h.resp = resp
	}
	return o, err
}

// roundTrip sends attempt n of the request with body under timeout (0: none) and reads
// its response's body, under the attempt's context. It changes nothing of h: the
// attempts of a hedged call run it at once.
func (h *httpAttempt) roundTrip(e *Engine, ctx context.Context, timeout time.Duration, body io.ReadCloser, n int) (Outcome, error, *http.Response) {
	actx, cancel := ctx, context.CancelFunc(nil)
	if timeout > 0 {
		actx, cancel = e.withTimeout(ctx, timeout)
		defer cancel()
	}
	r := h.req.WithContext(actx)
	r.Body = body
	r.Cancel = nil // the caller's Cancel is in ctx (RoundTrip): actx alone cuts the attempt
	// A RoundTripper must not change the caller's request: the attempt gets its own headers.
	r.Header = h.req.Header.Clone()
	if r.Header == nil {
		r.Header = http.Header{}
	}
	r.Header.Set(HeaderAttempt, strconv.Itoa(n))
	resp, err := h.base.RoundTrip(r)
	if err != nil {
		return Classify(actx, err), err, nil
	}
	// The body is part of the attempt: read it under the attempt's context.
	b, rerr := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if rerr != nil {
		o := Classify(actx, rerr)
		if o.Kind == OutcomeErrorClass {
			o = Outcome{Kind: OutcomeConnectionError} // the body broke off
		}
		return o, rerr, nil
	}
	resp.Body = io.NopCloser(bytes.NewReader(b))
	o := Outcome{Kind: OutcomeHTTPStatus, Code: int32(resp.StatusCode), Text: resp.Header.Get(cHttpRetryAfterHeader),
		Overloaded: resp.Header.Get(cHttpOverloadedHeader) != ""}
	return o, &outcomeError{o: o}, resp
}

// hedged runs attempt n of a hedged request: its own request, cancelled by its context,
// with its own body (the first attempt sends the request's; a hedge one from GetBody: the
// start flags made sure the core sends no hedge of a body without it).
func (h *httpAttempt) hedged(e *Engine, ctx context.Context, timeout time.Duration, n int) (Outcome, error, any) {
	body := h.body
	if n > 1 && h.req.Body != nil && h.req.Body != http.NoBody {
		if h.req.GetBody == nil {
			err := errBodyNotReplayable
			return Classify(ctx, err), err, nil
		}
		b, err := h.req.GetBody()
		if err != nil {
			err = fmt.Errorf("levee: the request body cannot be sent again: %w", err)
			return Classify(ctx, err), err, nil
		}
		body = b
	}
	o, err, resp := h.roundTrip(e, ctx, timeout, body, n)
	if resp == nil {
		return o, err, nil
	}
	return o, err, resp
}

// hedgeStarted counts attempt n of a hedged request (on the call's goroutine).
func (h *httpAttempt) hedgeStarted(n int) { h.n = max(h.n, n) }

// adopt makes a hedged attempt's response the call's.
func (h *httpAttempt) adopt(res any) {
	if r, ok := res.(*http.Response); ok && r != nil {
		h.discard()
		h.resp = r
	}
}

// drop closes a hedged attempt's response the call does not return.
func (h *httpAttempt) drop(res any) {
	if r, ok := res.(*http.Response); ok && r != nil {
		_ = r.Body.Close()
	}
}

var errBodyNotReplayable = transportError("levee: the request body cannot be sent again (no GetBody)")

// prepareRetry frees the last response and rewinds the body (GetBody: the
// start flags made sure a body without it is never retried).
func (h *httpAttempt) prepareRetry() error {
	if h.req.Body != nil && h.req.Body != http.NoBody && h.req.GetBody != nil {
		b, err := h.req.GetBody()
		if err != nil {
			return fmt.Errorf("levee: the request body cannot be sent again: %w", err)
		}
		h.body = b
	}
	h.discard()
	return nil
}

// lastResult is the response of the last attempt, for RetryInfo.Result.
func (h *httpAttempt) lastResult() any {
	if h.resp != nil {
		return h.resp
	}
	return nil
}

// discard closes the response of the last attempt (after draining a little of
// it so the connection can be reused).
func (h *httpAttempt) discard() {
	if h.resp != nil {
		_, _ = io.CopyN(io.Discard, h.resp.Body, 4<<10)
		_ = h.resp.Body.Close()
		h.resp = nil
	}
	if h.cancel != nil {
		h.cancel()
		h.cancel = nil
	}
}

// errRequestCancel is the cause of a call whose Request.Cancel channel closed.
var errRequestCancel = transportError("levee: the request was cancelled (its Request.Cancel channel closed)")

// withCancelChan is ctx, also cancelled when ch closes (until stop is called).
func withCancelChan(ctx context.Context, ch <-chan struct{}) (_ context.Context, stop context.CancelFunc) {
	cctx, cancel := context.WithCancelCause(ctx)
	go func() {
		select {
		case <-ch:
			cancel(errRequestCancel)
		case <-cctx.Done():
		}
	}()
	return cctx, func() { cancel(context.Canceled) }
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
	once   sync.Once
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.once.Do(c.cancel)
	return err
}
