package leveegrpc

import (
	"context"
	"errors"
	"io"
	"runtime"
	"sync"
	"sync/atomic"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

// Stream is the grpc.StreamClientInterceptor. A stream is one call under the policy, and it
// commits (gRPC A6's rule) at its first response message (or its end, when it ends before
// any), or at its response headers when the caller asks for them first. Until then a failure
// is an attempt's outcome, which the core may retry (a new stream, the request sent again).
// From the commit the stream is the caller's, under the attempt's deadline, and the attempt
// lasts until the stream ends: its end (OK, or the status the caller receives, with the raw
// grpc-retry-pushback-ms of its trailers) is the attempt's outcome, reported to the core,
// which never retries it (the call's retry predicate says no retry for it; so a stream call
// does not run levee.WithPolicyRetryIf's predicate) and ends the call with it: a failure
// after the commit counts in the breaker, the budgets, the metrics and the events like any
// other. The caller gets the stream's status unchanged (its code, message and details), as a
// *Error whose cause is the core's verdict.
//
// The stream ends when the caller reads it to its end (RecvMsg returns an error, io.EOF
// included; a client stream's response), when SendMsg fails with an error other than io.EOF,
// when its context is done (the caller's cancel or deadline: the caller's cancellation,
// which the core does not count against the dependency; the attempt's deadline: a timeout),
// when its ClientConn is closed, or when the caller drops it (the stream is garbage collected:
// the caller's cancellation; the stream is cancelled). Until then the attempt holds
// what the core granted it, a bulkhead slot say, as resilience4j's bulkhead holds its permit
// for the whole call: a caller that stops reading a stream should cancel its context.
//
// A hedging policy's attempts run concurrently and the core starts the next hedge while one
// is in flight: a hedged stream's call ends at its commit (the first attempt to commit wins,
// the others are cancelled at the server), and its end after the commit is the caller's
// only, not reported to the core.
//
// A server-streaming call starts at the caller's first RecvMsg (or Header): its request
// (the one message the generated client sends) is kept, a copy, for the attempts. A
// client-streaming or bidirectional call sends its requests as the caller writes them, not
// buffered: it commits when it is open (a failure to open is retried: nothing has been sent)
// and is never retried once open.
func (i *Interceptor) Stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	p := i.policy(method)
	if p == nil {
		if i.Policy == nil && i.PolicyFor == nil {
			return nil, ErrNoPolicy
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
	s := &streamCall{ctx: ctx, desc: desc, cc: cc, method: method, streamer: streamer, opts: opts, p: p}
	s.cctx, s.cstop = context.WithCancel(ctx)
	lopts := i.callOptions((*[2]levee.CallOption)(s.lo[:2]), ctx, method, cc, opts)
	s.lo[len(lopts)] = levee.RetryIf(committedRetryIf)
	s.lopts = s.lo[:len(lopts)+1]
	if desc.ClientStreams {
		a, err := s.run(nil)
		if err != nil {
			return nil, err
		}
		o := &openStream{ClientStream: a.cs, call: s, a: a, server: desc.ServerStreams}
		runtime.AddCleanup(o, dropped, s.cstop)
		return o, nil
	}
	ss := &serverStream{call: s}
	runtime.AddCleanup(ss, dropped, s.cstop)
	return ss, nil
}

// dropped ends a stream the caller has dropped (it is garbage): the caller's cancellation.
func dropped(stop context.CancelFunc) { stop() }

// committedRetryIf is a stream call's retry predicate: the end of a stream that went to the
// caller is never retried; any other attempt is left to the policy's rules.
func committedRetryIf(_ any, err error) levee.RetryAnswer {
	var ce *committedError
	if errors.As(err, &ce) {
		return levee.NoRetry
	}
	return levee.Unset
}

// committedError is the outcome of an attempt whose stream went to the caller: its end.
type committedError struct{ err error }

func (e *committedError) Error() string { return e.err.Error() }
func (e *committedError) Unwrap() error { return e.err }

// errConnClosing is the end of a stream whose ClientConn was closed (grpc's own status).
var errConnClosing = status.Error(codes.Canceled, "grpc: the client connection is closing")

// streamCall is one streaming call under a policy.
type streamCall struct {
	ctx      context.Context    // the caller's
	cctx     context.Context    // the call's: the caller's, cancelled too when the caller drops the stream
	cstop    context.CancelFunc // cancels cctx (once the stream is over for the caller, or dropped)
	desc     *grpc.StreamDesc
	cc       *grpc.ClientConn
	method   string
	streamer grpc.Streamer
	opts     []grpc.CallOption
	p        *levee.Policy
	lo       [3]levee.CallOption
	lopts    []levee.CallOption
	// the requests of a server-streaming call, sent again on every attempt
	sends  []any
	closed bool  // CloseSend was called
	first  bool  // commit at the first message (false: at the headers)
	maker  maker // of the response messages
	sent   atomic.Int32
	handed atomic.Bool // an attempt (not hedged) handed its stream to the caller
	// handoff carries the stream an attempt (not hedged) hands to the caller at its commit;
	// done is closed once the call is over in the core (levee.DoValue returned), with its
	// result in v, err (or the panic pv, when panicked)
	handoff  chan *streamAttempt
	done     chan struct{}
	v        any
	err      error
	panicked bool
	pv       any
	mu       sync.Mutex
	over     bool             // the call has ended: a stream committed later is closed
	live     []*streamAttempt // hedged streams committed and not yet handed to the caller
	fbSent   bool             // a fallback's message after a committed stream went to the caller
}

// streamAttempt is a committed stream.
type streamAttempt struct {
	cs     grpc.ClientStream
	cancel context.CancelFunc
	first  any  // the first response message (nil: none yet)
	eof    bool // the stream ended, OK, before any message
	handed bool // its attempt waits for its end (not hedged)
	// the end of a handed stream: the first of the caller's reading it, its context, its
	// ClientConn's close
	mu     sync.Mutex
	ended  bool
	endErr error
	byRecv bool // the end is RecvMsg's (its trailers are the stream's)
	endc   chan struct{}
}

// end records the end of a handed stream (the first one only).
func (a *streamAttempt) end(err error, byRecv bool) {
	a.mu.Lock()
	if !a.ended {
		a.ended, a.endErr, a.byRecv = true, err, byRecv
		close(a.endc)
	}
	a.mu.Unlock()
}

// valuesOf is a context with the Done, Err and Deadline of its embedded context and the
// values of another (the attempt's: its trace span, say).
type valuesOf struct {
	context.Context
	values context.Context
}

func (c valuesOf) Value(k any) any { return c.values.Value(k) }

// run runs the call until a stream commits or the call ends; first is a message of the
// response type (nil: commit at the stream's opening for a client stream, at its headers for
// a server stream).
func (s *streamCall) run(first any) (*streamAttempt, error) {
	if first != nil {
		s.first, s.maker = true, makerOf(first)
	}
	s.handoff = make(chan *streamAttempt, 1)
	s.done = make(chan struct{})
	go s.drive()
	select {
	case a := <-s.handoff:
		return a, nil
	case <-s.done:
	}
	select {
	case a := <-s.handoff: // handed on, and over already
		return a, nil
	default:
	}
	if s.panicked {
		s.cstop()
		panic(s.pv)
	}
	if s.err != nil {
		s.cstop()
		return nil, statusError(s.err)
	}
	a, _ := s.v.(*streamAttempt)
	if a == nil {
		// a fallback's value: one response message of a server stream
		if first == nil || s.desc.ClientStreams {
			s.cstop()
			return nil, status.Error(codes.Internal, "leveegrpc: a fallback cannot stand for this stream (only for a server stream's messages, read with RecvMsg)")
		}
		return &streamAttempt{first: s.v, cancel: s.cstop}, nil
	}
	return a, nil
}

// drive runs the call in the core, in a goroutine of its own: an attempt that hands its
// stream to the caller lasts until the stream ends.
func (s *streamCall) drive() {
	defer func() {
		p := recover()
		s.mu.Lock()
		s.over = true
		live := s.live
		s.live = nil
		s.mu.Unlock()
		a, _ := s.v.(*streamAttempt)
		for _, l := range live {
			if l != a || p != nil {
				l.cancel() // a hedge that committed too, after the winner (or every one, on a panic)
			}
		}
		if p != nil {
			s.panicked, s.pv = true, p
		}
		close(s.done)
	}()
	s.v, s.err = levee.DoValue(s.cctx, s.p, s.attempt, s.lopts...)
}

// finish is what the caller's call of a handed stream that met the stream's end (err, from
// RecvMsg when m is its message) returns, once the core has the stream's end: an OK end as it
// came (the messages were all delivered, whatever the core makes of a late one), else the
// call's error (the stream's status, the core's verdict its cause), or a fallback's message.
func (s *streamCall) finish(a *streamAttempt, err error, m any) error {
	a.end(err, m != nil)
	<-s.done
	s.cstop()
	if s.panicked {
		panic(s.pv)
	}
	if err == nil || errors.Is(err, io.EOF) {
		return err
	}
	if s.err != nil {
		return statusError(s.err)
	}
	if _, ok := s.v.(*streamAttempt); ok || s.v == nil {
		return err
	}
	// the core ended the call with a fallback: its value is the stream's next message
	if m == nil {
		return err
	}
	s.mu.Lock()
	sent := s.fbSent
	s.fbSent = true
	s.mu.Unlock()
	if sent {
		return io.EOF
	}
	if cerr := copyReply(m, s.v); cerr != nil {
		return status.Error(codes.Internal, cerr.Error())
	}
	return nil
}

// ended is what the caller's call that met the end of stream a (err; m the message RecvMsg
// was reading, nil from SendMsg) returns: a handed stream's end goes to the core first
// (finish); any other stream is simply over.
func (s *streamCall) ended(a *streamAttempt, err error, m any) error {
	if a.handed {
		return s.finish(a, err, m)
	}
	a.cancel()
	s.cstop()
	return err
}

// sendResult is what the caller's SendMsg on stream a returns: an error other than io.EOF ends a
// handed stream (io.EOF says the stream ended, which RecvMsg then reads).
func (s *streamCall) sendResult(a *streamAttempt, err error) error {
	if err != nil && !errors.Is(err, io.EOF) && a.handed {
		return s.finish(a, err, nil)
	}
	return err
}

func (s *streamCall) attempt(actx context.Context) (any, error) {
	_, hedged := levee.HedgeAttempt(actx)
	if !hedged && s.handed.Load() {
		// the core asks for another attempt after a stream went to the caller (whose end it
		// judged late): it cannot be sent again
		return nil, &committedError{status.Error(codes.Aborted, "leveegrpc: the stream went to the caller, it cannot be sent again")}
	}
	n := s.sent.Add(1)
	// The stream outlives the attempt's function when hedged (it is the caller's once
	// committed): it gets a context of the call's with the attempt's deadline, cancelled with
	// the attempt's context until it commits.
	var dctx context.Context
	var cancel context.CancelFunc
	if dl, ok := actx.Deadline(); ok {
		dctx, cancel = context.WithDeadline(s.cctx, dl)
	} else {
		dctx, cancel = context.WithCancel(s.cctx)
	}
	stop := context.AfterFunc(actx, cancel)
	fail := func(err error, trailer metadata.MD) (any, error) {
		stop()
		cancel()
		return nil, attemptError(actx, err, trailer)
	}
	sctx := attemptContext(valuesOf{Context: dctx, values: actx}, n)
	cs, err := s.streamer(sctx, s.desc, s.cc, s.method, s.opts...)
	if err != nil {
		return fail(err, nil)
	}
	a := &streamAttempt{cs: cs, cancel: cancel}
	if !s.desc.ClientStreams {
		for _, m := range s.sends {
			if cs.SendMsg(m) != nil {
				break // the stream failed: RecvMsg says how
			}
		}
		if s.closed {
			_ = cs.CloseSend()
		}
		if !s.first {
			// grpc's Header returns no headers and no error for a stream that has ended (its
			// status, an error or OK, is RecvMsg's, which reads no message from it)
			md, err := cs.Header()
			if err == nil && md == nil {
				err = cs.RecvMsg(new(emptypb.Empty))
			}
			switch {
			case err == nil:
			case errors.Is(err, io.EOF):
				a.eof = true
			default:
				return fail(err, cs.Trailer())
			}
		} else {
			msg, err := s.maker.make()
			if err != nil {
				return fail(err, nil)
			}
			switch err := cs.RecvMsg(msg); {
			case err == nil:
				a.first = msg
			case errors.Is(err, io.EOF):
				a.eof = true
			default:
				return fail(err, cs.Trailer())
			}
		}
	}
	// committed
	if !stop() {
		cancel() // the attempt was cancelled (a hedge that lost) or timed out as it committed
		return nil, attemptError(actx, status.FromContextError(actx.Err()).Err(), nil)
	}
	if a.eof {
		return a, nil // the stream is over: its end is this outcome
	}
	if !hedged {
		a.handed, a.endc = true, make(chan struct{})
		s.handed.Store(true)
		s.handoff <- a
		return s.await(actx, dctx, a)
	}
	s.mu.Lock()
	if s.over {
		s.mu.Unlock()
		cancel()
		return nil, status.Error(codes.Canceled, "leveegrpc: the call ended before this attempt committed")
	}
	s.live = append(s.live, a)
	s.mu.Unlock()
	return a, nil
}

// await waits for the end of stream a, handed to the caller, and returns it as the attempt's
// outcome.
func (s *streamCall) await(actx, dctx context.Context, a *streamAttempt) (any, error) {
	csDone := a.cs.Context().Done() // grpc's: done when the stream is finished, for any reason
	for waiting := true; waiting; {
		select {
		case <-a.endc:
			waiting = false
		case <-dctx.Done():
			a.end(status.FromContextError(dctx.Err()).Err(), false)
		case <-csDone:
			// finished by a call of the caller (which reports the end as it returns), or by
			// the ClientConn's Close (which the caller may never read)
			csDone = nil
			if s.cc != nil && s.cc.GetState() == connectivity.Shutdown {
				a.end(errConnClosing, false)
			}
		}
	}
	a.cancel()
	a.mu.Lock()
	err, byRecv := a.endErr, a.byRecv
	a.mu.Unlock()
	if err == nil || errors.Is(err, io.EOF) {
		return a, nil
	}
	var trailer metadata.MD
	if byRecv {
		trailer = a.cs.Trailer()
	}
	return nil, &committedError{attemptError(actx, err, trailer)}
}

// openStream is a client-streaming or bidirectional stream once open: the caller's.
type openStream struct {
	grpc.ClientStream
	call   *streamCall
	a      *streamAttempt
	server bool // bidirectional: RecvMsg until an error
}

func (o *openStream) SendMsg(m any) error {
	return o.call.sendResult(o.a, o.ClientStream.SendMsg(m))
}

func (o *openStream) RecvMsg(m any) error {
	err := o.ClientStream.RecvMsg(m)
	if err == nil && o.server {
		return nil
	}
	return o.call.ended(o.a, err, m) // the stream has ended
}

// serverStream is a server-streaming call: started at the first RecvMsg or Header.
type serverStream struct {
	call      *streamCall
	mu        sync.Mutex
	started   bool
	err       error
	a         *streamAttempt
	delivered bool // the first message went to the caller
}

func (s *serverStream) start(first any) error {
	if s.started {
		return s.err
	}
	s.started = true
	s.a, s.err = s.call.run(first)
	return s.err
}

func (s *serverStream) Header() (metadata.MD, error) {
	s.mu.Lock()
	err := s.start(nil)
	a := s.a
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if a.cs == nil {
		return nil, nil // a fallback's message
	}
	return a.cs.Header()
}

func (s *serverStream) Trailer() metadata.MD {
	s.mu.Lock()
	a := s.a
	s.mu.Unlock()
	if a == nil || a.cs == nil {
		return nil
	}
	return a.cs.Trailer()
}

func (s *serverStream) CloseSend() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started {
		s.call.closed = true
		return nil
	}
	if s.a == nil || s.a.cs == nil {
		return nil
	}
	return s.a.cs.CloseSend()
}

func (s *serverStream) Context() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.a != nil && s.a.cs != nil {
		return s.a.cs.Context()
	}
	return s.call.ctx
}

