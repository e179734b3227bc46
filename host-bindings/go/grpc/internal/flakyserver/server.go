// Package flakyserver is the Go server of grpc/flaky.proto, the scripted dependency of the
// gRPC tests (and of the benchmark): each request carries its script, the server plays the
// step of the attempt's number and counts what it saw.
package flakyserver

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakypb"
)

// Server is a running Flaky server on 127.0.0.1.
type Server struct {
	pb.UnimplementedFlakyServer
	// Addr is host:port of the listener (a port the OS chose).
	Addr string
	srv  *grpc.Server
	mu   sync.Mutex
	seen map[string]*script
}

type script struct {
	attempts, started, finished, cancelled uint32
}

// Start serves on 127.0.0.1 at a port the OS picks; Stop ends it.
func Start() (*Server, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{Addr: lis.Addr().String(), srv: grpc.NewServer(), seen: map[string]*script{}}
	pb.RegisterFlakyServer(s.srv, s)
	go func() { _ = s.srv.Serve(lis) }()
	return s, nil
}

// Stop ends the server (the calls in flight are cut).
func (s *Server) Stop() { s.srv.Stop() }

// begin counts an attempt of the script and returns its number and step.
func (s *Server) begin(req *pb.Request) (uint32, *pb.Step) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sc := s.seen[req.GetScript()]
	if sc == nil {
		sc = &script{}
		s.seen[req.GetScript()] = sc
	}
	sc.attempts++
	sc.started++
	n := sc.attempts
	steps := req.GetSteps()
	if len(steps) == 0 {
		return n, &pb.Step{}
	}
	return n, steps[min(int(n), len(steps))-1]
}

func (s *Server) end(name string, cancelled bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sc := s.seen[name]
	if cancelled {
		sc.cancelled++
	} else {
		sc.finished++
	}
}

// wait sleeps the step's delay, or until the call is cancelled (false).
func wait(ctx context.Context, ms uint32) bool {
	if ms == 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(time.Duration(ms) * time.Millisecond)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func reply(ctx context.Context, n uint32, req *pb.Request) *pb.Reply {
	r := &pb.Reply{Attempt: n, DeadlineMs: -1, Payload: req.GetPayload()}
	if dl, ok := ctx.Deadline(); ok {
		r.DeadlineMs = time.Until(dl).Milliseconds()
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("grpc-previous-rpc-attempts"); len(v) > 0 {
			r.PreviousAttempts = v[0]
		}
		if v := md.Get(":authority"); len(v) > 0 {
			r.Authority = v[0]
		}
	}
	return r
}

// finish ends an attempt with the step's status (and its pushback trailer).
func finish(ctx context.Context, step *pb.Step) error {
	if step.Pushback != nil {
		_ = grpc.SetTrailer(ctx, metadata.Pairs("grpc-retry-pushback-ms", step.GetPushback()))
	}
	if step.GetCode() == 0 {
		return nil
	}
	return status.Error(codes.Code(step.GetCode()), step.GetMessage())
}

// Unary answers after the step's delay with a reply or the step's status.
func (s *Server) Unary(ctx context.Context, req *pb.Request) (*pb.Reply, error) {
	n, step := s.begin(req)
	r := reply(ctx, n, req) // the deadline as it arrived
	if !wait(ctx, step.GetDelayMs()) {
		s.end(req.GetScript(), true)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	s.end(req.GetScript(), false)
	if err := finish(ctx, step); err != nil {
		return nil, err
	}
	return r, nil
}

// ServerStream sends step.messages replies (each after the delay), then the step's status.
func (s *Server) ServerStream(req *pb.Request, stream grpc.ServerStreamingServer[pb.Reply]) error {
	ctx := stream.Context()
	n, step := s.begin(req)
	r := reply(ctx, n, req)
	for i := uint32(0); i < step.GetMessages(); i++ {
		if !wait(ctx, step.GetDelayMs()) {
			s.end(req.GetScript(), true)
			return status.FromContextError(ctx.Err()).Err()
		}
		if err := stream.Send(r); err != nil {
			s.end(req.GetScript(), true)
			return err
		}
	}
	if step.GetMessages() == 0 && !wait(ctx, step.GetDelayMs()) {
		s.end(req.GetScript(), true)
		return status.FromContextError(ctx.Err()).Err()
	}
	s.end(req.GetScript(), false)
	return finish(ctx, step)
}

// ClientStream reads every request, then plays the step of the first one's script.
func (s *Server) ClientStream(stream grpc.ClientStreamingServer[pb.Request, pb.Reply]) error {
	ctx := stream.Context()
	var first *pb.Request
	var received uint32
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if first == nil {
			first = req
		}
		received++
	}
	if first == nil {
		return status.Error(codes.InvalidArgument, "no request")
	}
	n, step := s.begin(first)
	r := reply(ctx, n, first)
	r.Received = received
	if !wait(ctx, step.GetDelayMs()) {
		s.end(first.GetScript(), true)
		return status.FromContextError(ctx.Err()).Err()
	}
	s.end(first.GetScript(), false)
	if err := finish(ctx, step); err != nil {
		return err
	}
	return stream.SendAndClose(r)
}

// Stats tells what the server saw of a script.
func (s *Server) Stats(_ context.Context, req *pb.StatsRequest) (*pb.StatsReply, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sc := s.seen[req.GetScript()]
	if sc == nil {
		return &pb.StatsReply{}, nil
	}
	return &pb.StatsReply{Started: sc.started, Finished: sc.finished, Cancelled: sc.cancelled}, nil
}
