//! The low-level engine: one policy engine, synchronous, mirroring `levee_core::Engine`
//! (and so the WIT `engine` resource) method for method.
//!
//! [`RawEngine`] runs the Levee policy component in wasmtime (the default backend), or
//! links `levee-core` directly ([`Backend::Native`], the default with the `native` cargo
//! feature). Both give identical decisions; the conformance vectors prove it.
//!
//! # Traps: the contract
//! The component is treated as untrusted. Every guest call is bounded in time by wasmtime's
//! epoch interruption (ticks of [`EPOCH_TICK`], advanced by one background thread per
//! process; epochs cost far less per call than fuel, which doubled the cost of a call here)
//! and the store's memory by `StoreLimits` ([`Limits::memory_bytes`]), by the rule every host
//! follows (`docs/architecture.md`, "Bounds on the guest"): a call whose work does not depend
//! on the size of anything gets [`Limits::call_ticks`]; `load`, `reload`, `export-state`, `export-snapshot` and
//! `import-state` get [`Limits::load_ticks`] plus one tick for every
//! [`Limits::bytes_per_tick`] bytes of document and state they walk. When a guest call traps
//! (interrupted, out of bounds, a malformed answer such as a verdict of unknown kind):
//!
//! 1. the engine **recovers before returning**: it instantiates the component again, loads
//!    the current document with the same seed and imports the last good state snapshot
//!    (taken by [`RawEngine::checkpoint`], which the engine calls itself whenever it drains a
//!    breaker transition, so that a recovery never forgets a trip, after `set_breaker_state`,
//!    `reload` and `import_state`, and on a `start` at least [`Limits::checkpoint_interval`]
//!    after the last snapshot).
//!    Live calls are not state (see `levee-core`): after a recovery every call that was
//!    in progress is unknown to the engine, and its next operation answers `invalid`
//!    (`unknown-call`).
//! 2. the `try_` twin of every method (`try_start`, `try_report`, ...) returns
//!    `Err(`[`Trap`]`)`: this is the fallible variant, and the one hosts that act on a trap
//!    (the async handle of this crate: it lets the affected call proceed as one attempt
//!    without retries and emits an event) must use.
//! 3. the plain methods, whose names, arguments and return types are exactly those of
//!    `levee_core::Engine`, never fail: after recovering they return a fixed answer:
//!    - a verdict: [`TRAPPED`], i.e. `invalid` with code 0 (`ok`), a code the core never
//!      emits (it only emits 1-4), so the caller can tell a trap from a protocol error;
//!    - an `Option`: `None`; a list: empty; a count: 0; `cancel`: nothing;
//!    - a `Result`: an error whose message starts with `the policy engine trapped`
//!      (path `""` for load errors).
//!
//!    [`RawEngine::traps`] counts recoveries and [`RawEngine::last_trap`] tells the last one.
//!
//! The native backend never traps (`levee-core` has no panicking path reachable from input),
//! so its `try_` methods always return `Ok`.

use std::fmt;

pub use levee_core::{
    Analysis, BreakerState, CallInfo, Event, EventKind, HedgeCommand, InvalidCode, LoadError, OutcomeKind, PolicyInfo, Reason, Verdict,
    VerdictKind,
};

/// Which implementation of the policy core runs the decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The Levee policy component in wasmtime (needs the `wasm` cargo feature).
    Wasm,
    /// `levee-core` linked directly.
    Native,
}

impl Backend {
    /// The default backend: `Wasm`, or `Native` with the `native` cargo feature (or when the
    /// `wasm` feature is off).
    pub const DEFAULT: Backend = if cfg!(all(feature = "wasm", not(feature = "native"))) { Backend::Wasm } else { Backend::Native };

    /// The lower-case name (`wasm`, `native`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Wasm => "wasm",
            Backend::Native => "native",
        }
    }
}

impl Default for Backend {
    fn default() -> Self {
        Backend::DEFAULT
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The verdict the plain (non-`try_`) methods return after a trap: `invalid` with code 0.
pub const TRAPPED: Verdict = Verdict(VerdictKind::Invalid as u64);

/// Whether a verdict is [`TRAPPED`] (ignoring the events-pending bit).
pub fn is_trapped(v: Verdict) -> bool {
    v.with_events(false) == TRAPPED
}

/// A guest call trapped (or answered something malformed); the engine has recovered.
///
/// One pointer wide, so that the `Result<Verdict, Trap>` of every step is returned in
/// registers (a 48-byte result went through the stack on the hot path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trap(Box<TrapInfo>);

#[derive(Clone, Debug, PartialEq, Eq)]
struct TrapInfo {
    operation: &'static str,
    message: String,
    restored: bool,
}

impl Trap {
    /// The WIT operation that trapped (`start`, `report`, ...).
    pub fn operation(&self) -> &'static str {
        self.0.operation
    }

    /// What wasmtime (or the validation of the answer) said.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// Whether the last good state was restored into the new instance (false when the
    /// import of the snapshot failed, or there was none yet: the state then starts fresh).
    pub fn restored(&self) -> bool {
        self.0.restored
    }
}

impl fmt::Display for Trap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the policy engine trapped in `{}`: {} (re-instantiated, state {})",
            self.0.operation,
            self.0.message,
            if self.0.restored { "restored" } else { "fresh" }
        )
    }
}

impl std::error::Error for Trap {}

