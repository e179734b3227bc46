package leveetest_test

import (
	"context"
	"errors"
	"fmt"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

// A policy that retries for a minute, tested without waiting a minute.
func ExampleNoWaits() {
	ctx := context.Background()
	clk := leveetest.NewAutoClock() // what NoWaits installs, kept to read the time
	eng, err := levee.Load(ctx, `
policies:
  api:
    attempts: 4
    backoff: { kind: constant, base: 20s, cap: 20s, jitter: none }
`, levee.WithClock(clk))
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, _ := eng.Policy("api")
	err = levee.Do(ctx, p, func(ctx context.Context) error { return context.DeadlineExceeded })
	fmt.Println(errors.Is(err, levee.ErrRetriesExhausted), clk.Since(leveetest.Epoch))
	// Output: true 1m0s
}
