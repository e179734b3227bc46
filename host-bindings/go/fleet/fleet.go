// Package fleet shares a Levee engine's breaker evidence, retry budget and
// rate limit with every process that runs the same policies, through Redis
// (go-redis). See docs/fleet.md.
//
// The core decides and this package carries bytes: it reads a key's shared
// state and the store's clock, asks the engine to merge its evidence in
// (Engine.FleetMerge), writes the result back with a compare-and-set in Lua
// (no lock; a conflict merges again into what the store holds) and hands the
// accepted bytes to the engine (Engine.FleetApply), which applies the quorum
// rule, probe coordination and the shared budget. The fleet rate limit is GCRA
// in Lua on Redis's TIME, with the parameters of the engine's fleet plan.
//
// Publication is asynchronous (a goroutine, every publish-every) unless the
// policy says publish: strict. Every Redis operation is bounded by the
// policy's timeout; past it, or on any Redis error, every call goes on with
// local-only decisions at once (the engine's own breaker, budget and limit),
// an Event{Kind: "degraded"} is emitted, and the store is tried again every
// retry-every; when it answers, Event{Kind: "restored"}, and the state
// converges with the next publication. Nothing on the data path fails because
// of Redis.
//
// A Redis Cluster is the client you already have: NewWithClient(e,
// redis.NewClusterClient(...), o). Every key the fleet writes carries the hash
// tag {policy/key} and every script touches one key, so go-redis routes each
// script to the key's shard and follows MOVED and ASK itself; the scripts are
// loaded on every shard, and a shard that lost its script cache (a restarted
// or promoted node) answers NOSCRIPT once and gets the script with EVAL. A
// cluster is one store: when any shard fails to answer, the whole fleet goes
// local-only, and it is restored when every master serves again.
package fleet

import (
	"container/list"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/redis/go-redis/v9"
)

//go:embed lua/gcra.lua
var gcraLua string

//go:embed lua/state.lua
var stateLua string

var (
	gcraScript  = redis.NewScript(gcraLua)
	stateScript = redis.NewScript(stateLua)
)

// Event is something the fleet option did: Kind is "degraded" (the store is
// slow or down: local decisions only), "restored" (it answers again) or
// "bad-state" (the store holds bytes the core refused; local decisions go on).
type Event struct {
	Kind, Detail, Policy, Key string
}

// Plan is a policy's fleet plan as the core gives it (durations in ns).
type Plan struct {
	Policy       string `json:"policy"`
	KeyPrefix    string `json:"key-prefix"`
	Publish      string `json:"publish"`
	PublishEvery uint64 `json:"publish-every"`
	Timeout      uint64 `json:"timeout"`
	RetryEvery   uint64 `json:"retry-every"`
	TTL          uint64 `json:"ttl"`
	Breaker      bool   `json:"breaker"`
	Budget       bool   `json:"budget"`
	Rate         *struct {
		Interval uint64 `json:"interval"`
		Burst    uint64 `json:"burst"`
		MaxWait  uint64 `json:"max-wait"`
		Lease    uint64 `json:"lease"`
	} `json:"rate-limit"`
	index  uint32
	policy *levee.Policy
}

type lease struct {
	tokens         uint64
	expires, until time.Time
}

// Options configure a Fleet.
type Options struct {
	// Node names this process in the shared state (default host-pid).
	Node string
	// Listener receives the fleet's events (they are also the Fleet's Events counters).
	Listener func(Event)
	// NoBackground turns off the publishing goroutine (call Sync yourself).
	NoBackground bool
}

// Fleet is the fleet option of one engine. It is safe for use by many goroutines.
type Fleet struct {
	e       *levee.Engine
	rdb     redis.UniversalClient
	owned   bool // the client was made by New, so Close closes it
	node    string
	plans   map[string]*Plan
	timeout time.Duration
	onEvent func(Event)

	mu     sync.Mutex
	keys   map[[2]string]*list.Element
	order  *list.List
	leases map[string]*lease

	up          atomic.Bool
	stop        chan struct{}
	done        chan struct{}
	Conflicts   atomic.Int64 // compare-and-set conflicts merged again
	Publication atomic.Int64 // accepted publications
}

// New makes the fleet option for an engine against the Redis server at addr
// (host:port). The client's timeouts are the policies' fleet timeout.
func New(e *levee.Engine, addr string, o Options) (*Fleet, error) {
	f, err := plan(e, o)
	if err != nil {
		return nil, err
	}
	f.rdb = redis.NewClient(&redis.Options{Addr: addr, DialTimeout: f.timeout, ReadTimeout: f.timeout,
		WriteTimeout: f.timeout, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 8, MinIdleConns: 1})
	f.owned = true
	return f.start(o), nil
}

