// Package leveegrpc runs the calls of a google.golang.org/grpc client under Levee policies:
// grpc.UnaryClientInterceptor and grpc.StreamClientInterceptor built on the Go host's calls
// (levee.DoValue), so the core decides everything a call needs, as for HTTP (transport.go in
// the parent module): which status is retried (the policy's retry-on), the delays, the
// grpc-retry-pushback-ms trailer (passed to the core raw), the A6 throttling, breakers,
// limits, deadlines and hedging. This package does the I/O: each attempt is one call of the
// invoker (or one stream), under the attempt's context.
//
// Turn gRPC's own retries off on a channel whose calls go through this interceptor
// (grpc.WithDisableRetry()), so that calls are retried in one layer only.
package leveegrpc

import (
	"context"
	"errors"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Interceptor runs the calls of a gRPC client under a policy. Its methods Unary and Stream
// are the interceptors to give grpc.WithChainUnaryInterceptor and
// grpc.WithChainStreamInterceptor (or grpc.WithUnaryInterceptor, grpc.WithStreamInterceptor).
// It is safe for use by many goroutines; do not change its fields once in use.
type Interceptor struct {
	// Policy is applied to every call (unless PolicyFor gives another).
	Policy *levee.Policy
	// PolicyFor, when set, picks the policy of a call by its full method name
	// ("/package.Service/Method"); when it returns nil, Policy is applied, and when that is nil
	// too the call runs without Levee.
	PolicyFor func(method string) *levee.Policy
	// Key names the key of a call for per-key breakers and limits (nil: Authority of the
	// channel and the call's options, the target authority).
	Key func(ctx context.Context, method string, cc *grpc.ClientConn, opts []grpc.CallOption) string
	// OnRetry is called before the sleep of each retry (see levee.OnRetry).
	OnRetry func(levee.RetryInfo)

	last atomic.Pointer[authority] // the authority of the channel seen last
}

// authority is a channel's default key, kept: its target does not change.
type authority struct {
	cc  *grpc.ClientConn
	key string
}

// UnaryClientInterceptor is (&Interceptor{Policy: p}).Unary.
func UnaryClientInterceptor(p *levee.Policy) grpc.UnaryClientInterceptor {
	return (&Interceptor{Policy: p}).Unary
}

// StreamClientInterceptor is (&Interceptor{Policy: p}).Stream.
func StreamClientInterceptor(p *levee.Policy) grpc.StreamClientInterceptor {
	return (&Interceptor{Policy: p}).Stream
}

// ErrNoPolicy is the error of a call through an Interceptor with neither Policy nor PolicyFor.
var ErrNoPolicy = errors.New("leveegrpc: the Interceptor has no Policy (set Interceptor.Policy or PolicyFor)")

// Metadata keys sent on every attempt.
const (
	// MetadataAttempt is levee.HeaderAttempt as gRPC metadata: the attempt number (1 on the
	// first), so that a Levee filter in an Envoy on the way adds no retries (docs/envoy.md).
	MetadataAttempt = levee.GRPCAttemptHeader
	// MetadataPreviousAttempts is gRPC A6's count of the attempts already sent for this call,
	// on every attempt after the first.
	MetadataPreviousAttempts = levee.GRPCPreviousAttemptsHeader
)

// policy is the policy of a call to method (nil: the call runs without Levee).
func (i *Interceptor) policy(method string) *levee.Policy {
	if i.PolicyFor != nil {
		if p := i.PolicyFor(method); p != nil {
			return p
		}
	}
	return i.Policy
}

// callOptions writes the options of the Levee call of a gRPC call into o and returns them.
func (i *Interceptor) callOptions(o *[2]levee.CallOption, ctx context.Context, method string, cc *grpc.ClientConn, opts []grpc.CallOption) []levee.CallOption {
	var key string
	switch {
	case i.Key != nil:
		key = i.Key(ctx, method, cc, opts)
	case hasAuthority(opts):
		key = Authority(cc, opts...)
	default:
		if a := i.last.Load(); a != nil && a.cc == cc {
			key = a.key
		} else {
			key = Authority(cc)
			i.last.Store(&authority{cc: cc, key: key})
		}
	}
	o[0] = levee.WithKey(key)
	if i.OnRetry != nil {
		o[1] = levee.OnRetry(i.OnRetry)
		return o[:2]
	}
	return o[:1]
}

func hasAuthority(opts []grpc.CallOption) bool {
	for _, o := range opts {
		if _, ok := o.(grpc.AuthorityOverrideCallOption); ok {
			return true
		}
	}
	return false
}

// Authority is the :authority a call on cc sends when the channel sets none of its own: the
// call's grpc.CallAuthority, else the endpoint of the channel's target ("host:port" of
// "dns:///host:port"; "localhost:port" for a target ":port"), as grpc-go derives it. A channel
// made with grpc.WithAuthority, a server name in its credentials or a resolver that overrides
// the authority sends another: give the Interceptor a Key for those.
func Authority(cc *grpc.ClientConn, opts ...grpc.CallOption) string {
	for _, o := range opts {
		if a, ok := o.(grpc.AuthorityOverrideCallOption); ok && a.Authority != "" {
			return a.Authority
		}
	}
	if cc == nil {
		return ""
	}
	u, err := url.Parse(cc.CanonicalTarget())
	if err != nil {
		return cc.Target()
	}
	ep := resolver.Target{URL: *u}.Endpoint()
	if strings.HasPrefix(ep, ":") {
		return "localhost" + ep
	}
	return ep
}

// Unary is the grpc.UnaryClientInterceptor: it runs the call under the policy, each attempt
// one call of invoker under the attempt's context (its deadline the attempt's timeout, never
// past the policy's deadline nor the caller's), and reports the attempt's status with the
// raw grpc-retry-pushback-ms of its trailers. A hedged call's attempts each get a reply of
// their own; the winner's is copied into reply.
func (i *Interceptor) Unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	p := i.policy(method)
	if p == nil {
		if i.Policy == nil && i.PolicyFor == nil {
			return ErrNoPolicy
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	u := &unaryCall{method: method, req: req, cc: cc, invoker: invoker, opts: opts, replies: replies{reply: reply, maker: makerOf(reply)}}
	v, err := levee.DoValue(ctx, p, u.attempt, i.callOptions(&u.lopts, ctx, method, cc, opts)...)
	u.replies.settle()
	if err != nil {
		return statusError(err)
	}
	return u.replies.adopt(v)
}

// unaryCall is one unary call in progress.
type unaryCall struct {
	method  string
	req     any
	cc      *grpc.ClientConn
	invoker grpc.UnaryInvoker
	opts    []grpc.CallOption
	lopts   [2]levee.CallOption
	sent    atomic.Int32 // attempts started
	replies replies
}

func (u *unaryCall) attempt(ctx context.Context) (any, error) {
	n := u.sent.Add(1)
	msg, own, err := u.replies.take()
	if err != nil {
		return nil, err
	}
	if own {
		defer u.replies.release() // also when the invoker panics (settle would wait forever)
	}
	var trailer metadata.MD
	opts := append(u.opts[:len(u.opts):len(u.opts)], grpc.Trailer(&trailer))
	err = u.invoker(attemptContext(ctx, n), u.method, u.req, msg, u.cc, opts...)
	if err != nil {
		return nil, attemptError(ctx, err, trailer)
	}
	return msg, nil
}

// attemptContext is ctx with attempt n's metadata.
func attemptContext(ctx context.Context, n int32) context.Context {
	if n <= 1 {
		return metadata.AppendToOutgoingContext(ctx, MetadataAttempt, "1")
	}
	return metadata.AppendToOutgoingContext(ctx, MetadataAttempt, strconv.Itoa(int(n)),
		MetadataPreviousAttempts, strconv.Itoa(int(n-1)))
}

// outcomeError is the error of an attempt: the gRPC status error as it came, with the
// outcome the core is told (levee.OutcomeError).
type outcomeError struct {
	err error
	o   levee.Outcome
}

func (e *outcomeError) Error() string               { return e.err.Error() }
func (e *outcomeError) Unwrap() error               { return e.err }
func (e *outcomeError) LeveeOutcome() levee.Outcome { return e.o }

// attemptError is the error an attempt run under actx reports: its gRPC status, with the
// raw pushback of its trailer; DEADLINE_EXCEEDED once the attempt's deadline has passed is a
// timeout (the attempt's timeout, which the core granted). An error without a gRPC status
// is left to levee.Classify.
func attemptError(actx context.Context, err error, trailer metadata.MD) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	if st.Code() == codes.DeadlineExceeded {
		if dl, has := actx.Deadline(); actx.Err() != nil || (has && !time.Now().Before(dl)) {
			return &outcomeError{err: err, o: levee.Outcome{Kind: levee.OutcomeTimeout}}
		}
	}
	var pushback string
	if v := trailer.Get(levee.TrailerPushback); len(v) > 0 {
		pushback = v[0]
	}
	return &outcomeError{err: err, o: levee.Outcome{Kind: levee.OutcomeGRPCStatus, Code: int32(st.Code()), Text: pushback}}
}

// replies hands each attempt of a call the message it receives into: the caller's reply
// when no other attempt is writing it, a new message of its type otherwise (a hedge while
// an attempt is in flight); the call adopts the winner's once no attempt writes the caller's.
type replies struct {
	reply any
	maker maker
	mu    sync.Mutex
	held  bool          // an attempt is writing reply
	free  chan struct{} // closed when it is done (made by a waiter)
}

// take gives an attempt its message; own says it is the caller's reply.
func (r *replies) take() (msg any, own bool, err error) {
	r.mu.Lock()
	if !r.held {
		r.held = true
		r.mu.Unlock()
		return r.reply, true, nil
	}
	r.mu.Unlock()
	m, err := r.maker.make()
	return m, false, err
}

func (r *replies) release() {
	r.mu.Lock()
	r.held = false
	if r.free != nil {
		close(r.free)
		r.free = nil
	}
	r.mu.Unlock()
}

// settle waits until no attempt writes the caller's reply (an attempt the core cancelled
// returns as soon as grpc has cut its call).
func (r *replies) settle() {
	for {
		r.mu.Lock()
		if !r.held {
			r.mu.Unlock()
			return
		}
		if r.free == nil {
			r.free = make(chan struct{})
		}
		ch := r.free
		r.mu.Unlock()
		<-ch
	}
}

// adopt makes v (the winning attempt's message, or a fallback's value) the caller's reply.
func (r *replies) adopt(v any) error {
	if sameRef(v, r.reply) {
		return nil
	}
	if err := copyReply(r.reply, v); err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	return nil
}

// errNotCopyable is the error of a concurrent attempt whose reply type cannot be made anew.
type errNotCopyable struct{ t reflect.Type }

func (e errNotCopyable) Error() string {
	return "leveegrpc: a reply of type " + e.t.String() + " cannot be made anew for a concurrent attempt (not a pointer)"
}

// maker makes new, empty messages of one type. It is taken from the caller's message on the
// caller's goroutine, before any attempt runs: an attempt never reads the caller's message,
// which another attempt (or, once the call is over, the caller) may be writing.
type maker struct {
	mt protoreflect.MessageType // a proto message's
	t  reflect.Type             // another pointer type's
}

func makerOf(m any) maker {
	if pm, ok := m.(proto.Message); ok && pm != nil {
		return maker{mt: pm.ProtoReflect().Type()}
	}
	return maker{t: reflect.TypeOf(m)}
}

// make is a new, empty message.
func (k maker) make() (any, error) {
	if k.mt != nil {
		return k.mt.New().Interface(), nil
	}
	if k.t == nil || k.t.Kind() != reflect.Pointer {
		return nil, levee.ClassError("ReplyNotCopyable", errNotCopyable{k.t})
	}
	return reflect.New(k.t.Elem()).Interface(), nil
}

func sameRef(a, b any) bool {
	if ma, ok := a.(proto.Message); ok {
		mb, ok := b.(proto.Message)
		return ok && ma == mb
	}
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	return va.IsValid() && vb.IsValid() && va.Kind() == reflect.Pointer && vb.Kind() == reflect.Pointer &&
		va.Type() == vb.Type() && va.UnsafePointer() == vb.UnsafePointer()
}

// errFallbackReply is the error of a fallback whose value is not the method's reply.
type errFallbackReply struct{ got, want reflect.Type }

func (e errFallbackReply) Error() string {
	got := "nil"
	if e.got != nil {
		got = e.got.String()
	}
	return "leveegrpc: the fallback returned " + got + ", not the method's reply " + e.want.String()
}

// copyReply copies src (a message of dst's type) into dst.
func copyReply(dst, src any) error {
	if md, ok := dst.(proto.Message); ok {
		ms, ok := src.(proto.Message)
		if !ok || ms == nil || ms.ProtoReflect().Descriptor().FullName() != md.ProtoReflect().Descriptor().FullName() {
			return errFallbackReply{reflect.TypeOf(src), reflect.TypeOf(dst)}
		}
		proto.Reset(md)
		proto.Merge(md, ms)
		return nil
	}
	vd, vs := reflect.ValueOf(dst), reflect.ValueOf(src)
	if !vd.IsValid() || !vs.IsValid() || vd.Kind() != reflect.Pointer || vs.Type() != vd.Type() || vs.IsNil() {
		return errFallbackReply{reflect.TypeOf(src), reflect.TypeOf(dst)}
	}
	vd.Elem().Set(vs.Elem())
	return nil
}
