// go run ./example: a gRPC client under a Levee policy, against a health server on
// 127.0.0.1 that answers UNAVAILABLE to its first two calls.
package main

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"

	levee "github.com/levee-dev/levee/host-bindings/go"
	leveegrpc "github.com/levee-dev/levee/host-bindings/go/grpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

const policy = `
policies:
  backend:
    attempts: 4                  # counting the first call
    attempt-timeout: 1s          # each attempt's gRPC deadline (never past the deadline below)
    deadline: 5s
    backoff: { kind: exponential, base: 20ms, cap: 200ms, jitter: full }
    breaker: { window: { kind: count, size: 20 }, minimum-calls: 10, failure-rate: 50, open-duration: 30s }
`

func main() {
	ctx := context.Background()
	addr, stop := flakyHealthServer(2)
	defer stop()

	eng, err := levee.Load(ctx, policy, levee.WithListener(func(ev levee.Event) {
		if ev.Kind == levee.EventRetryScheduled {
			fmt.Printf("levee: retry of attempt %d (key %s)\n", ev.Attempt, ev.Key)
		}
	}))
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, err := eng.Policy("backend")
	if err != nil {
		panic(err)
	}
	i := &leveegrpc.Interceptor{Policy: p} // key: the target authority, one breaker per backend
	cc, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDisableRetry(), // retry in one layer only: Levee's
		grpc.WithChainUnaryInterceptor(i.Unary),
		grpc.WithChainStreamInterceptor(i.Stream))
	if err != nil {
		panic(err)
	}
	defer cc.Close()

	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		// a *leveegrpc.Error: status.Code(err) is the last attempt's status, or RESOURCE_EXHAUSTED
		// (rate limit, bulkhead), UNAVAILABLE (open breaker); errors.Is(err, levee.ErrBreakerOpen)...
		fmt.Println("failed:", status.Code(err), err)
		return
	}
	fmt.Println("status:", resp.GetStatus())
}

// flakyHealthServer serves grpc's health service on 127.0.0.1, failing the first n calls.
func flakyHealthServer(n int32) (addr string, stop func()) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	var calls atomic.Int32
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if calls.Add(1) <= n {
			return nil, status.Error(codes.Unavailable, "warming up")
		}
		return h(ctx, req)
	}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	return lis.Addr().String(), srv.Stop
}
