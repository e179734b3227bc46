package leveegrpc

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

// Stream is the grpc.StreamClientInterceptor. A stream is one call under the policy, and an
// attempt ends when the stream commits (gRPC A6's rule): at its first response message (or
// its end, when it ends before any), or at its response headers when the caller asks for
// them first. Until then a failure is an attempt's outcome, which the core may retry (a new
// stream, the request sent again); after it the stream is the caller's, under the attempt's
// deadline, and a failure is final: grpc returns it to the caller, and the core is not told
// (its call ended with the commit).
//
// A server-streaming call starts at the caller's first RecvMsg (or Header): its request
// (the one message the generated client sends) is kept, a copy, for the attempts. A
// client-streaming or bidirectional call sends its requests as the caller writes them, not
// buffered: it is opened under the policy when the caller opens it (a failure to open is
// retried: nothing has been sent) and is never retried once open.
func (i *Interceptor) Stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	p := i.policy(method)
	if p == nil {
		if i.Policy == nil && i.PolicyFor == nil {
			return nil, ErrNoPolicy
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
	s := &streamCall{ctx: ctx, desc: desc, cc: cc, method: method, streamer: streamer, opts: opts, p: p}
	s.lopts = i.callOptions(&s.lo, ctx, method, cc, opts)
	if desc.ClientStreams {
		a, err := s.run(ctx, nil)
		if err != nil {
			return nil, err
		}
		return &openStream{ClientStream: a.cs, cancel: a.cancel, server: desc.ServerStreams}, nil
	}
	return &serverStream{call: s}, nil
}

// streamCall is one streaming call under a policy.
type streamCall struct {
	ctx      context.Context // the caller's
	desc     *grpc.StreamDesc
	cc       *grpc.ClientConn
	method   string
	streamer grpc.Streamer
	opts     []grpc.CallOption
	p        *levee.Policy
	lo       [2]levee.CallOption
	lopts    []levee.CallOption
	// the requests of a server-streaming call, sent again on every attempt
	sends  []any
	closed bool  // CloseSend was called
	first  bool  // commit at the first message (false: at the headers)
	maker  maker // of the response messages
	sent   atomic.Int32
	mu     sync.Mutex
	over   bool             // the call has ended: a stream committed later is closed
	live   []*streamAttempt // streams committed and not yet handed to the caller
}

// streamAttempt is a committed stream.
type streamAttempt struct {
	cs     grpc.ClientStream
	cancel context.CancelFunc
	first  any  // the first response message (nil: none yet)
	eof    bool // the stream ended, OK, before any message
}

// valuesOf is a context with the Done, Err and Deadline of its embedded context and the
// values of another (the attempt's: its trace span, say).
type valuesOf struct {
	context.Context
	values context.Context
}

func (c valuesOf) Value(k any) any { return c.values.Value(k) }

// run runs the call; first is a message of the response type (nil: commit at the stream's
// opening for a client stream, at its headers for a server stream).
func (s *streamCall) run(ctx context.Context, first any) (*streamAttempt, error) {
	if first != nil {
		s.first, s.maker = true, makerOf(first)
	}
	v, err := levee.DoValue(ctx, s.p, s.attempt, s.lopts...)
	s.mu.Lock()
	s.over = true
	live := s.live
	s.live = nil
	s.mu.Unlock()
	a, _ := v.(*streamAttempt)
	for _, l := range live {
		if l != a {
			l.cancel() // a hedge that committed too, after the winner
		}
	}
	if err != nil {
		return nil, statusError(err)
	}
	if a == nil {
		// a fallback's value: one response message of a server stream
		if first == nil || s.desc.ClientStreams {
			return nil, status.Error(codes.Internal, "leveegrpc: a fallback cannot stand for this stream (only for a server stream's messages, read with RecvMsg)")
		}
		return &streamAttempt{first: v, cancel: func() {}}, nil
	}
	return a, nil
}

func (s *streamCall) attempt(actx context.Context) (any, error) {
	n := s.sent.Add(1)
	// The stream outlives the attempt's function (it is the caller's once committed): it gets
	// a context of the caller's with the attempt's deadline, cancelled with the attempt's
	// context until it commits.
	var dctx context.Context
	var cancel context.CancelFunc
	if dl, ok := actx.Deadline(); ok {
		dctx, cancel = context.WithDeadline(s.ctx, dl)
	} else {
		dctx, cancel = context.WithCancel(s.ctx)
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

// openStream is a client-streaming or bidirectional stream once open: the caller's.
type openStream struct {
	grpc.ClientStream
	cancel context.CancelFunc
	server bool // bidirectional: RecvMsg until an error
}

func (o *openStream) RecvMsg(m any) error {
	err := o.ClientStream.RecvMsg(m)
	if err != nil || !o.server {
		o.cancel() // the stream has ended
	}
	return err
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
	s.a, s.err = s.call.run(s.call.ctx, first)
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
	defer s.mu.Unlock()
	if !s.started {
		if pm, ok := m.(proto.Message); ok {
			m = proto.Clone(pm)
		}
		s.call.sends = append(s.call.sends, m)
		return nil
	}
	if s.a == nil || s.a.cs == nil {
		return io.EOF
	}
	return s.a.cs.SendMsg(m)
}

// RecvMsg starts the call (the first time), then reads the committed stream: its first
// message, then the rest, each failure final.
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
		a.cancel() // the stream has ended
		return io.EOF
	}
	err = a.cs.RecvMsg(m)
	if err != nil {
		a.cancel() // the stream has ended
	}
	return err
}
