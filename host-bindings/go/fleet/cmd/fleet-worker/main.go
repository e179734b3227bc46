// Command fleet-worker is one Go process of the fleet test (fleet/tests/run.sh):
// it runs a scenario against the shared Redis from a common wall-clock start and
// prints one JSON line of counts. Given several comma-separated addresses it
// talks to a Redis Cluster through go-redis's ClusterClient
// (fleet/tests/cluster.sh), and -keys spreads its calls over several keys.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/fleet"
	"github.com/redis/go-redis/v9"
)

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

type phase struct {
	Ok      int `json:"ok"`
	Open    int `json:"open"`
	Failed  int `json:"failed"`
	Invoked int `json:"invoked"`
}

func main() {
	addr := flag.String("addr", "", "Redis host:port")
	node := flag.String("node", "", "node name")
	start := flag.Float64("start", 0, "wall-clock start (unix seconds)")
	seconds := flag.Float64("seconds", 10, "duration")
	bad := flag.String("bad", "", "from:to seconds after start when the dependency fails")
	failures := flag.Int("failures", 0, "failures to record (records mode)")
	policies := flag.String("policies", "", "policy document")
	script := flag.String("script", "", "throughput: a GCRA script file (fleet/lua/gcra.lua or fleet/tests/redis_rate.lua)")
	keyList := flag.String("keys", "k", "comma-separated keys the calls go round")
	policyName := flag.String("policy", "", "the policy (default: the mode's)")
	flag.Parse()
	mode := flag.Arg(0)
	redis.SetLogger(quiet{}) // the scenario counts what matters; go-redis's dial logs are noise here
	doc, err := os.ReadFile(*policies)
	if err != nil {
		fail(err)
	}
	var quorum atomic.Int64
	var qmu sync.Mutex
	quorumKeys := map[string]int{}
	e, err := levee.Load(context.Background(), string(doc), levee.WithListener(func(ev levee.Event) {
		if ev.Name == "fleet-quorum" {
			quorum.Add(1)
			qmu.Lock()
			quorumKeys[ev.Key]++
			qmu.Unlock()
		}
	}))
	if err != nil {
		fail(err)
	}
	var events []string
	evCh := make(chan string, 64)
	opts := fleet.Options{Node: *node, Listener: func(ev fleet.Event) {
		select {
		case evCh <- ev.Kind:
		default:
		}
	}}
	var f *fleet.Fleet
	if strings.Contains(*addr, ",") {
		// The cluster test's client: short timeouts as the policies' fleet timeout, the
		// per-operation context deadline honoured, and go-redis following MOVED/ASK.
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(*addr, ","),
			DialTimeout: 250 * time.Millisecond, ReadTimeout: 250 * time.Millisecond,
			WriteTimeout: 250 * time.Millisecond, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 8})
		defer rdb.Close()
		f, err = fleet.NewWithClient(e, rdb, opts)
	} else {
		f, err = fleet.New(e, *addr, opts)
	}
	if err != nil {
		fail(err)
	}
	out := map[string]any{"node": *node, "lang": "go", "mode": mode}
	at := time.Unix(0, int64(*start*1e9))
	ctx := context.Background()
	if mode == "bench" {
		out["ns_per_call"] = benchCalls(ctx, e, f)
		emit(out)
		_ = f.Close()
		return
	}
	if mode == "throughput" {
		out["throughput"] = throughput(*addr, *script, strings.Split(*keyList, ","), at, time.Duration(*seconds*1e9))
		emit(out)
		_ = f.Close()
		return
	}
	if mode == "records" {
		for range *failures {
			_ = f.Do(ctx, "count", "k", func(context.Context) error { return io.ErrUnexpectedEOF })
		}
		time.Sleep(time.Until(at))
		for range 50 {
			f.Sync("count", "k")
		}
		out["conflicts"], out["publications"] = f.Conflicts.Load(), f.Publication.Load()
		emit(out)
		_ = f.Close()
		return
	}
	from, to := -1.0, -1.0
	if *bad != "" {
		parts := strings.Split(*bad, ":")
		from, _ = strconv.ParseFloat(parts[0], 64)
		to, _ = strconv.ParseFloat(parts[1], 64)
	}
	policy := map[string]string{"rate": "rate", "rate-strict": "rate-strict"}[mode]
	if policy == "" {
		policy = "dep"
	}
	if *policyName != "" {
		policy = *policyName
	}
	keys := strings.Split(*keyList, ",")
	perKey := map[string]map[string]int{}
	for _, k := range keys {
		perKey[k] = map[string]int{"ok": 0, "limited": 0, "open": 0}
	}
	counts := map[string]int{"ok": 0, "limited": 0, "open": 0, "failed": 0, "errors": 0, "invoked": 0}
	phases := map[string]*phase{}
	var samples []string
	time.Sleep(time.Until(at))
	end := at.Add(time.Duration(*seconds * 1e9))
	sweepOk := false
	var slowest time.Duration
	for i, now := 0, time.Now(); now.Before(end); i, now = i+1, time.Now() {
		key := keys[i%len(keys)]
		if len(keys) > 1 && i%len(keys) == 0 {
			// One round over the keys admitted nothing: every key's bucket is empty.
			if i > 0 && !sweepOk && (mode == "rate" || mode == "rate-strict") {
				time.Sleep(time.Millisecond)
			}
			sweepOk = false
		}
		t := now.Sub(at).Seconds()
		k := strconv.Itoa(int(t))
		ph := phases[k]
		if ph == nil {
			ph = &phase{}
			phases[k] = ph
		}
		failing := from <= t && t < to
		begun := time.Now()
		err := f.Do(ctx, policy, key, func(context.Context) error {
			counts["invoked"]++
			ph.Invoked++
			if failing {
				return fmt.Errorf("the dependency is down: %w", io.ErrUnexpectedEOF)
			}
			return nil
		})
		var le *levee.Error
		switch {
		case err == nil:
			counts["ok"]++
			ph.Ok++
			perKey[key]["ok"]++
			sweepOk = true
		case errors.Is(err, levee.ErrRateLimited):
			counts["limited"]++
			perKey[key]["limited"]++
			errors.As(err, &le)
			if len(keys) == 1 {
				time.Sleep(min(max(le.RetryAfter, time.Millisecond), 5*time.Millisecond))
			}
		case errors.Is(err, levee.ErrBreakerOpen):
			counts["open"]++
			ph.Open++
			perKey[key]["open"]++
		case errors.As(err, &le):
			counts["failed"]++
			ph.Failed++
		default:
			counts["errors"]++
			if len(samples) < 5 {
				samples = append(samples, err.Error())
			}
		}
		slowest = max(slowest, time.Since(begun))
		if (mode == "breaker" || mode == "steady") && (i+1)%len(keys) == 0 {
			time.Sleep(5 * time.Millisecond)
		}
	}
	for len(evCh) > 0 {
		events = append(events, <-evCh)
	}
	for k, v := range counts {
		out[k] = v
	}
	out["phases"], out["quorum_events"], out["fleet_events"] = phases, quorum.Load(), events
	out["max_call_ms"] = float64(slowest.Microseconds()/100) / 10
	if len(keys) > 1 {
		qmu.Lock()
		out["per_key"], out["quorum_keys"] = perKey, maps.Clone(quorumKeys)
		qmu.Unlock()
	}
	out["conflicts"], out["publications"], out["error_samples"] = f.Conflicts.Load(), f.Publication.Load(), samples
	emit(out)
	_ = f.Close()
}