/// The period of the epoch ticker that bounds guest calls.
pub const EPOCH_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// Bounds on the guest, by the rule of `docs/architecture.md` ("Bounds on the guest"); the
/// defaults are the same in every host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Epoch ticks ([`EPOCH_TICK`]) a call whose work does not depend on the size of anything
    /// (`start`, `acquire`, `report`, queries, `drain-events`, `analyze`...) may run before it
    /// is interrupted: it traps within `call_ticks` to `call_ticks + 1` ticks. 0 interrupts
    /// every call at once (the trap tests use it). Default 100 (1 s).
    pub call_ticks: u64,
    /// Epoch ticks for `load`, `reload`, `export-state`, `export-snapshot` and `import-state` before their
    /// share by size (see `bytes_per_tick`). Default 100 (1 s).
    pub load_ticks: u64,
    /// Those calls get one tick more for every `bytes_per_tick` bytes they walk: the
    /// document's, and the state's (the last state exported or imported, plus
    /// [`STATE_BYTES_PER_KEYED_CALL`] for every keyed call since). Default 500 (20 us a
    /// byte); 0 gives them `load_ticks` whatever their size.
    pub bytes_per_tick: u64,
    /// Largest linear memory the guest may grow to, in bytes. Default 512 MiB.
    pub memory_bytes: usize,
    /// A `start` at least this long (ns of its `now`) after the last snapshot takes one
    /// (0: only on breaker transitions and the operations that always take one). Default 1 s.
    pub checkpoint_interval: u64,
}

/// The bytes of state one keyed call may add (a new key's entry), for [`Limits::bytes_per_tick`].
pub const STATE_BYTES_PER_KEYED_CALL: usize = 1024;

impl Default for Limits {
    /// The guards of docs/hosts.md (section 7), from the generated `GUARD_*` constants: 10^9
    /// units (ns here) a crossing, 20,000 a byte walked, 512 MiB, a snapshot a second.
    fn default() -> Self {
        use crate::constants as k;
        let tick = EPOCH_TICK.as_nanos() as u64;
        let work = u64::from(k::GUARD_GUEST_WORK_UNITS);
        Limits {
            call_ticks: work / tick,
            load_ticks: work / tick,
            bytes_per_tick: tick / u64::from(k::GUARD_GUEST_WORK_UNITS_PER_BYTE).max(1),
            memory_bytes: k::GUARD_GUEST_MEMORY_BYTES as usize,
            checkpoint_interval: u64::from(k::GUARD_SNAPSHOT_INTERVAL_MS) * 1_000_000,
        }
    }
}

#[cfg(test)]
mod guard_tests {
    use super::Limits;

    #[test]
    fn the_default_guards_are_the_contracts() {
        let l = Limits::default();
        assert_eq!((l.call_ticks, l.load_ticks, l.bytes_per_tick), (100, 100, 500));
        assert_eq!((l.memory_bytes, l.checkpoint_interval), (512 << 20, 1_000_000_000));
    }
}

impl Limits {
    /// The ticks of a call that walks `bytes` of document or state.
    pub fn work_ticks(&self, bytes: usize) -> u64 {
        let extra = if self.bytes_per_tick == 0 { 0 } else { (bytes as u64).div_ceil(self.bytes_per_tick) };
        self.load_ticks.saturating_add(extra)
    }
}

enum Inner {
    Native(Box<levee_core::Engine>),
    #[cfg(feature = "wasm")]
    Wasm(Box<wasm::Instance>),
}

/// One policy engine (one wasmtime store and instance, or one native engine). `Send`, not
/// `Sync`: share it behind a lock (the async handle [`crate::Levee`] does).
pub struct RawEngine {
    inner: Inner,
    document: String,
    seed: u64,
    limits: Limits,
    snapshot: Option<Vec<u8>>,
    /// The `now` of the `start` that took the last periodic snapshot.
    #[cfg_attr(not(feature = "wasm"), allow(dead_code))]
    snapshot_at: u64,
    /// The size of the state the instance holds: the last state exported or imported...
    state_bytes: usize,
    /// ...and the keyed calls since (each may add a key).
    keyed_calls: usize,
    traps: u64,
    last_trap: Option<Trap>,
    /// Counts the instances this engine had: a recovery replaces the instance (and with it the
    /// executor resources it held, see [`RawExecutor`]).
    instance: u64,
}

impl fmt::Debug for RawEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawEngine").field("backend", &self.backend()).field("traps", &self.traps).finish_non_exhaustive()
    }
}

fn trapped_load(t: &Trap) -> Vec<LoadError> {
    vec![LoadError::new("", t.to_string())]
}

impl RawEngine {
    /// Load a document (YAML or JSON) with a seed on the default backend ([`Backend::DEFAULT`]).
    pub fn load(doc: &str, seed: u64) -> Result<RawEngine, Vec<LoadError>> {
        RawEngine::load_with(Backend::DEFAULT, doc, seed, Limits::default())
    }

    /// Load on a chosen backend with chosen limits. Choosing `Wasm` without the `wasm`
    /// feature is an error (path `""`).
    pub fn load_with(backend: Backend, doc: &str, seed: u64, limits: Limits) -> Result<RawEngine, Vec<LoadError>> {
        let inner = match backend {
            Backend::Native => Inner::Native(Box::new(levee_core::Engine::load(doc, seed)?)),
            #[cfg(feature = "wasm")]
            Backend::Wasm => Inner::Wasm(Box::new(wasm::Instance::load(doc, seed, limits)?)),
            #[cfg(not(feature = "wasm"))]
            Backend::Wasm => return Err(vec![LoadError::new("", "this build of levee has no wasm backend (enable the `wasm` feature)")]),
        };
        Ok(RawEngine {
            inner,
            document: doc.to_string(),
            seed,
            limits,
            snapshot: None,
            snapshot_at: 0,
            state_bytes: 0,
            keyed_calls: 0,
            traps: 0,
            last_trap: None,
            instance: 0,
        })
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        match self.inner {
            Inner::Native(_) => Backend::Native,
            #[cfg(feature = "wasm")]
            Inner::Wasm(_) => Backend::Wasm,
        }
    }