// SendMsg keeps a copy of a request sent before the call starts (grpc serializes m at once,
// so the caller may change it after); after the start it goes to the stream.
func (s *serverStream) SendMsg(m any) error {
	s.mu.Lock()
	if !s.started {
		if pm, ok := m.(proto.Message); ok {
			m = proto.Clone(pm)
		}
		s.call.sends = append(s.call.sends, m)
		s.mu.Unlock()
		return nil
	}
	a := s.a
	s.mu.Unlock()
	if a == nil || a.cs == nil {
		return io.EOF
	}
	return s.call.sendResult(a, a.cs.SendMsg(m))
}

// RecvMsg starts the call (the first time), then reads the committed stream: its first
// message, then the rest; its end is the call's.
func (s *serverStream) RecvMsg(m any) error {
	s.mu.Lock()
	err := s.start(m)
	a := s.a
	first := !s.delivered
	s.delivered = true
	s.mu.Unlock()
	if err != nil {
		return err
	}
	if first && a.first != nil {
		return copyReply(m, a.first)
	}
	if a.eof || a.cs == nil {
		return s.call.ended(a, io.EOF, nil) // ended before any message, or a fallback's message
	}
	if err = a.cs.RecvMsg(m); err == nil {
		return nil
	}
	return s.call.ended(a, err, m)
}