func emit(v map[string]any) {
	b, _ := json.Marshal(v)
	fmt.Println(string(b))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "fleet-worker:", err)
	os.Exit(1)
}

// benchCalls measures the cost of one call per policy of fleet/tests/bench.yaml.
func benchCalls(ctx context.Context, e *levee.Engine, f *fleet.Fleet) map[string]float64 {
	res := map[string]float64{}
	noop := func(context.Context) error { return nil }
	for _, name := range []string{"local", "async", "lease", "strict-rate", "strict"} {
		p, err := e.Policy(name)
		if err != nil {
			fail(err)
		}
		run := func() error { return f.Do(ctx, name, "k", noop) }
		if name == "local" {
			run = func() error { return p.Do(ctx, noop, levee.WithKey("k")) }
		}
		for range 200 { // warm up
			_ = run()
		}
		best := 0.0
		for range 3 { // the best of 3 rounds of 0.5 s: the machine is shared
			n, start := 0, time.Now()
			for time.Since(start) < 500*time.Millisecond {
				if err := run(); err != nil {
					fail(fmt.Errorf("%s: %w", name, err))
				}
				n++
			}
			if c := float64(time.Since(start).Nanoseconds()) / float64(n); best == 0 || c < best {
				best = c
			}
		}
		res[name] = best
	}
	return res
}

// throughput runs one GCRA script as fast as one connection allows: decisions and admissions.
// Against a cluster (several addresses) the decisions go round the keys given, each under
// its own hash tag, so that they spread over the shards as the fleet's keys do.
func throughput(addr, script string, keys []string, at time.Time, d time.Duration) map[string]any {
	src, err := os.ReadFile(script)
	if err != nil {
		fail(err)
	}
	var rdb redis.UniversalClient
	if strings.Contains(addr, ",") {
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(addr, ",")})
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: addr})
	}
	defer rdb.Close()
	names := []string{"bench:ours"}
	if !strings.HasSuffix(script, "gcra.lua") {
		names[0] = "bench:redis_rate"
	}
	if len(keys) > 1 {
		names = names[:0]
		for _, k := range keys {
			names = append(names, "bench:{"+k+"}")
		}
	}
	s := redis.NewScript(string(src))
	ctx := context.Background()
	ours := strings.HasSuffix(script, "gcra.lua")
	if err := s.Load(ctx, rdb).Err(); err != nil {
		fail(err)
	}
	time.Sleep(time.Until(at))
	decisions, admitted := 0, 0
	for start := time.Now(); time.Since(start) < d; decisions++ {
		var r []any
		key := []string{names[decisions%len(names)]}
		if ours {
			r, err = s.Run(ctx, rdb, key, 1000000, 50, 1, 0, 0).Slice()
		} else {
			r, err = s.Run(ctx, rdb, key, 50, 1000, 1, 1).Slice()
		}
		if err != nil {
			fail(err)
		}
		if (ours && r[0].(int64) == 0) || (!ours && r[0].(int64) == 1) {
			admitted++
		}
	}
	return map[string]any{"decisions": decisions, "admitted": admitted, "seconds": d.Seconds()}
}