    /// The limits in use.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Change the limits (they apply from the next guest call). `call_ticks: 0` makes the
    /// next hot-path call trap: the tests of trap recovery do so.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        #[cfg(feature = "wasm")]
        if let Inner::Wasm(w) = &mut self.inner {
            w.limits = limits;
        }
    }

    /// The document currently loaded (the last that loaded or reloaded successfully).
    pub fn document(&self) -> &str {
        &self.document
    }

    /// The seed given at load.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// How many traps this engine recovered from.
    pub fn traps(&self) -> u64 {
        self.traps
    }

    /// The last trap, if any.
    pub fn last_trap(&self) -> Option<&Trap> {
        self.last_trap.as_ref()
    }

    /// Take a snapshot of the state now (the state a recovery restores). A no-op on the native
    /// backend, which never needs recovering.
    pub fn checkpoint(&mut self) -> Result<(), Trap> {
        #[cfg(feature = "wasm")]
        if let Inner::Wasm(_) = self.inner {
            let bytes = self.try_export_snapshot()?;
            self.snapshot = Some(bytes);
        }
        Ok(())
    }

    /// The last snapshot taken by [`RawEngine::checkpoint`].
    pub fn snapshot(&self) -> Option<&[u8]> {
        self.snapshot.as_deref()
    }

    /// Bytes of state a call that walks the whole state may walk.
    fn state_work(&self) -> usize {
        self.state_bytes.saturating_add(STATE_BYTES_PER_KEYED_CALL.saturating_mul(self.keyed_calls))
    }

    /// On a `start` of the wasm backend: count a keyed call, and take the periodic snapshot
    /// when [`Limits::checkpoint_interval`] has passed (the native backend never traps).
    #[inline]
    fn started(&mut self, keyed: bool, now: u64) {
        #[cfg(feature = "wasm")]
        if let Inner::Wasm(_) = self.inner {
            self.keyed_calls += keyed as usize;
            let every = self.limits.checkpoint_interval;
            if every != 0 && now.saturating_sub(self.snapshot_at) >= every {
                self.snapshot_at = now;
                let _ = self.checkpoint();
            }
        }
        #[cfg(not(feature = "wasm"))]
        let _ = (keyed, now);
    }

    /// Re-instantiate after a trap and restore the last snapshot; returns the trap to report.
    #[cfg(feature = "wasm")]
    fn recover(&mut self, operation: &'static str, message: String) -> Trap {
        self.traps = self.traps.saturating_add(1);
        self.instance = self.instance.wrapping_add(1);
        let mut restored = false;
        self.state_bytes = 0;
        self.keyed_calls = 0;
        match wasm::Instance::load(&self.document, self.seed, self.limits) {
            Ok(mut fresh) => {
                if let Some(snap) = &self.snapshot {
                    restored = matches!(fresh.import_state(snap, 0), Ok(Ok(())));
                    if restored {
                        self.state_bytes = snap.len();
                    }
                }
                self.inner = Inner::Wasm(Box::new(fresh));
            }
            Err(e) => {
                // The document loaded before, so only a trap during load lands here; keep the
                // poisoned instance out of the way by loading natively: decisions stay the same.
                let _ = e;
                if let Ok(mut native) = levee_core::Engine::load(&self.document, self.seed) {
                    if let Some(snap) = &self.snapshot {
                        restored = native.import_state(snap).is_ok();
                    }
                    self.inner = Inner::Native(Box::new(native));
                }
            }
        }
        let trap = Trap(Box::new(TrapInfo { operation, message, restored }));
        self.last_trap = Some(trap.clone());
        trap
    }
}

impl RawEngine {
    /// Replace the instance with a fresh one holding the last snapshot, as after a trap in
    /// `operation` (the recovery path of a verdict that broke the contract, docs/hosts.md
    /// section 3, and the fault seam of the host scenarios). Returns the trap to report.
    pub fn reinstantiate(&mut self, operation: &'static str, message: impl Into<String>) -> Trap {
        let message = message.into();
        #[cfg(feature = "wasm")]
        if let Inner::Wasm(_) = self.inner {
            return self.recover(operation, message);
        }
        self.traps = self.traps.saturating_add(1);
        self.instance = self.instance.wrapping_add(1);
        let mut restored = false;
        if let Ok(mut native) = levee_core::Engine::load(&self.document, self.seed) {
            if let Some(snap) = &self.snapshot {
                restored = native.import_state(snap).is_ok();
            }
            self.inner = Inner::Native(Box::new(native));
        }
        let trap = Trap(Box::new(TrapInfo { operation, message, restored }));
        self.last_trap = Some(trap.clone());
        trap
    }
}

/// Run an operation on whichever backend, recovering from a trap on the wasm one.
macro_rules! op {
    ($self:ident, $name:literal, |$n:ident| $native:expr, |$w:ident| $wasm:expr) => {{
        match &mut $self.inner {
            Inner::Native($n) => Ok($native),
            #[cfg(feature = "wasm")]
            Inner::Wasm($w) => match $wasm {
                Ok(v) => Ok(v),
                Err(message) => Err($self.recover($name, message)),
            },
        }
    }};
}

// The durable-* functions (issue 17), in a file of their own.
#[path = "durable.rs"]
mod durable;

// The durable executor's machine (issue 40), in a file of its own.
#[path = "exec_raw.rs"]
mod exec_raw;
pub use exec_raw::RawExecutor;

// The fleet-* functions (issue 18), in a file of their own.
#[path = "fleet_raw.rs"]
mod fleet_raw;

/// A verdict from the guest is checked before it is believed.
#[cfg(feature = "wasm")]
fn checked(raw: Result<u64, String>) -> Result<Verdict, String> {
    let v = Verdict(raw?);
    if v.kind().is_none() || v.0 & u64::from(crate::constants::VERDICT_RESERVED_MASK) != 0 {
        return Err(format!("malformed verdict {:#x}", v.0));
    }
    Ok(v)
}

impl RawEngine {
    /// `start`, fallible: see the module documentation.
    #[allow(clippy::too_many_arguments)]
    pub fn try_start(
        &mut self,
        call: u64,
        policy: u32,
        key: &str,
        flags: u32,
        now: u64,
        settle_call: u64,
        settle_at: u64,
        settle_elapsed: u64,
    ) -> Result<Verdict, Trap> {
        let r = op!(self, "start", |n| n.start(call, policy, key, flags, now, settle_call, settle_at, settle_elapsed), |w| checked(
            w.start(call, policy, key, flags, now, settle_call, settle_at, settle_elapsed)
        ));
        self.started(!key.is_empty(), now);
        r
    }