// NewWithClient makes the fleet option for an engine with a go-redis client
// you already have: a *redis.Client, a *redis.ClusterClient (Redis Cluster),
// or any other redis.UniversalClient. Every operation still runs under its
// policy's fleet timeout as a context deadline, which go-redis honours when the
// client has ContextTimeoutEnabled; give it short dial and read timeouts too,
// since a call slower than the timeout sends the fleet local-only only once it
// returns. The client stays yours: Close does not close it.
func NewWithClient(e *levee.Engine, rdb redis.UniversalClient, o Options) (*Fleet, error) {
	if rdb == nil {
		return nil, errors.New("levee fleet: NewWithClient needs a client")
	}
	f, err := plan(e, o)
	if err != nil {
		return nil, err
	}
	f.rdb = rdb
	return f.start(o), nil
}

// plan reads the engine's fleet plans.
func plan(e *levee.Engine, o Options) (*Fleet, error) {
	f := &Fleet{e: e, node: o.Node, onEvent: o.Listener, plans: map[string]*Plan{},
		keys: map[[2]string]*list.Element{}, order: list.New(), leases: map[string]*lease{},
		stop: make(chan struct{}), done: make(chan struct{})}
	if f.node == "" {
		h, _ := os.Hostname()
		f.node = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	f.timeout = 5 * time.Millisecond
	first := true
	for _, name := range e.Policies() {
		idx, ok, err := e.PolicyIndex(name)
		if err != nil || !ok {
			continue
		}
		text, ok, err := e.FleetPlan(idx)
		if err != nil {
			return nil, err
		}
		if !ok {
			continue
		}
		var p Plan
		if err := json.Unmarshal([]byte(text), &p); err != nil {
			return nil, fmt.Errorf("levee fleet: the core's plan for %q: %w", name, err)
		}
		p.index = idx
		if p.policy, err = e.Policy(name); err != nil {
			return nil, err
		}
		// The client waits as long as the slowest policy allows; each operation is then
		// held to its own policy's timeout (opCtx).
		if t := time.Duration(p.Timeout); first || t > f.timeout {
			f.timeout, first = t, false
		}
		f.plans[name] = &p
	}
	return f, nil
}

// start loads the scripts and starts publication.
func (f *Fleet) start(o Options) *Fleet {
	f.up.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	// Connect and load the scripts once (on every shard of a cluster), outside the
	// per-operation timeout.
	if err := gcraScript.Load(ctx, f.rdb).Err(); err != nil {
		f.degrade(err)
	} else if err := stateScript.Load(ctx, f.rdb).Err(); err != nil {
		f.degrade(err)
	}
	if o.NoBackground || len(f.plans) == 0 {
		close(f.done)
	} else {
		go f.loop()
	}
	return f
}

// ping asks the store whether it serves: PING one server; of a cluster, every
// master, each of which must report cluster_state:ok (a restarted master
// answers PING but refuses keys until it has rejoined), so that the fleet is
// restored only when every shard serves.
func (f *Fleet) ping(ctx context.Context) error {
	c, ok := f.rdb.(*redis.ClusterClient)
	if !ok {
		return f.rdb.Ping(ctx).Err()
	}
	return c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		info, err := m.ClusterInfo(ctx).Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return fmt.Errorf("cluster node %s: not cluster_state:ok", m.Options().Addr)
		}
		return nil
	})
}

// Up is false while the fleet runs local-only (the store was slow or down).
func (f *Fleet) Up() bool { return f.up.Load() }

// Node is this process's name in the shared state.
func (f *Fleet) Node() string { return f.node }

// Close stops publication and closes the Redis client made by New (a client
// given to NewWithClient stays open).
func (f *Fleet) Close() error {
	select {
	case <-f.stop:
	default:
		close(f.stop)
	}
	<-f.done
	if !f.owned {
		return nil
	}
	return f.rdb.Close()
}

