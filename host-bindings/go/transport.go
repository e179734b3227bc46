package levee

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
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
// A fallback registered for a transport must return an *http.Response.
//
// Every attempt carries its number in HeaderAttempt: the application decides the request's
// retries, so a Levee filter in an Envoy on the way adds none (docs/envoy.md).
type Transport struct {
	// Base does the requests (nil: http.DefaultTransport).
	Base http.RoundTripper
	// Policy is applied to every request.
	Policy *Policy
	// Key names the key of a request for per-key breakers and limits
	// (nil: the request's host).
	Key func(*http.Request) string
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
	if t.Policy == nil {
		if req.Body != nil {
			_ = req.Body.Close() // a RoundTripper closes the body, even on an error
		}
		return nil, ErrNoPolicy
	}
	key := req.URL.Host
	if t.Key != nil {
		key = t.Key(req)
	}
	flags := MethodFlag(req.Method)
	if req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != "" {
		flags |= FlagIdempotencyKey
	}
	h := &httpAttempt{base: t.base(), req: req, body: req.Body}
	fbv, used, err := t.Policy.run(req.Context(), h, []CallOption{WithKey(key), withFlags(flags)})
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

func (h *httpAttempt) checkFallback(v any) error {
	if r, ok := v.(*http.Response); !ok || r == nil {
		return errFallbackNotResponse
	}
	return nil
}

func (h *httpAttempt) attempt(e *Engine, ctx context.Context, timeout time.Duration) (Outcome, error) {
	h.discard()
	actx, cancel := ctx, context.CancelFunc(nil)
	if timeout > 0 {
		actx, cancel = e.withTimeout(ctx, timeout)
	}
	r := h.req.WithContext(actx)
	r.Body = h.body
	h.n++
	// A RoundTripper must not change the caller's request: the attempt gets its own headers.
	r.Header = h.req.Header.Clone()
	if r.Header == nil {
		r.Header = http.Header{}
	}
	r.Header.Set(HeaderAttempt, strconv.Itoa(h.n))
	resp, err := h.base.RoundTrip(r)
	if err != nil {
		o := Classify(actx, err)
		if cancel != nil {
			cancel()
		}
		h.lastErr = err
		return o, err
	}
	// The body is part of the attempt: read it under the attempt's context.
	body, rerr := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if rerr != nil {
		o := Classify(actx, rerr)
		if o.Kind == OutcomeErrorClass {
			o = Outcome{Kind: OutcomeConnectionError} // the body broke off
		}
		if cancel != nil {
			cancel()
		}
		h.lastErr = rerr
		return o, rerr
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	if cancel != nil {
		cancel()
		cancel = nil
	}
	h.resp, h.cancel = resp, cancel
	o := Outcome{Kind: OutcomeHTTPStatus, Code: int32(resp.StatusCode), Text: resp.Header.Get("Retry-After"),
		Overloaded: resp.Header.Get("X-Envoy-Overloaded") != ""}
	h.lastErr = &outcomeError{o: o}
	return o, h.lastErr
}

// prepareRetry frees the last response and rewinds the body; false when it cannot.
func (h *httpAttempt) prepareRetry() bool {
	if h.req.Body != nil && h.req.Body != http.NoBody {
		if h.req.GetBody == nil {
			return false
		}
		b, err := h.req.GetBody()
		if err != nil {
			return false
		}
		h.body = b
	}
	h.discard()
	return true
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