    /// `acquire`, fallible.
    pub fn try_acquire(&mut self, call: u64, now: u64) -> Result<Verdict, Trap> {
        op!(self, "acquire", |n| n.acquire(call, now), |w| checked(w.acquire(call, now)))
    }

    /// `report`, fallible.
    #[allow(clippy::too_many_arguments)]
    pub fn try_report(
        &mut self,
        call: u64,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Result<Verdict, Trap> {
        op!(self, "report", |n| n.report(call, now, elapsed, kind, code, text, wall_secs, flags), |w| checked(
            w.report(call, now, elapsed, kind, code, text, wall_secs, flags)
        ))
    }

    /// `report-fallback`, fallible.
    pub fn try_report_fallback(&mut self, call: u64, now: u64, ok: bool) -> Result<Verdict, Trap> {
        op!(self, "report-fallback", |n| n.report_fallback(call, now, ok), |w| checked(w.report_fallback(call, now, ok)))
    }

    /// `hedge-step`, fallible: the commands of a hedged call, and whether events are pending.
    /// Commands from the guest are checked for shape only (a start or cancel names an attempt
    /// from 1 to the most any preset allows; an end carries a well-formed verdict); whether
    /// they fit the call is the driver's to check.
    pub fn try_hedge_step(&mut self, call: u64, now: u64) -> Result<(Vec<HedgeCommand>, bool), Trap> {
        op!(
            self,
            "hedge-step",
            |n| {
                let c = n.hedge_step(call, now);
                (c, n.has_events())
            },
            |w| w.hedge_step(call, now)
        )
    }

    /// `report-attempt`, fallible (see [`RawEngine::try_hedge_step`]).
    #[allow(clippy::too_many_arguments)]
    pub fn try_report_attempt(
        &mut self,
        call: u64,
        attempt: u32,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Result<(Vec<HedgeCommand>, bool), Trap> {
        op!(
            self,
            "report-attempt",
            |n| {
                let c = n.report_attempt(call, attempt, now, elapsed, kind, code, text, wall_secs, flags);
                (c, n.has_events())
            },
            |w| w.report_attempt(call, attempt, now, elapsed, kind, code, text, wall_secs, flags)
        )
    }

    /// `cancel`, fallible.
    pub fn try_cancel(&mut self, call: u64, now: u64) -> Result<(), Trap> {
        op!(self, "cancel", |n| n.cancel(call, now), |w| w.cancel(call, now))
    }

    /// `take-wakes`, fallible: the calls granted a bulkhead slot since the last take, in
    /// grant order (docs/policy.md, "The queue").
    pub fn try_take_wakes(&mut self) -> Result<Vec<u64>, Trap> {
        op!(self, "take-wakes", |n| n.take_wakes(), |w| w.take_wakes())
    }

    /// `drain-events`, fallible. Draining a breaker transition takes a state snapshot, so that
    /// a recovery never forgets a trip. (Not a budget refusal or a key eviction: they can come
    /// on every call, and a snapshot walks the whole state.)
    pub fn try_drain_events(&mut self) -> Result<Vec<Event>, Trap> {
        let events = op!(self, "drain-events", |n| n.drain_events(), |w| w.drain_events())?;
        if events.iter().any(|e| e.kind == EventKind::BreakerTransition) {
            // A failed checkpoint has recovered already; the events stand.
            let _ = self.checkpoint();
        }
        Ok(events)
    }

    /// `policy-index`, fallible.
    pub fn try_policy_index(&mut self, name: &str) -> Result<Option<u32>, Trap> {
        op!(self, "policy-index", |n| n.policy_index(name), |w| w.policy_index(name))
    }

    /// `policy-info`, fallible.
    pub fn try_policy_info(&mut self, policy: u32) -> Result<Option<PolicyInfo>, Trap> {
        op!(self, "policy-info", |n| n.policy_info(policy), |w| w.policy_info(policy))
    }

    /// `policy-json`, fallible.
    pub fn try_policy_json(&mut self, policy: u32) -> Result<Option<String>, Trap> {
        op!(self, "policy-json", |n| n.policy_json(policy), |w| w.policy_json(policy))
    }

    /// `analyze`, fallible.
    pub fn try_analyze(&mut self, policy: u32, layers: u32) -> Result<Option<Analysis>, Trap> {
        op!(self, "analyze", |n| n.analyze(policy, layers), |w| w.analyze(policy, layers))
    }

    /// `policy-count`, fallible.
    pub fn try_policy_count(&mut self) -> Result<u32, Trap> {
        op!(self, "policy-count", |n| n.policy_count(), |w| w.policy_count())
    }

    /// `breaker-state`, fallible.
    pub fn try_breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Result<Option<BreakerState>, Trap> {
        self.keyed_calls += !key.is_empty() as usize;
        op!(self, "breaker-state", |n| n.breaker_state(policy, key, now), |w| w.breaker_state(policy, key, now))
    }

    /// `set-breaker-state`, fallible (the outer `Result` is the trap). A success takes a snapshot.
    pub fn try_set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<Result<(), String>, Trap> {
        self.keyed_calls += !key.is_empty() as usize;
        let r = op!(self, "set-breaker-state", |n| n.set_breaker_state(policy, key, state, now), |w| w
            .set_breaker_state(policy, key, state, now))?;
        if r.is_ok() {
            let _ = self.checkpoint();
        }
        Ok(r)
    }

    /// `export-state`, fallible.
    pub fn try_export_state(&mut self) -> Result<Vec<u8>, Trap> {
        #[cfg_attr(not(feature = "wasm"), allow(unused_variables))]
        let work = self.state_work();
        let bytes = op!(self, "export-state", |n| n.export_state(), |w| w.export_state(work))?;
        self.state_bytes = bytes.len();
        self.keyed_calls = 0;
        Ok(bytes)
    }

    /// `export-snapshot`, fallible: the state of the keys holding protection only (what a
    /// recovery must not forget), in the format of `export-state`, readable by `import-state`.
    /// Its guest call gets the bound of `export-state` (by the whole state's bytes), though its
    /// cost follows the protected keys.
    pub fn try_export_snapshot(&mut self) -> Result<Vec<u8>, Trap> {
        #[cfg_attr(not(feature = "wasm"), allow(unused_variables))]
        let work = self.state_work();
        op!(self, "export-snapshot", |n| n.export_snapshot(), |w| w.export_snapshot(work))
    }

    /// `import-state`, fallible (the outer `Result` is the trap). A success takes a snapshot.
    pub fn try_import_state(&mut self, state: &[u8]) -> Result<Result<(), LoadError>, Trap> {
        #[cfg_attr(not(feature = "wasm"), allow(unused_variables))]
        let work = self.state_work();
        let r = op!(self, "import-state", |n| n.import_state(state), |w| w.import_state(state, work))?;
        if r.is_ok() {
            self.state_bytes = state.len();
            self.keyed_calls = 0;
            let _ = self.checkpoint();
        }
        Ok(r)
    }

    /// `reload`, fallible (the outer `Result` is the trap). A success becomes the document a
    /// recovery loads, and takes a snapshot.
    pub fn try_reload(&mut self, document: &str) -> Result<Result<(), Vec<LoadError>>, Trap> {
        #[cfg_attr(not(feature = "wasm"), allow(unused_variables))]
        let work = self.state_work();
        let r = op!(self, "reload", |n| n.reload(document), |w| w.reload(document, work))?;
        if r.is_ok() {
            self.document = document.to_string();
            let _ = self.checkpoint();
        }
        Ok(r)
    }

    /// `call-info`, fallible.
    pub fn try_call_info(&mut self, call: u64) -> Result<Option<CallInfo>, Trap> {
        op!(self, "call-info", |n| n.call_info(call), |w| w.call_info(call))
    }
}

/// The plain methods: exactly `levee_core::Engine`'s names, arguments and return types.
/// After a trap they answer as the module documentation says.
impl RawEngine {
    /// Begin a call and acquire its first attempt.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        call: u64,
        policy: u32,
        key: &str,
        flags: u32,
        now: u64,
        settle_call: u64,
        settle_at: u64,
        settle_elapsed: u64,
    ) -> Verdict {
        self.try_start(call, policy, key, flags, now, settle_call, settle_at, settle_elapsed).unwrap_or(TRAPPED)
    }

    /// Acquire the next attempt of a call.
    pub fn acquire(&mut self, call: u64, now: u64) -> Verdict {
        self.try_acquire(call, now).unwrap_or(TRAPPED)
    }

    /// Report the outcome of the attempt in flight.
    #[allow(clippy::too_many_arguments)]
    pub fn report(
        &mut self,
        call: u64,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Verdict {
        self.try_report(call, now, elapsed, kind, code, text, wall_secs, flags).unwrap_or(TRAPPED)
    }

    /// Report whether the chosen fallback succeeded.
    pub fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> Verdict {
        self.try_report_fallback(call, now, ok).unwrap_or(TRAPPED)
    }

    /// Abandon a call.
    pub fn cancel(&mut self, call: u64, now: u64) {
        let _ = self.try_cancel(call, now);
    }

    /// Take the calls granted a bulkhead slot since the last take (none after a trap: the
    /// parked calls then go on at their own wait's end).
    pub fn take_wakes(&mut self) -> Vec<u64> {
        self.try_take_wakes().unwrap_or_default()
    }

    /// Take the events recorded since the last drain.
    pub fn drain_events(&mut self) -> Vec<Event> {
        self.try_drain_events().unwrap_or_default()
    }

    /// Index of a named policy.
    pub fn policy_index(&mut self, name: &str) -> Option<u32> {
        self.try_policy_index(name).unwrap_or(None)
    }

    /// What a host needs to know of a policy.
    pub fn policy_info(&mut self, index: u32) -> Option<PolicyInfo> {
        self.try_policy_info(index).unwrap_or(None)
    }

    /// The policy with every default, as JSON.
    pub fn policy_json(&mut self, index: u32) -> Option<String> {
        self.try_policy_json(index).unwrap_or(None)
    }

    /// Worst cases of a policy run by `layers` layers.
    pub fn analyze(&mut self, index: u32, layers: u32) -> Option<Analysis> {
        self.try_analyze(index, layers).unwrap_or(None)
    }

    /// Number of policies.
    pub fn policy_count(&mut self) -> u32 {
        self.try_policy_count().unwrap_or(0)
    }

    /// Breaker state of a policy and key at `now`.
    pub fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Option<BreakerState> {
        self.try_breaker_state(policy, key, now).unwrap_or(None)
    }

    /// Force a breaker state.
    pub fn set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<(), String> {
        self.try_set_breaker_state(policy, key, state, now).unwrap_or_else(|t| Err(t.to_string()))
    }

    /// The whole engine state as versioned bytes.
    pub fn export_state(&mut self) -> Vec<u8> {
        self.try_export_state().unwrap_or_default()
    }

    /// The state of the keys holding protection (see [`RawEngine::try_export_snapshot`]).
    pub fn export_snapshot(&mut self) -> Vec<u8> {
        self.try_export_snapshot().unwrap_or_default()
    }

    /// Restore exported state.
    pub fn import_state(&mut self, bytes: &[u8]) -> Result<(), LoadError> {
        self.try_import_state(bytes).unwrap_or_else(|t| Err(LoadError::new("", t.to_string())))
    }

    /// Replace the policies, keeping the state that still applies.
    pub fn reload(&mut self, document: &str) -> Result<(), Vec<LoadError>> {
        self.try_reload(document).unwrap_or_else(|t| Err(trapped_load(&t)))
    }

    /// What the engine knows of a live call.
    pub fn call_info(&mut self, call: u64) -> Option<CallInfo> {
        self.try_call_info(call).unwrap_or(None)
    }
}

#[cfg(feature = "wasm")]
pub(crate) mod wasm {
    //! The component in wasmtime: compiled once per process (or read from the cache of
    //! [`crate::cache`]), one store per engine.

    use std::sync::OnceLock;

    use levee_core::{
        Analysis, BreakerState, CallInfo, Event, EventKind, HedgeCommand, LoadError, OutcomeKind, PolicyInfo, Reason, Verdict,
    };
    use wasmtime::component::{Component, Linker, ResourceAny};
    use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder};

    use super::Limits;

    wasmtime::component::bindgen!({
        // host-rust/wit/levee.wit is a symlink to the repository's wit/levee.wit, which a packaged
        // crate carries as a file (a path outside the crate would not be packaged).
        path: "wit/levee.wit",
        world: "levee",
    });

    use exports::levee::policy::types as wit;

    /// A hedged call's answer from the guest, checked for shape (see `try_hedge_step`).
    fn hedge_answer(a: wit::HedgeAnswer) -> Result<(Vec<HedgeCommand>, bool), String> {
        let max = levee_core::hedge::MAX_ATTEMPTS_POLLY;
        let attempt = |n: u32| if (1..=max).contains(&n) { Ok(n) } else { Err(format!("a hedge command names attempt {n}")) };
        let commands = a
            .commands
            .into_iter()
            .map(|c| {
                Ok(match c {
                    wit::HedgeCommand::Start(s) => HedgeCommand::Start { attempt: attempt(s.attempt)?, timeout: s.timeout },
                    wit::HedgeCommand::Cancel(n) => HedgeCommand::Cancel { attempt: attempt(n)? },
                    wit::HedgeCommand::Wait(delay) => HedgeCommand::Wait { delay },
                    wit::HedgeCommand::End(e) => {
                        let verdict = super::checked(Ok(e.verdict))?;
                        if e.attempt > max {
                            return Err(format!("a hedge command names attempt {}", e.attempt));
                        }
                        HedgeCommand::End { attempt: e.attempt, verdict: Verdict(verdict.0) }
                    }
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok((commands, a.events_pending))
    }

    /// The component bytes built by `levee-build` for this crate.
    pub(crate) static COMPONENT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/levee_policy.wasm"));

    pub(crate) struct Ctx {
        limits: StoreLimits,
    }

    struct Compiled {
        engine: Engine,
        component: Component,
        pre: LeveePre<Ctx>,
    }

    static COMPILED: OnceLock<Result<Compiled, String>> = OnceLock::new();

    /// The engine's configuration (the cache's entries are named after what it compiles for).
    pub(crate) fn engine_config() -> Config {
        let mut config = Config::new();
        config.concurrency_support(false);
        config.epoch_interruption(true);
        config
    }

    fn compiled() -> Result<&'static Compiled, String> {
        COMPILED
            .get_or_init(|| {
                let engine = Engine::new(&engine_config()).map_err(|e| format!("{e:#}"))?;
                let ticker = engine.clone();
                std::thread::Builder::new()
                    .name("levee-epoch".into())
                    .spawn(move || loop {
                        std::thread::sleep(super::EPOCH_TICK);
                        ticker.increment_epoch();
                    })
                    .map_err(|e| format!("starting the epoch thread: {e}"))?;
                let (component, _) =
                    crate::cache::load(&engine, COMPONENT).map_err(|e| format!("compiling the policy component: {e:#}"))?;
                let linker = Linker::<Ctx>::new(&engine);
                let pre = linker.instantiate_pre(&component).map_err(|e| format!("{e:#}"))?;
                let pre = LeveePre::new(pre).map_err(|e| format!("{e:#}"))?;
                Ok(Compiled { engine, component, pre })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    pub(crate) struct Instance {
        store: Store<Ctx>,
        levee: Levee,
        handle: ResourceAny,
        /// The engine's id, for `start-unkeyed`.
        id: u32,
        pub(crate) limits: Limits,
    }

    fn msg(e: wasmtime::Error) -> String {
        format!("{e:#}")
    }

    fn reason(r: wit::Reason) -> Reason {
        Reason::from_index(r as u32).unwrap_or(Reason::None)
    }

    fn state(s: wit::BreakerState) -> BreakerState {
        BreakerState::from_index(s as u32).unwrap_or(BreakerState::Closed)
    }

    fn state_in(s: BreakerState) -> wit::BreakerState {
        match s {
            BreakerState::Closed => wit::BreakerState::Closed,
            BreakerState::Open => wit::BreakerState::Open,
            BreakerState::HalfOpen => wit::BreakerState::HalfOpen,
            BreakerState::ForcedOpen => wit::BreakerState::ForcedOpen,
            BreakerState::ForcedClosed => wit::BreakerState::ForcedClosed,
            BreakerState::Disabled => wit::BreakerState::Disabled,
        }
    }

    fn kind_in(k: OutcomeKind) -> wit::OutcomeKind {
        match k {
            OutcomeKind::Success => wit::OutcomeKind::Success,
            OutcomeKind::Timeout => wit::OutcomeKind::Timeout,
            OutcomeKind::ConnectionError => wit::OutcomeKind::ConnectionError,
            OutcomeKind::HttpStatus => wit::OutcomeKind::HttpStatus,
            OutcomeKind::GrpcStatus => wit::OutcomeKind::GrpcStatus,
            OutcomeKind::ErrorClass => wit::OutcomeKind::ErrorClass,
        }
    }

    fn load_error(e: wit::LoadError) -> LoadError {
        LoadError::new(&e.path, e.message)
    }

    /// Call a method of the engine resource (or, after `fn`, a function of the interface)
    /// within an epoch deadline.
    macro_rules! call {
        ($self:ident, work($bytes:expr), $method:ident ( $($arg:expr),* )) => {{
            let ticks = $self.limits.work_ticks($bytes);
            $self.store.set_epoch_deadline(ticks);
            let handle = $self.handle;
            $self.levee.levee_policy_engine_api().engine().$method(&mut $self.store, handle $(, $arg)*).map_err(msg)
        }};
        ($self:ident, $ticks:ident, fn $function:ident ( $($arg:expr),* )) => {{
            $self.store.set_epoch_deadline($self.limits.$ticks);
            $self.levee.levee_policy_engine_api().$function(&mut $self.store $(, $arg)*).map_err(msg)
        }};
        ($self:ident, $ticks:ident, $method:ident ( $($arg:expr),* )) => {{
            $self.store.set_epoch_deadline($self.limits.$ticks);
            let handle = $self.handle;
            $self.levee.levee_policy_engine_api().engine().$method(&mut $self.store, handle $(, $arg)*).map_err(msg)
        }};
    }

    include!("durable_wasm.rs");
    include!("exec_wasm.rs");
    include!("fleet_wasm.rs");

    impl Instance {
        /// A fresh instance holding a loaded engine.
        pub(crate) fn load(doc: &str, seed: u64, limits: Limits) -> Result<Instance, Vec<LoadError>> {
            let fail = |m: String| vec![LoadError::new("", m)];
            let c = compiled().map_err(fail)?;
            let ctx =
                Ctx { limits: StoreLimitsBuilder::new().memory_size(limits.memory_bytes).instances(16).tables(16).memories(4).build() };
            let mut store = Store::new(&c.engine, ctx);
            store.limiter(|ctx| &mut ctx.limits);
            store.set_epoch_deadline(limits.work_ticks(doc.len()));
            let levee = c.pre.instantiate(&mut store).map_err(|e| fail(format!("instantiating the policy component: {e:#}")))?;
            let loaded = levee
                .levee_policy_engine_api()
                .engine()
                .call_load(&mut store, doc, seed)
                .map_err(|e| fail(format!("the policy engine trapped in `load`: {e:#}")))?;
            let handle = loaded.map_err(|errors| errors.into_iter().map(load_error).collect::<Vec<_>>())?;
            let id = levee
                .levee_policy_engine_api()
                .engine()
                .call_id(&mut store, handle)
                .map_err(|e| fail(format!("the policy engine trapped in `id`: {e:#}")))?;
            Ok(Instance { store, levee, handle, id, limits })
        }

        #[allow(clippy::too_many_arguments)]
        pub(crate) fn start(
            &mut self,
            call: u64,
            policy: u32,
            key: &str,
            flags: u32,
            now: u64,
            sc: u64,
            sa: u64,
            se: u64,
        ) -> Result<u64, String> {
            if key.is_empty() {
                // The hot path: primitives only (no handle-table lend, no string copied in).
                let id = self.id;
                return call!(self, call_ticks, fn call_start_unkeyed(id, call, policy, flags, now, sc, sa, se));
            }
            call!(self, call_ticks, call_start(call, policy, key, flags, now, sc, sa, se))
        }

        pub(crate) fn acquire(&mut self, call: u64, now: u64) -> Result<u64, String> {
            call!(self, call_ticks, call_acquire(call, now))
        }

        #[allow(clippy::too_many_arguments)]
        pub(crate) fn report(
            &mut self,
            call: u64,
            now: u64,
            elapsed: u64,
            kind: OutcomeKind,
            code: i32,
            text: &str,
            wall: u64,
            flags: u32,
        ) -> Result<u64, String> {
            call!(self, call_ticks, call_report(call, now, elapsed, kind_in(kind), code, text, wall, flags))
        }

        pub(crate) fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> Result<u64, String> {
            call!(self, call_ticks, call_report_fallback(call, now, ok))
        }

        pub(crate) fn cancel(&mut self, call: u64, now: u64) -> Result<(), String> {
            call!(self, call_ticks, call_cancel(call, now))
        }

        pub(crate) fn take_wakes(&mut self) -> Result<Vec<u64>, String> {
            call!(self, call_ticks, call_take_wakes())
        }

        pub(crate) fn hedge_step(&mut self, call: u64, now: u64) -> Result<(Vec<HedgeCommand>, bool), String> {
            hedge_answer(call!(self, call_ticks, call_hedge_step(call, now))?)
        }

        #[allow(clippy::too_many_arguments)]
        pub(crate) fn report_attempt(
            &mut self,
            call: u64,
            attempt: u32,
            now: u64,
            elapsed: u64,
            kind: OutcomeKind,
            code: i32,
            text: &str,
            wall: u64,
            flags: u32,
        ) -> Result<(Vec<HedgeCommand>, bool), String> {
            hedge_answer(call!(self, call_ticks, call_report_attempt(call, attempt, now, elapsed, kind_in(kind), code, text, wall, flags))?)
        }

        pub(crate) fn drain_events(&mut self) -> Result<Vec<Event>, String> {
            let events = call!(self, call_ticks, call_drain_events())?;
            events
                .into_iter()
                .map(|w| {
                    Ok(Event {
                        at: w.at,
                        kind: EventKind::from_index(w.kind as u32).ok_or("an event of unknown kind")?,
                        policy: w.policy,
                        key: w.key,
                        call: w.call,
                        attempt: w.attempt,
                        reason: reason(w.reason),
                        duration: w.duration,
                        state_from: state(w.state_from),
                        state_to: state(w.state_to),
                        name: w.name,
                        value: w.value,
                    })
                })
                .collect::<Result<Vec<_>, &str>>()
                .map_err(str::to_string)
        }

        pub(crate) fn policy_index(&mut self, name: &str) -> Result<Option<u32>, String> {
            call!(self, call_ticks, call_policy_index(name))
        }

        pub(crate) fn policy_info(&mut self, policy: u32) -> Result<Option<PolicyInfo>, String> {
            let info = call!(self, call_ticks, call_policy_info(policy))?;
            Ok(info.map(|i| PolicyInfo {
                name: i.name,
                max_attempts: i.max_attempts,
                attempt_timeout: i.attempt_timeout,
                deadline: i.deadline,
                fallbacks: i.fallbacks,
            }))
        }

        pub(crate) fn policy_json(&mut self, policy: u32) -> Result<Option<String>, String> {
            call!(self, call_ticks, call_policy_json(policy))
        }

        pub(crate) fn analyze(&mut self, policy: u32, layers: u32) -> Result<Option<Analysis>, String> {
            let a = call!(self, call_ticks, call_analyze(policy, layers))?;
            Ok(a.map(|a| Analysis {
                worst_attempts: a.worst_attempts,
                worst_latency: a.worst_latency,
                amplification: a.amplification,
                amplification_with_budget: a.amplification_with_budget,
            }))
        }

        pub(crate) fn policy_count(&mut self) -> Result<u32, String> {
            call!(self, call_ticks, call_policy_count())
        }

        pub(crate) fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Result<Option<BreakerState>, String> {
            Ok(call!(self, call_ticks, call_breaker_state(policy, key, now))?.map(state))
        }

        pub(crate) fn set_breaker_state(
            &mut self,
            policy: u32,
            key: &str,
            s: BreakerState,
            now: u64,
        ) -> Result<Result<(), String>, String> {
            call!(self, call_ticks, call_set_breaker_state(policy, key, state_in(s), now))
        }

        /// `state` is the size of the state held (see `Limits::bytes_per_tick`). Page by page
        /// (`export_pages`).
        pub(crate) fn export_state(&mut self, state: usize) -> Result<Vec<u8>, String> {
            self.export_pages(false, state)
        }

        /// `state` as for `export_state`.
        pub(crate) fn export_snapshot(&mut self, state: usize) -> Result<Vec<u8>, String> {
            self.export_pages(true, state)
        }

        /// `export-state-page` from cursor 0 until the document is complete: each crossing
        /// copies at most `GUARD_STATE_PAGE_BYTES`, and the guest never holds the document
        /// (docs/hosts.md, "State of any size"). The caller holds the engine (`&mut self`) across
        /// the pages. A page over its bound, or a cursor that does not move on by the page's
        /// bytes, breaks the contract: an error, recovered from as a trap.
        fn export_pages(&mut self, snapshot: bool, state: usize) -> Result<Vec<u8>, String> {
            let mut out = Vec::new();
            let mut cursor = 0u64;
            loop {
                let page = call!(self, work(state.saturating_add(out.len())), call_export_state_page(cursor, snapshot))?;
                let n = page.bytes.len();
                if n > crate::constants::GUARD_STATE_PAGE_BYTES as usize
                    || (page.next != 0 && (n == 0 || page.next != cursor.saturating_add(n as u64)))
                {
                    return Err(format!("export-state-page broke the contract: {n} bytes from cursor {cursor}, next {}", page.next));
                }
                out.extend_from_slice(&page.bytes);
                if page.next == 0 {
                    return Ok(out);
                }
                cursor = page.next;
            }
        }

        /// `import-state-begin`, the bytes in pages of at most `GUARD_STATE_PAGE_BYTES`
        /// (`import-state-page`), `import-state-end`: a state of any size, and on error
        /// nothing changes.
        pub(crate) fn import_state(&mut self, bytes: &[u8], state: usize) -> Result<Result<(), LoadError>, String> {
            // Sized by the whole import, as every step of it is: a recovery under a starved
            // `call_ticks` still restores.
            call!(self, work(bytes.len()), call_import_state_begin())?;
            for page in bytes.chunks(crate::constants::GUARD_STATE_PAGE_BYTES as usize) {
                if let Err(e) = call!(self, work(page.len()), call_import_state_page(page))? {
                    return Ok(Err(load_error(e)));
                }
            }
            Ok(call!(self, work(bytes.len().saturating_add(state)), call_import_state_end())?.map_err(load_error))
        }

        pub(crate) fn reload(&mut self, doc: &str, state: usize) -> Result<Result<(), Vec<LoadError>>, String> {
            Ok(call!(self, work(doc.len().saturating_add(state)), call_reload(doc))?.map_err(|v| v.into_iter().map(load_error).collect()))
        }

        pub(crate) fn call_info(&mut self, call: u64) -> Result<Option<CallInfo>, String> {
            let c = call!(self, call_ticks, call_call_info(call))?;
            Ok(c.map(|c| CallInfo {
                policy: c.policy,
                key: c.key,
                attempts: c.attempts,
                deadline: c.deadline,
                last_reason: reason(c.last_reason),
                in_flight: c.in_flight,
            }))
        }
    }

    /// Imports of the compiled component (zero by construction; checked by a test).
    pub(crate) fn component_imports() -> Result<usize, String> {
        let c = compiled()?;
        Ok(c.component.component_type().imports(&c.engine).count())
    }
}

/// The number of imports of the embedded component (`Some(0)` by construction), or `None`
/// without the `wasm` feature.
pub fn component_imports() -> Option<Result<usize, String>> {
    #[cfg(feature = "wasm")]
    {
        Some(wasm::component_imports())
    }
    #[cfg(not(feature = "wasm"))]
    {
        None
    }
}

/// The embedded component's bytes (`None` without the `wasm` feature).
pub fn component_bytes() -> Option<&'static [u8]> {
    #[cfg(feature = "wasm")]
    {
        Some(wasm::COMPONENT)
    }
    #[cfg(not(feature = "wasm"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "policies:\n  default:\n    attempts: 3\n";

    #[test]
    fn trapped_is_distinct_from_every_protocol_error() {
        assert!(is_trapped(TRAPPED));
        assert!(is_trapped(TRAPPED.with_events(true)));
        for code in InvalidCode::ALL.iter().skip(1) {
            assert!(!is_trapped(Verdict::invalid(*code)));
        }
    }

    #[test]
    fn native_engine_loads_and_answers() {
        let mut e = RawEngine::load_with(Backend::Native, DOC, 1, Limits::default()).map_err(|e| format!("{e:?}"));
        let Ok(e) = e.as_mut() else { return assert!(e.is_ok()) };
        assert_eq!(e.policy_count(), 1);
        let v = e.start(1, 0, "", 0, 10, 0, 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
    }
}