// Do runs fn under the named policy and key with the fleet's state: the fleet
// rate limit first (a *levee.Error with ReasonRateLimited when it rejects),
// then the engine's policy.
func (f *Fleet) Do(ctx context.Context, policy, key string, fn func(ctx context.Context) error, opts ...levee.CallOption) error {
	if err := levee.CheckKey(key); err != nil {
		return err
	}
	p := f.plans[policy]
	if p == nil {
		pol, err := f.e.Policy(policy)
		if err != nil {
			return err
		}
		return pol.Do(ctx, fn, append(opts, levee.WithKey(key))...)
	}
	f.touch(policy, key)
	if p.Rate != nil {
		if err := f.take(ctx, p, key); err != nil {
			return err
		}
	}
	err := p.policy.Do(ctx, fn, append(opts, levee.WithKey(key))...)
	if p.Publish == "strict" && (p.Breaker || p.Budget) && f.up.Load() {
		f.Sync(policy, key)
	}
	return err
}

// Sync publishes this process's evidence for a policy and key and applies the
// fleet's state now; false when the store did not answer (then local-only).
func (f *Fleet) Sync(policy, key string) bool {
	p := f.plans[policy]
	if p == nil || !f.up.Load() || levee.CheckKey(key) != nil { // a key Do refuses has nothing to publish
		return false
	}
	if err := f.sync(p, key); err != nil {
		f.degrade(err)
		return false
	}
	return true
}

// Inspect returns a key's shared state as the core's JSON ("" when none).
func (f *Fleet) Inspect(ctx context.Context, policy, key string) (string, error) {
	if err := levee.CheckKey(key); err != nil {
		return "", err
	}
	p := f.plans[policy]
	if p == nil {
		return "", fmt.Errorf("levee fleet: policy %q has no fleet section", policy)
	}
	raw, err := stateScript.Run(ctx, f.rdb, []string{p.KeyPrefix + key + "}:s"}, "", "", 0).Slice()
	if err != nil {
		return "", err
	}
	if len(raw) < 4 || raw[3] == "" {
		return "", nil
	}
	return f.e.FleetInspect([]byte(raw[3].(string)))
}

func (f *Fleet) emit(ev Event) {
	if f.onEvent != nil {
		f.onEvent(ev)
	}
}

func (f *Fleet) degrade(err error) {
	f.mu.Lock()
	clear(f.leases)
	f.mu.Unlock()
	if f.up.Swap(false) {
		f.emit(Event{Kind: "degraded", Detail: err.Error() + "; local decisions only"})
	}
}

func (f *Fleet) touch(policy, key string) {
	k := [2]string{policy, key}
	f.mu.Lock()
	defer f.mu.Unlock()
	if el, ok := f.keys[k]; ok {
		f.order.MoveToBack(el)
		return
	}
	f.keys[k] = f.order.PushBack(k)
	if f.order.Len() > fleetMaxKeys {
		old := f.order.Front()
		f.order.Remove(old)
		delete(f.keys, old.Value.([2]string))
	}
}

func (f *Fleet) opCtx(limit time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), limit)
}

func limited(p *Plan, ns int64) error {
	if ns < 0 {
		ns = 0
	}
	return &levee.Error{Policy: p.Policy, Reason: levee.ReasonRateLimited, RetryAfter: time.Duration(ns)}
}

// take is the fleet rate limit: nil when admitted (after a wait, if the core's
// semantics gave one), a rate-limited error when rejected. The store being
// down admits (the engine's own limiter still applies).
func (f *Fleet) take(ctx context.Context, p *Plan, key string) error {
	if !f.up.Load() {
		return nil
	}
	rk := p.KeyPrefix + key + "}:r"
	want, upto := p.Rate.Lease, 1
	if want <= 1 {
		want, upto = 1, 0
	}
	now := time.Now()
	f.mu.Lock()
	if b := f.leases[rk]; b != nil {
		if b.tokens > 0 && now.Before(b.expires) {
			b.tokens--
			f.mu.Unlock()
			return nil
		}
		if now.Before(b.until) { // the store's last answer: no token before then
			left := b.until.Sub(now)
			f.mu.Unlock()
			return limited(p, int64(left))
		}
	}
	f.mu.Unlock()
	limit := time.Duration(p.Timeout)
	c, cancel := f.opCtx(limit)
	start := time.Now()
	res, err := gcraScript.Run(c, f.rdb, []string{rk}, p.Rate.Interval, p.Rate.Burst, want, p.Rate.MaxWait, upto).Int64Slice()
	cancel()
	if err == nil && time.Since(start) > limit {
		err = errors.New("the store answered after the policy's fleet timeout")
	}
	if err != nil || len(res) != 3 {
		if err == nil {
			err = errors.New("the rate script answered no triple")
		}
		f.degrade(err)
		return nil
	}
	kind, granted, ns := res[0], res[1], res[2]
	switch kind {
	case 0:
		if want > 1 && granted > 1 {
			f.mu.Lock()
			b := f.leases[rk]
			if b == nil {
				b = &lease{}
				f.leases[rk] = b
			}
			if !now.Before(b.expires) {
				b.tokens = 0
			}
			b.tokens += uint64(granted - 1)
			b.expires = now.Add(time.Duration(p.Rate.Interval * p.Rate.Burst))
			f.mu.Unlock()
		}
		return nil
	case 1:
		d := time.Duration(min(uint64(max(ns, 0)), p.Rate.MaxWait))
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return &levee.Error{Policy: p.Policy, Reason: levee.ReasonCancelled, Ctx: ctx.Err()}
		}
	default:
		f.mu.Lock()
		b := f.leases[rk]
		if b == nil {
			b = &lease{}
			f.leases[rk] = b
		}
		b.until = now.Add(time.Duration(max(ns, 0)))
		f.mu.Unlock()
		return limited(p, ns)
	}
}

