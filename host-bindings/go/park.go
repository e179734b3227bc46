package levee

import (
	"context"
	"time"
)

// The bulkhead queue's host half (docs/policy.md, "The queue"): a call the core
// queues (a wait with reason bulkhead-full) is parked until its payload
// elapses or this engine reports or cancels an attempt of the same policy and
// key, whichever comes first, and then acquires again. The park is registered
// under the engine's lock in the crossing that queued it, and every wake-up is
// sent under that lock in the crossing that frees a slot, so no wake-up is
// lost between the two. A success Do holds back frees its slot only when it is
// applied, so while calls are parked it is applied at once (holdSuccess). While
// nothing is parked, a crossing and a held-back success pay one atomic load.

// parkKey names a bulkhead queue: a policy (its index) and a key.
type parkKey struct {
	policy uint32
	key    string
}

// parker is one parked call: its sleep runs under ctx, which wake cancels.
type parker struct {
	at     parkKey
	ctx    context.Context
	cancel context.CancelFunc
}

// parkLocked registers the call of ctx as parked in the queue of ref.
func (e *Engine) parkLocked(cctx context.Context, ref callRef) *parker {
	p := &parker{at: parkKey{ref.policy, ref.key}}
	p.ctx, p.cancel = context.WithCancel(cctx)
	if e.parked == nil {
		e.parked = map[parkKey][]*parker{}
	}
	e.parked[p.at] = append(e.parked[p.at], p)
	e.nParked.Add(1)
	return p
}

// wakeLocked wakes every call parked in the queue of (policy, key): an attempt
// of it was reported or cancelled, or a held-back success of it applied.
func (e *Engine) wakeLocked(policy uint32, key string) {
	if e.nParked.Load() == 0 {
		return
	}
	k := parkKey{policy, key}
	ps := e.parked[k]
	if len(ps) == 0 {
		return
	}
	delete(e.parked, k)
	e.nParked.Add(-int64(len(ps)))
	for _, p := range ps {
		p.cancel()
	}
}

// parkSleep sleeps a parked call for d, or until it is woken (nil either way),
// or until ctx is done (its error). The park is over when it returns.
func (e *Engine) parkSleep(ctx context.Context, p *parker, d time.Duration) error {
	_ = e.sleep(p.ctx, d)
	e.mu.Lock()
	if ps := e.parked[p.at]; len(ps) > 0 {
		for i, q := range ps {
			if q == p {
				ps = append(ps[:i], ps[i+1:]...)
				e.nParked.Add(-1)
				if len(ps) == 0 {
					delete(e.parked, p.at)
				} else {
					e.parked[p.at] = ps
				}
				break
			}
		}
	}
	e.mu.Unlock()
	p.cancel()
	return ctx.Err()
}
