// Command levee-demo runs one policy against a URL through the Go host's
// http.RoundTripper and prints every decision of the core, one line per step.
//
//	levee-demo [-policy-file FILE] [-policy NAME] [-seed N] URL
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

const defaultDoc = `
policies:
  demo:
    attempts: 4
    attempt-timeout: 2s
    deadline: 10s
    backoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 1s, jitter: full }
    breaker: { window: { kind: count, size: 10 }, minimum-calls: 5, failure-rate: 50, open-duration: 5s }
`

func describe(v levee.Verdict) string {
	switch v.Kind() {
	case levee.VerdictAttempt:
		t := "none"
		if v.Payload() > 0 {
			t = time.Duration(v.Payload()).String()
		}
		return fmt.Sprintf("attempt #%d (timeout %s)", v.Detail(), t)
	case levee.VerdictWait:
		return fmt.Sprintf("wait %s (%s)", time.Duration(v.Payload()), v.Reason())
	case levee.VerdictRetry:
		return fmt.Sprintf("retry after %s", time.Duration(v.Payload()))
	case levee.VerdictDone:
		return "done"
	case levee.VerdictFallback:
		return fmt.Sprintf("fallback #%d (%s)", v.Payload(), v.Reason())
	case levee.VerdictFail:
		return fmt.Sprintf("fail: %s", v.Reason())
	}
	return fmt.Sprintf("invalid (code %d)", v.Detail())
}

func outcome(o levee.Outcome) string {
	switch o.Kind {
	case levee.OutcomeHTTPStatus:
		if o.Text != "" {
			return fmt.Sprintf("http %d (Retry-After %q)", o.Code, o.Text)
		}
		return fmt.Sprintf("http %d", o.Code)
	case levee.OutcomeErrorClass:
		return "error " + o.Text
	}
	return o.Kind.String()
}

func main() {
	file := flag.String("policy-file", "", "policy document (YAML or JSON); default: a built-in demo policy")
	name := flag.String("policy", "", "policy name (default: demo, else the first policy)")
	seed := flag.Uint64("seed", 1, "jitter seed")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: levee-demo [-policy-file FILE] [-policy NAME] [-seed N] URL")
		os.Exit(2)
	}
	doc := defaultDoc
	if *file != "" {
		b, err := os.ReadFile(*file)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		doc = string(b)
	}
	step := 0
	trace := func(s levee.Step) {
		step++
		at := time.Duration(s.Now).Round(time.Microsecond)
		switch s.Op {
		case "hold-success":
			fmt.Printf("go step %d t=%s call=%d report %s -> done (success held back, settled on the next start)\n", step, at, s.Call, outcome(s.Outcome))
		case "report":
			fmt.Printf("go step %d t=%s call=%d report %s -> %s\n", step, at, s.Call, outcome(s.Outcome), describe(s.Verdict))
		default:
			fmt.Printf("go step %d t=%s call=%d %s -> %s\n", step, at, s.Call, s.Op, describe(s.Verdict))
		}
	}
	listen := func(ev levee.Event) {
		fmt.Printf("go event %s reason=%s attempt=%d duration=%s %s\n", ev.Kind, ev.Reason, ev.Attempt, time.Duration(ev.Duration), ev.Name)
	}
	ctx := context.Background()
	opts := []levee.Option{levee.WithSeed(*seed), levee.WithTrace(trace), levee.WithListener(listen)}
	// demo.sh passes the workspace's fresh core module, so the demo runs this tree's core even
	// before the committed one is regenerated (./dev go-core).
	if path := os.Getenv("LEVEE_CORE_MODULE"); path != "" {
		core, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		opts = append(opts, levee.WithCoreModule(core))
	}
	e, err := levee.Load(ctx, doc, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer e.Close(ctx)
	if *name == "" {
		*name = e.Policies()[0]
		for _, n := range e.Policies() {
			if n == "demo" {
				*name = n
			}
		}
	}
	fmt.Printf("go policy %q, url %s\n", *name, flag.Arg(0))
	p, err := e.Policy(*name)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	c := &http.Client{Transport: &levee.Transport{Policy: p}}
	resp, err := c.Get(flag.Arg(0))
	if err != nil {
		fmt.Printf("go result error: %v\n", err)
		os.Exit(1)
	}
	n, _ := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	fmt.Printf("go result http %d (%d bytes)\n", resp.StatusCode, n)
}
