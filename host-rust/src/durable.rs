//! The `durable-*` functions of the WIT on [`RawEngine`] (docs/durable.md): the core's
//! durable call record and its decisions, on either backend. Every answer is the core's
//! [`DurableStep`] with the record bytes to persist, or the core's [`LoadError`] naming what is
//! wrong with a record (`record`, `record.version`, `record.policy`, `record.lease`, ...), which
//! an executor quarantines with that error. `Err(Trap)` is the guest's fault, as for every
//! `try_` method (see the module documentation of [`crate::raw`]).
//!
//! Times named `wall_now` are wall-clock ns since the Unix epoch from the store's one clock;
//! `elapsed` is monotonic ns since this process got the record's bytes from the core.

use levee_core::durable::DurableStep;
use levee_core::{LoadError, OutcomeKind};

use super::{Inner, RawEngine, Trap}; // `Inner`: matched by `op!`

impl RawEngine {
    /// `durable-begin`: begin a call of `policy` (`flags` bit 0: not idempotent). The answer
    /// is `wait` 0: persist the record, then [`RawEngine::try_durable_step`] it.
    pub fn try_durable_begin(
        &mut self,
        policy: u32,
        key: &str,
        idempotency_key: &str,
        flags: u32,
        wall_now: u64,
    ) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-begin", |n| n.durable_begin(policy, key, idempotency_key, flags, wall_now), |w| w.durable_begin(
            policy,
            key,
            idempotency_key,
            flags,
            wall_now
        ))
    }

    /// `durable-step`: take a call up as `owner` (a name unique to this process).
    pub fn try_durable_step(
        &mut self,
        record: &[u8],
        owner: &str,
        wall_now: u64,
        elapsed: u64,
    ) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-step", |n| n.durable_step(record, owner, wall_now, elapsed), |w| w
            .durable_step(record, owner, wall_now, elapsed))
    }

    /// `durable-renew`: extend the lease of the attempt `owner` runs.
    pub fn try_durable_renew(
        &mut self,
        record: &[u8],
        owner: &str,
        wall_now: u64,
        elapsed: u64,
    ) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-renew", |n| n.durable_renew(record, owner, wall_now, elapsed), |w| w
            .durable_renew(record, owner, wall_now, elapsed))
    }

    /// `durable-outcome`: the outcome of the attempt `owner` ran (`kind`, `code`, `text` as for
    /// `report`; `message` the error's text for the record; `flags` bit 0: overloaded).
    #[allow(clippy::too_many_arguments)]
    pub fn try_durable_outcome(
        &mut self,
        record: &[u8],
        owner: &str,
        wall_now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        message: &str,
        flags: u32,
    ) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-outcome", |n| n.durable_outcome(record, owner, wall_now, elapsed, kind, code, text, message, flags), |w| w
            .durable_outcome(record, owner, wall_now, elapsed, kind, code, text, message, flags))
    }

    /// `durable-cancel`: cancel a call that has not finished.
    pub fn try_durable_cancel(&mut self, record: &[u8], wall_now: u64) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-cancel", |n| n.durable_cancel(record, wall_now), |w| w.durable_cancel(record, wall_now))
    }

    /// `durable-revive`: give a dead or cancelled call a fresh set of attempts, due now.
    pub fn try_durable_revive(&mut self, record: &[u8], wall_now: u64) -> Result<Result<DurableStep, LoadError>, Trap> {
        op!(self, "durable-revive", |n| n.durable_revive(record, wall_now), |w| w.durable_revive(record, wall_now))
    }

    /// `durable-inspect`: a record as canonical JSON (needs no policy).
    pub fn try_durable_inspect(&mut self, record: &[u8]) -> Result<Result<String, LoadError>, Trap> {
        op!(self, "durable-inspect", |_n| levee_core::durable::inspect(record), |w| w.durable_inspect(record))
    }
}
