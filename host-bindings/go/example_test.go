package levee_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

const examplePolicy = `
policies:
  checkout:
    attempts: 3
    attempt-timeout: 2s
    backoff: { kind: exponential, base: 1ms, multiplier: 2, cap: 10ms, jitter: full }
    retry-on: [timeout, connection-error, "http:503", "error:flaky"]
`

type flakyErr struct{}

func (flakyErr) Error() string      { return "flaky" }
func (flakyErr) LeveeClass() string { return "flaky" }

func ExampleDo() {
	ctx := context.Background()
	eng, err := levee.Load(ctx, examplePolicy)
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, _ := eng.Policy("checkout")

	calls := 0
	err = levee.Do(ctx, p, func(ctx context.Context) error {
		calls++
		if calls < 2 {
			return flakyErr{}
		}
		return nil
	})
	fmt.Println(err, calls)

	err = levee.Do(ctx, p, func(ctx context.Context) error { return errors.New("invalid order") })
	fmt.Println(errors.Is(err, levee.ErrNonRetryable))
	// Output:
	// <nil> 2
	// true
}

func ExampleTransport() {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()

	ctx := context.Background()
	eng, err := levee.Load(ctx, examplePolicy)
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, _ := eng.Policy("checkout")
	client := &http.Client{Transport: &levee.Transport{Policy: p}}
	resp, err := client.Get(srv.URL)
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, hits.Load())
	// Output: 200 2
}

type Quote struct{ Price int }

func ExampleOf() {
	ctx := context.Background()
	eng, err := levee.Load(ctx, `
policies:
  quotes:
    attempts: 2
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
    fallbacks: [cached]
`)
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, _ := eng.Policy("quotes")
	fetchQuote := func(ctx context.Context) (Quote, error) { return Quote{}, levee.HTTPStatusError(503, "") }
	// A fallback that did not return a Quote would not compile.
	fromCache := func(ctx context.Context, cause error) (Quote, error) { return Quote{Price: 41}, nil }
	q, err := levee.Of[Quote](p).Fallback("cached", fromCache).Do(ctx, fetchQuote)
	fmt.Println(q.Price, err)
	// Output: 41 <nil>
}
