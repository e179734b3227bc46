//! The `fleet-*` functions of the WIT on [`RawEngine`] (docs/fleet.md): a policy's fleet plan,
//! and the core's merge, apply and inspection of the bytes a fleet shares through a store, on
//! either backend. The bytes are the core's wire format; a host only carries them. An
//! `Err(LoadError)` names what is wrong with the bytes (or the node, or the policy);
//! `Err(Trap)` is the guest's fault, as for every `try_` method (see [`crate::raw`]).
//!
//! `now` is the engine's monotonic ns (the `now` of `start`), `wall_ms` the store's clock in
//! ms since the Unix epoch, read with the bytes.

use levee_core::LoadError;

use super::{Inner, RawEngine, Trap}; // `Inner`: matched by `op!`

impl RawEngine {
    /// `fleet-plan`: what a host needs to share `policy`'s state, as the core's canonical JSON
    /// (durations in ns); `None` for an unknown policy or one without a `fleet` section.
    pub fn try_fleet_plan(&mut self, policy: u32) -> Result<Option<String>, Trap> {
        op!(self, "fleet-plan", |n| n.fleet_plan(policy), |w| w.fleet_plan(policy))
    }

    /// `fleet-merge`: the store's `shared` bytes for `policy` and `key` with this engine's
    /// evidence merged in as `node`: the bytes to write back under compare-and-set. Changes
    /// nothing in the engine.
    pub fn try_fleet_merge(
        &mut self,
        policy: u32,
        key: &str,
        node: &str,
        now: u64,
        wall_ms: u64,
        shared: &[u8],
    ) -> Result<Result<Vec<u8>, LoadError>, Trap> {
        op!(self, "fleet-merge", |n| n.fleet_merge(policy, key, node, now, wall_ms, shared), |w| w
            .fleet_merge(policy, key, node, now, wall_ms, shared))
    }

    /// `fleet-apply`: apply bytes the store accepted (the quorum rule, probe coordination, the
    /// shared budget). A breaker it opens leaves a `breaker-transition` event to drain.
    pub fn try_fleet_apply(
        &mut self,
        policy: u32,
        key: &str,
        node: &str,
        now: u64,
        wall_ms: u64,
        shared: &[u8],
    ) -> Result<Result<(), LoadError>, Trap> {
        op!(self, "fleet-apply", |n| n.fleet_apply(policy, key, node, now, wall_ms, shared), |w| w
            .fleet_apply(policy, key, node, now, wall_ms, shared))
    }

    /// `fleet-inspect`: shared bytes as canonical JSON (needs no policy).
    pub fn try_fleet_inspect(&mut self, shared: &[u8]) -> Result<Result<String, LoadError>, Trap> {
        op!(self, "fleet-inspect", |_n| levee_core::Engine::fleet_inspect(shared), |w| w.fleet_inspect(shared))
    }
}
