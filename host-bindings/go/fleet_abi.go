package levee

// Bindings of the WIT's fleet functions (fleet-plan, fleet-merge, fleet-apply,
// fleet-inspect; docs/fleet.md) and their Engine methods. The store side (Redis,
// go-redis) is the package github.com/levee-dev/levee/host-bindings/go/fleet,
// its own module so that this one keeps no dependency beyond wazero. Nothing
// here decides anything: the bytes are the core's.

import "context"

func (in *instance) fleetPlan(ctx context.Context, rep, policy uint32) (string, bool, error) {
	v, ok, err := in.optionCall(ctx, fnFleetPlan, uint64(rep), uint64(policy))
	if !ok || err != nil {
		return "", false, err
	}
	return v.(string), true, nil
}

func (in *instance) fleetCall(ctx context.Context, fn int, rep, policy uint32, key, node string, now, wallMs uint64,
	shared []byte) (any, *LoadError, error) {
	l, err := in.lowerAll(ctx, key, node, shared)
	if err != nil {
		return nil, nil, err
	}
	if err := in.call(ctx, fn, uint64(rep), uint64(policy), l[0], l[1], l[2], l[3], now, wallMs, l[4], l[5]); err != nil {
		return nil, nil, err
	}
	v, err := in.liftRet(ctx, fn)
	if err != nil {
		return nil, nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		le := asLoadError(r.payload)
		return nil, &le, nil
	}
	return r.payload, nil, nil
}

func (in *instance) fleetInspect(ctx context.Context, rep uint32, shared []byte) (string, *LoadError, error) {
	l, err := in.lowerAll(ctx, shared)
	if err != nil {
		return "", nil, err
	}
	if err := in.call(ctx, fnFleetInspect, uint64(rep), l[0], l[1]); err != nil {
		return "", nil, err
	}
	v, err := in.liftRet(ctx, fnFleetInspect)
	if err != nil {
		return "", nil, err
	}
	r := v.(variantVal)
	if r.disc == 1 {
		le := asLoadError(r.payload)
		return "", &le, nil
	}
	return r.payload.(string), nil, nil
}

// FleetPlan is the fleet plan of a policy as the core's canonical JSON
// (durations in ns), and false when the policy has no fleet section.
func (e *Engine) FleetPlan(policy uint32) (string, bool, error) {
	var out string
	var ok bool
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		out, ok, err = in.fleetPlan(ctx, e.rep, policy)
		return err
	})
	return out, ok, err
}

// FleetMerge returns the store's shared bytes for a policy and key, read at
// the store's clock wallMs, with this engine's evidence merged in as node: the
// bytes to write back under compare-and-set. It changes nothing in the engine.
func (e *Engine) FleetMerge(policy uint32, key, node string, now, wallMs uint64, shared []byte) ([]byte, error) {
	var out []byte
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) error {
		v, le, err := in.fleetCall(ctx, fnFleetMerge, e.rep, policy, key, node, now, wallMs, shared)
		if err == nil && le == nil {
			out, _ = v.([]byte)
		}
		lerr = le
		return err
	})
	if err != nil {
		return nil, err
	}
	if lerr != nil {
		return nil, lerr
	}
	return out, nil
}

// FleetApply applies shared bytes the store accepted to this engine: the
// quorum rule, probe coordination and the shared budget. Breaker transitions
// it makes reach the engine's listeners like any other event.
func (e *Engine) FleetApply(policy uint32, key, node string, now, wallMs uint64, shared []byte) error {
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) error {
		_, le, err := in.fleetCall(ctx, fnFleetApply, e.rep, policy, key, node, now, wallMs, shared)
		lerr = le
		return err
	})
	if err != nil {
		return err
	}
	if lerr != nil {
		return lerr
	}
	return nil
}

// FleetInspect describes shared bytes as canonical JSON.
func (e *Engine) FleetInspect(shared []byte) (string, error) {
	var out string
	var lerr *LoadError
	err := e.op(false, func(ctx context.Context, in *instance) (err error) {
		out, lerr, err = in.fleetInspect(ctx, e.rep, shared)
		return err
	})
	if err != nil {
		return "", err
	}
	if lerr != nil {
		return "", lerr
	}
	return out, nil
}