func (f *Fleet) run(limit time.Duration, s *redis.Script, key string, args ...any) ([]any, error) {
	c, cancel := f.opCtx(limit)
	defer cancel()
	start := time.Now()
	res, err := s.Run(c, f.rdb, []string{key}, args...).Slice()
	if err == nil && time.Since(start) > limit {
		err = errors.New("the store answered after the policy's fleet timeout")
	}
	if err == nil && len(res) < 3 {
		err = errors.New("the state script answered too little")
	}
	return res, err
}

func asInt(v any) uint64 {
	if n, ok := v.(int64); ok && n >= 0 {
		return uint64(n)
	}
	return 0
}

func asBytes(res []any) []byte {
	if len(res) > 3 {
		if s, ok := res[3].(string); ok {
			return []byte(s)
		}
	}
	return nil
}

func (f *Fleet) sync(p *Plan, key string) error {
	sk := p.KeyPrefix + key + "}:s"
	ttl := max(p.TTL/1e6, 1)
	res, err := f.run(time.Duration(p.Timeout), stateScript, sk, "", "", ttl)
	if err != nil {
		return err
	}
	version, wall, data := asInt(res[1]), asInt(res[2]), asBytes(res)
	for range fleetMaxCas {
		now := f.e.Now()
		merged, err := f.e.FleetMerge(p.index, key, f.node, now, wall, data)
		if err != nil {
			var le *levee.LoadError
			if errors.As(err, &le) {
				f.emit(Event{Kind: "bad-state", Detail: le.Error(), Policy: p.Policy, Key: key})
				return nil
			}
			return nil // the engine faulted and recovered; publish next time
		}
		out, err := f.run(time.Duration(p.Timeout), stateScript, sk, version, merged, ttl)
		if err != nil {
			return err
		}
		if asInt(out[0]) == 1 {
			f.Publication.Add(1)
			if err := f.e.FleetApply(p.index, key, f.node, now, wall, merged); err != nil {
				f.emit(Event{Kind: "bad-state", Detail: err.Error(), Policy: p.Policy, Key: key})
			}
			return nil
		}
		f.Conflicts.Add(1)
		version, wall, data = asInt(out[1]), asInt(out[2]), asBytes(out)
	}
	return nil
}

func (f *Fleet) loop() {
	defer close(f.done)
	every, retry := time.Duration(1<<62), time.Duration(1<<62)
	for _, p := range f.plans {
		every = min(every, time.Duration(p.PublishEvery))
		retry = min(retry, time.Duration(p.RetryEvery))
	}
	for {
		wait := every
		if f.up.Load() {
			f.mu.Lock()
			keys := make([][2]string, 0, f.order.Len())
			for el := f.order.Front(); el != nil; el = el.Next() {
				keys = append(keys, el.Value.([2]string))
			}
			f.mu.Unlock()
			for _, k := range keys {
				p := f.plans[k[0]]
				if p == nil || p.Publish == "strict" || !(p.Breaker || p.Budget) || !f.up.Load() {
					continue
				}
				if err := f.sync(p, k[1]); err != nil {
					f.degrade(err)
				}
			}
		} else {
			wait = retry
		}
		select {
		case <-f.stop:
			return
		case <-time.After(wait):
		}
		if !f.up.Load() {
			c, cancel := f.opCtx(f.timeout)
			err := f.ping(c)
			cancel()
			if err == nil {
				f.up.Store(true)
				f.emit(Event{Kind: "restored", Detail: "the store answers again; publishing"})
			}
		}
	}
}
