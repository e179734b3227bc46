//! The runtime glue: one engine ([`RawEngine`]: the wasmtime store and instance, or the
//! native core) shared by every task behind one lock, the crossings into it, the success held
//! back for the next `start`, the record of traps (the engine itself re-instantiates and
//! restores its last snapshot, see [`crate::raw`]), and the emission of events outside the
//! lock. Nothing here decides anything: [`crate::driver`] turns verdicts into actions.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use levee_core::{Event, HedgeCommand, OutcomeKind, PolicyInfo, Verdict};

use crate::driver::{self, PolicyLimits};
use crate::outcome::Outcome;
use crate::park::{Park, Parked, Parker};
use crate::raw::{RawEngine, Trap};
use crate::telemetry::{self, Fault, Telemetry};
use crate::time::EngineClock;

/// One step of the protocol, for tracing hooks ([`crate::Builder::trace`]).
#[derive(Clone, Debug)]
pub struct Step<'a> {
    /// `start`, `acquire`, `report`, `hold-success` (a success held back, settled by the next
    /// `start`), `report-fallback`, `sleep` (also a hedged call's `wait`), and a hedged call's
    /// `hedge-step` and `report-attempt`.
    pub op: &'static str,
    /// The host's monotonic time of the step, in ns since the handle was made.
    pub now: u64,
    /// The call id.
    pub call: u64,
    /// The policy.
    pub policy: &'a str,
    /// The outcome reported (for `report` and `hold-success`).
    pub outcome: Option<&'a Outcome>,
    /// The core's answer (`None` for `hold-success`, whose answer is `done`, and `sleep`; for
    /// `hedge-step` and `report-attempt`, the verdict of the `end` they answered, if one).
    pub verdict: Option<Verdict>,
    /// For `sleep` (a retry delay or a rate-limit wait about to be slept): its length.
    pub sleep: Option<std::time::Duration>,
}

pub(crate) type TraceFn = Arc<dyn Fn(&Step<'_>) + Send + Sync>;
pub(crate) type ListenFn = Arc<dyn Fn(&Event, &str) + Send + Sync>;

/// A success whose report is held back.
#[derive(Clone, Copy)]
pub(crate) struct Held {
    pub(crate) call: u64,
    pub(crate) at: u64,
    pub(crate) elapsed: u64,
}

/// Where a call that succeeded leaves its held-back report without taking the engine's lock
/// (the lock is the one `start` takes; a second per call doubled the contention between
/// tasks). Whoever takes the lock next moves it into [`Core::held`] ([`Shared::lock`]), so
/// that it is settled before anything else the engine does.
///
/// The same word counts the calls parked in bulkhead queues ([`crate::park`]): a held-back
/// success frees its slot only once settled, so while any call is parked nothing is left here
/// (a success is reported at once, and its report grants the slot to a parked call). A success being written
/// when the first call parks backs out ([`Put::Parked`]); one already here then is settled by
/// the parking crossing itself ([`HeldSlot::park`]).
pub(crate) struct HeldSlot {
    /// Bits 0-1: [`HeldSlot::EMPTY`], [`HeldSlot::WRITING`] or [`HeldSlot::FULL`]; above them,
    /// the calls parked (in units of [`HeldSlot::PARKED`]).
    state: AtomicU64,
    call: AtomicU64,
    at: AtomicU64,
    elapsed: AtomicU64,
}

/// What [`HeldSlot::put`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Put {
    /// Left in the slot.
    Held,
    /// The slot is taken (or being written): settle through the lock.
    Busy,
    /// Calls are parked: report the success now.
    Parked,
}

impl HeldSlot {
    const EMPTY: u64 = 0;
    const WRITING: u64 = 1;
    const FULL: u64 = 2;
    const SLOT: u64 = 3;
    const PARKED: u64 = 4;

    pub(crate) fn new() -> Self {
        HeldSlot { state: AtomicU64::new(Self::EMPTY), call: AtomicU64::new(0), at: AtomicU64::new(0), elapsed: AtomicU64::new(0) }
    }

    /// Leave `h` here, unless the slot is taken or a call is parked.
    #[inline]
    fn put(&self, h: Held) -> Put {
        if let Err(s) = self.state.compare_exchange(Self::EMPTY, Self::WRITING, Ordering::Acquire, Ordering::Relaxed) {
            return if s >= Self::PARKED { Put::Parked } else { Put::Busy };
        }
        self.call.store(h.call, Ordering::Relaxed);
        self.at.store(h.at, Ordering::Relaxed);
        self.elapsed.store(h.elapsed, Ordering::Relaxed);
        // Publish it, or back out if a call parked meanwhile (it could not take it).
        let publish = |s: u64| Some(if s < Self::PARKED { Self::FULL } else { s & !Self::SLOT });
        match self.state.fetch_update(Ordering::Release, Ordering::Relaxed, publish) {
            Ok(s) if s < Self::PARKED => Put::Held,
            _ => Put::Parked,
        }
    }

    /// Take what was left here. Only under the engine's lock, so there is one taker at a time;
    /// a report still being written is left for the next taker.
    #[inline]
    fn take(&self) -> Option<Held> {
        if self.state.load(Ordering::Acquire) & Self::SLOT != Self::FULL {
            return None;
        }
        let h = Held {
            call: self.call.load(Ordering::Relaxed),
            at: self.at.load(Ordering::Relaxed),
            elapsed: self.elapsed.load(Ordering::Relaxed),
        };
        // Empty again; a park ending meanwhile only changes the count above.
        self.state.fetch_and(!Self::SLOT, Ordering::Release);
        Some(h)
    }

    /// Count a call parked (under the engine's lock); a success left here since the lock was
    /// taken is returned, for the caller to settle.
    pub(crate) fn park(&self) -> Option<Held> {
        let before = self.state.fetch_add(Self::PARKED, Ordering::AcqRel);
        if before & Self::SLOT == Self::FULL {
            self.take()
        } else {
            None
        }
    }

    /// Count a park out.
    pub(crate) fn unpark(&self) {
        self.state.fetch_sub(Self::PARKED, Ordering::Release);
    }

    /// Calls parked.
    #[inline]
    pub(crate) fn parked(&self) -> u64 {
        self.state.load(Ordering::Acquire) / Self::PARKED
    }
}

/// FNV-1a: policy names come from the document, so a DoS-resistant hash buys nothing on
/// the hot path.
#[derive(Clone, Copy, Default)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = h;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) struct Policies {
    pub(crate) info: Vec<Arc<PolicyInfo>>,
    /// For documents of many policies; a few are found faster by comparing names in order.
    by_name: Option<HashMap<String, u32, BuildHasherDefault<Fnv>>>,
}

/// Up to this many policies, a name is looked up by comparing it with each in turn.
const SCAN_POLICIES: usize = 8;

impl Policies {
    pub(crate) fn read(raw: &mut RawEngine) -> Result<Policies, Trap> {
        let count = raw.try_policy_count()?;
        let mut info = Vec::with_capacity(count as usize);
        for i in 0..count {
            if let Some(p) = raw.try_policy_info(i)? {
                info.push(Arc::new(p));
            }
        }
        let by_name = (info.len() > SCAN_POLICIES).then(|| info.iter().enumerate().map(|(i, p)| (p.name.clone(), i as u32)).collect());
        Ok(Policies { info, by_name })
    }

    /// A policy by name: its index and what the host knows of it.
    #[inline]
    pub(crate) fn named(&self, name: &str) -> Option<(u32, &PolicyInfo)> {
        let index = match &self.by_name {
            None => self.info.iter().position(|p| p.name == name)? as u32,
            Some(map) => *map.get(name)?,
        };
        self.info.get(index as usize).map(|p| (index, &**p))
    }

    pub(crate) fn index(&self, name: &str) -> Option<u32> {
        self.named(name).map(|(i, _)| i)
    }

    pub(crate) fn len(&self) -> usize {
        self.info.len()
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.info.iter().map(|p| p.name.clone()).collect()
    }
}

/// The engine and what its lock protects.
pub(crate) struct Core {
    pub(crate) raw: RawEngine,
    /// The next call id (taken under the lock that `start` holds anyway).
    next_call: u64,
    held: Option<Held>,
    pub(crate) policies: Policies,
    events: Vec<Event>,
    pub(crate) traps: Vec<Trap>,
    /// Calls the core granted a bulkhead slot, to wake when the locked section ends.
    wakes: Vec<u64>,
}

impl Core {
    pub(crate) fn new(raw: RawEngine, policies: Policies) -> Self {
        Core { raw, next_call: 1, held: None, policies, events: Vec::new(), traps: Vec::new(), wakes: Vec::new() }
    }

    /// Collect the events, and the calls to wake, a verdict says are pending.
    #[inline]
    pub(crate) fn note(&mut self, v: Verdict) {
        if v.events_pending() {
            self.drain();
        }
        if v.wakes_pending() {
            self.take_wakes();
        }
    }

    /// Collect the calls the core granted a slot (`take-wakes`), to wake when the locked
    /// section ends.
    pub(crate) fn take_wakes(&mut self) {
        match self.raw.try_take_wakes() {
            Ok(mut w) => self.wakes.append(&mut w),
            Err(t) => self.traps.push(t),
        }
    }

    /// Collect the pending events.
    pub(crate) fn drain(&mut self) {
        match self.raw.try_drain_events() {
            Ok(mut e) => self.events.append(&mut e),
            Err(t) => self.traps.push(t),
        }
    }

    /// Collect the events the engine holds after a crossing that answers no verdict to say
    /// so (`fleet-apply`, whose quorum may open a breaker).
    #[cfg(feature = "fleet-redis")]
    pub(crate) fn collect_events(&mut self) {
        match self.raw.try_drain_events() {
            Ok(mut e) => self.events.append(&mut e),
            Err(t) => self.traps.push(t),
        }
    }

    /// Send a held-back success now (before any operation other than `start`).
    pub(crate) fn flush(&mut self) {
        if let Some(h) = self.held.take() {
            match self.raw.try_report(h.call, h.at, h.elapsed, OutcomeKind::Success, 0, "", 0, 0) {
                Ok(v) => self.note(v),
                Err(t) => self.traps.push(t),
            }
        }
    }

    fn hold(&mut self, h: Held) {
        self.flush();
        self.held = Some(h);
    }

    fn take_events(&mut self) -> (Vec<Event>, Vec<Trap>) {
        (std::mem::take(&mut self.events), std::mem::take(&mut self.traps))
    }
}

/// What `start` gives the call: its id, its policy's limits, the verdict (or the
/// trap), the events to emit once the step is traced, and the call's park when the verdict
/// queued it.
pub(crate) struct Started<'a> {
    pub(crate) call: u64,
    pub(crate) limits: PolicyLimits,
    pub(crate) verdict: Result<Verdict, Trap>,
    pub(crate) pending: Option<Pending<'a>>,
    pub(crate) parker: Option<Parker<'a>>,
}

/// A fallback registered for one result type: a boxed `FallbackFn<T, E>`, and the name of
/// `Result<T, E>` for the error of a call of another type.
pub(crate) struct Registered {
    pub(crate) f: Arc<dyn Any + Send + Sync>,
    pub(crate) result: String,
}

/// Everything a handle shares between its clones.
pub(crate) struct Shared {
    core: Mutex<Core>,
    held: HeldSlot,
    /// The calls parked in bulkhead queues (counted in `held`).
    parked: Parked,
    pub(crate) clock: EngineClock,
    pub(crate) traps: AtomicU64,
    /// The registered fallbacks, by name and result type (`Levee::register_fallback`).
    pub(crate) fallbacks: Mutex<HashMap<(String, TypeId), Registered>>,
    trace: Option<TraceFn>,
    listener: Option<ListenFn>,
    pub(crate) telemetry: Arc<dyn Telemetry>,
    pub(crate) on_retry: Option<crate::call::RetryFn>,
    /// The per-policy retry predicates (`Builder::retry_if`); empty costs one length check.
    pub(crate) retry_if: HashMap<Box<str>, crate::call::RetryIf>,
}

/// What the fault seam of the host scenarios does to one crossing (see [`crate::Call::fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injected {
    /// The guest traps: the crossing does not happen and the engine re-instantiates.
    Trap,
    /// The crossing happens, its events are dropped, and the host sees this packed verdict.
    Verdict(u64),
}

/// Run `real` on `raw`, or what `inject` says instead.
#[inline]
pub(crate) fn crossing(
    raw: &mut RawEngine,
    inject: Option<Injected>,
    op: &'static str,
    real: impl FnOnce(&mut RawEngine) -> Result<Verdict, Trap>,
) -> Result<Verdict, Trap> {
    match inject {
        None => real(raw),
        Some(Injected::Trap) => Err(raw.reinstantiate(op, "a trap injected by the fault seam")),
        Some(Injected::Verdict(v)) => {
            let r = real(raw);
            if let Ok(real) = r {
                if real.events_pending() {
                    let _ = raw.try_drain_events();
                }
            }
            r.map(|_| Verdict(v))
        }
    }
}

impl Shared {
    pub(crate) fn new(
        core: Core,
        clock: EngineClock,
        trace: Option<TraceFn>,
        listener: Option<ListenFn>,
        telemetry: Arc<dyn Telemetry>,
        on_retry: Option<crate::call::RetryFn>,
        retry_if: HashMap<Box<str>, crate::call::RetryIf>,
    ) -> Self {
        Shared {
            core: Mutex::new(core),
            held: HeldSlot::new(),
            parked: Parked::default(),
            clock,
            traps: AtomicU64::new(0),
            fallbacks: Mutex::new(HashMap::new()),
            trace,
            listener,
            telemetry,
            on_retry,
            retry_if,
        }
    }

    /// Tell the trace hook of a step.
    #[inline]
    pub(crate) fn step(&self, op: &'static str, now: u64, call: u64, policy: &str, outcome: Option<&Outcome>, verdict: Option<Verdict>) {
        if let Some(t) = &self.trace {
            t(&Step { op, now, call, policy, outcome, verdict, sleep: None });
        }
    }

    /// Tell the trace hook of a sleep about to start.
    pub(crate) fn step_sleep(&self, call: u64, policy: &str, delay: u64) {
        if let Some(t) = &self.trace {
            let sleep = Some(std::time::Duration::from_nanos(delay));
            t(&Step { op: "sleep", now: self.now(), call, policy, outcome: None, verdict: None, sleep });
        }
    }

    /// The engine, with any success left in the slot moved in to be settled first.
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        let mut core = self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(h) = self.held.take() {
            core.hold(h);
        }
        core
    }

    /// Hold back the report of a success (its answer is always `done`) for the next `start`;
    /// `false` when calls are parked in bulkhead queues (the success must free its slot now:
    /// the caller reports it).
    #[inline]
    pub(crate) fn hold(&self, h: Held) -> bool {
        match self.held.put(h) {
            Put::Held => true,
            Put::Parked => false,
            Put::Busy => {
                // Another success is in the slot (or being written): settle through the lock,
                // where the count of parked calls is exact (parks are counted under it).
                let mut core = self.lock();
                if self.held.parked() > 0 {
                    self.finish_locked(core);
                    return false;
                }
                core.hold(h);
                true
            }
        }
    }

    #[inline]
    pub(crate) fn now(&self) -> u64 {
        self.clock.now()
    }

    /// `start` a call under the policy at `index`-by-name, settling a held-back success in the
    /// same guest call. `Err` with the document's names when there is no such policy.
    #[inline]
    pub(crate) fn start(
        &self,
        policy: &str,
        key: &str,
        flags: u32,
        now: u64,
        inject: Option<Injected>,
    ) -> Result<Started<'_>, Vec<String>> {
        let mut core = self.lock();
        let Some((index, limits)) = core.policies.named(policy).map(|(i, p)| (i, PolicyLimits::of(p))) else {
            return Err(core.policies.names());
        };
        let call = core.next_call;
        core.next_call = call.wrapping_add(1).max(1);
        let held = core.held.take();
        let (sc, sa, se) = held.map(|h| (h.call, h.at, h.elapsed)).unwrap_or((0, 0, 0));
        let verdict = crossing(&mut core.raw, inject, "start", |raw| raw.try_start(call, index, key, flags, now, sc, sa, se));
        let parker = self.answered(&mut core, call, &verdict);
        let pending = self.unlock(core);
        Ok(Started { call, limits, verdict, pending, parker })
    }

    /// The `acquire` of `call` at `now` (after settling a held-back success); when its
    /// verdict queues the call, the park is registered in the same locked section.
    #[inline]
    pub(crate) fn acquire(
        &self,
        call: u64,
        now: u64,
        inject: Option<Injected>,
    ) -> (Result<Verdict, Trap>, Option<Pending<'_>>, Option<Parker<'_>>) {
        let mut core = self.lock();
        core.flush();
        let r = crossing(&mut core.raw, inject, "acquire", |raw| raw.try_acquire(call, now));
        let parker = self.answered(&mut core, call, &r);
        let pending = self.unlock(core);
        (r, pending, parker)
    }

    /// The `report` of an attempt (the crossing `op`): a slot it frees is granted by the core
    /// to the oldest waiter, which the verdict's wakes bit says (docs/policy.md, "The queue").
    #[inline]
    pub(crate) fn report(&self, op: impl FnOnce(&mut RawEngine) -> Result<Verdict, Trap>) -> (Result<Verdict, Trap>, Option<Pending<'_>>) {
        self.cross(op)
    }

    /// Park `call`, which the verdict of this locked section queued. A success left in the
    /// slot since the lock was taken (only when this is the first park) is settled now: the
    /// slot it frees is granted, and the call granted is woken when the section ends.
    /// Take in the verdict of `call`'s `start` or `acquire`, under the lock that crossed: note
    /// it, and register the park it asks for (a `wait` that queued the call).
    fn answered<'s>(&'s self, core: &mut Core, call: u64, r: &Result<Verdict, Trap>) -> Option<Parker<'s>> {
        let v = *r.as_ref().ok()?;
        core.note(v);
        driver::parks(v).then(|| self.park_locked(core, call))
    }

    fn park_locked<'s>(&'s self, core: &mut Core, call: u64) -> Parker<'s> {
        let parker = Parker::new(&self.parked, &self.held, call, self.parked.join(call));
        if let Some(h) = self.held.park() {
            core.hold(h);
            core.flush();
        }
        parker
    }

    /// One crossing under the lock (after settling a held-back success); the events it
    /// collected are emitted when the returned [`Pending`] is dropped.
    #[inline]
    pub(crate) fn cross(&self, op: impl FnOnce(&mut RawEngine) -> Result<Verdict, Trap>) -> (Result<Verdict, Trap>, Option<Pending<'_>>) {
        let mut core = self.lock();
        core.flush();
        let r = op(&mut core.raw);
        if let Ok(v) = r {
            core.note(v);
        }
        (r, self.unlock(core))
    }

    /// A crossing of a hedged call (`hedge-step`, `report-attempt`) under the lock, as
    /// [`Shared::cross`]: its commands, and the events it collected to emit when the returned
    /// [`Pending`] is dropped. The report of an attempt (`closes`) may free a slot: the call
    /// the core grants it to is woken, as after [`Shared::report`].
    pub(crate) fn cross_hedge(
        &self,
        closes: bool,
        op: impl FnOnce(&mut RawEngine) -> Result<(Vec<HedgeCommand>, bool), Trap>,
    ) -> (Result<Vec<HedgeCommand>, Trap>, Option<Pending<'_>>) {
        let mut core = self.lock();
        core.flush();
        let r = op(&mut core.raw).map(|(commands, pending)| {
            if pending {
                core.drain();
            }
            commands
        });
        // The answer has no wakes bit: a report of an attempt (it may free a slot), or an end
        // verdict that carries the bit, takes the wakes while calls are parked here.
        if let Ok(commands) = &r {
            let ended_with_wakes = commands.iter().any(|c| matches!(c, HedgeCommand::End { verdict, .. } if verdict.wakes_pending()));
            if (closes || ended_with_wakes) && self.held.parked() > 0 {
                core.take_wakes();
            }
        }
        (r, self.unlock(core))
    }

    /// Abandon a call in the engine; the slot it held, or the grant it had, goes to the oldest
    /// waiter, woken when the lock is released.
    pub(crate) fn cancel(&self, call: u64) {
        let now = self.now();
        let mut core = self.lock();
        core.flush();
        match core.raw.try_cancel(call, now) {
            Ok(()) => {
                if self.held.parked() > 0 {
                    core.take_wakes();
                }
            }
            Err(t) => core.traps.push(t),
        }
        self.finish_locked(core);
    }

    /// A call of `policy` went down the recovery path: count a trap, emit `engine-fault`.
    pub(crate) fn fault(&self, fault: Fault, policy: &str, key: &str, call: u64) {
        if fault != Fault::Invalid {
            self.traps.fetch_add(1, Ordering::Relaxed);
        }
        telemetry::fault(&*self.telemetry, fault, policy, key, call);
    }

    /// Replace the instance after a verdict that broke the contract.
    pub(crate) fn reinstantiate(&self, call: u64) {
        let mut core = self.lock();
        core.flush();
        let _ = core.raw.reinstantiate("verdict", format!("a verdict for call {call} broke the contract"));
        drop(core);
    }

    /// Unlock, then emit the events and traps collected.
    pub(crate) fn finish_locked(&self, core: MutexGuard<'_, Core>) {
        drop(self.unlock(core));
    }

    /// Unlock; the events and traps collected are emitted when the result is dropped (so
    /// that a trace hook sees a step before the events it caused). The calls the core granted
    /// a slot in this section are woken (under the lock, after any park of the section, so no
    /// wake is lost) and notified once it is released.
    #[inline]
    pub(crate) fn unlock(&self, mut core: MutexGuard<'_, Core>) -> Option<Pending<'_>> {
        let mut woken: Vec<Arc<Park>> = Vec::new();
        if !core.wakes.is_empty() {
            let calls = std::mem::take(&mut core.wakes);
            self.parked.wake(&calls, &mut woken);
        }
        if core.events.is_empty() && core.traps.is_empty() {
            drop(core);
            notify(woken);
            return None;
        }
        let (events, traps) = core.take_events();
        let names = if events.is_empty() { Vec::new() } else { core.policies.names() };
        drop(core);
        notify(woken);
        Some(Pending { shared: self, events, traps, names })
    }

    /// Emit what a locked section collected (outside the lock).
    fn emit(&self, events: Vec<Event>, traps: Vec<Trap>, names: &[String]) {
        for t in &traps {
            // A crossing outside a call's protocol (a held-back success, a drain) trapped.
            tracing::error!(target: "levee", operation = t.operation(), restored = t.restored(), error = %t.message(), "policy engine trapped; re-instantiated");
            self.fault(Fault::Trap, "", "", 0);
        }
        for e in &events {
            let name = names.get(e.policy as usize).map(String::as_str).unwrap_or_default();
            telemetry::emit(&*self.telemetry, e, name);
            if let Some(l) = &self.listener {
                l(e, name);
            }
        }
    }
}

/// Tell the woken calls (after the lock is released).
#[inline]
fn notify(woken: Vec<Arc<Park>>) {
    for p in woken {
        p.notify();
    }
}

/// Emit a call's pending events inside its `levee.call` span (docs/telemetry.md: the events of
/// a call are on its span, so a `tracing` subscriber or an OpenTelemetry layer sees them there).
#[inline]
pub(crate) fn deliver(span: &tracing::Span, pending: Option<Pending<'_>>) {
    if let Some(p) = pending {
        let _in = span.enter();
        drop(p);
    }
}

/// Events and traps to emit once the lock is released.
pub(crate) struct Pending<'a> {
    shared: &'a Shared,
    events: Vec<Event>,
    traps: Vec<Trap>,
    names: Vec<String>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.events.is_empty() && self.traps.is_empty() {
            return;
        }
        self.shared.emit(std::mem::take(&mut self.events), std::mem::take(&mut self.traps), &self.names);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use levee_core::VerdictKind;

    fn held(call: u64) -> Held {
        Held { call, at: 10, elapsed: 5 }
    }

    #[test]
    fn the_held_slot_takes_no_success_while_calls_are_parked() {
        let slot = HeldSlot::new();
        assert_eq!(slot.put(held(1)), Put::Held);
        assert_eq!(slot.put(held(2)), Put::Busy, "one at a time");
        assert_eq!(slot.take().map(|h| h.call), Some(1));
        assert!(slot.take().is_none());
        // The first park finds nothing; while parked, a success is not held back.
        assert!(slot.park().is_none());
        assert!(slot.park().is_none());
        assert_eq!((slot.parked(), slot.put(held(3))), (2, Put::Parked));
        slot.unpark();
        assert_eq!(slot.put(held(3)), Put::Parked);
        slot.unpark();
        assert_eq!((slot.parked(), slot.put(held(4))), (0, Put::Held));
        // A success left in the slot when a call parks is handed to the parking crossing.
        assert_eq!(slot.park().map(|h| h.call), Some(4));
        assert!(slot.take().is_none());
        assert_eq!((slot.parked(), slot.put(held(5))), (1, Put::Parked));
    }

    /// The first park of a crossing finds a success left in the slot after the crossing took
    /// the lock (another thread's, between the two): the crossing settles it, and the call the
    /// core grants the freed slot to (the one parking) is woken when the section ends.
    #[test]
    fn a_success_left_as_the_first_call_parks_is_settled_and_wakes_the_granted_call() {
        let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 1s }\n";
        let levee = crate::Levee::builder().seed(1).load(doc).unwrap();
        let shared = &*levee.shared;
        let mut core = shared.core.lock().unwrap();
        let a = core.raw.try_start(101, 0, "k", 0, 1_000, 0, 0, 0).unwrap();
        assert_eq!(a.kind(), Some(VerdictKind::Attempt));
        let b = core.raw.try_start(102, 0, "k", 0, 2_000, 0, 0, 0).unwrap();
        assert!(driver::parks(b), "{b:?}");
        // A's success arrives in the slot while B's crossing holds the lock.
        assert_eq!(shared.held.put(Held { call: 101, at: 3_000, elapsed: 2_000 }), Put::Held);
        let parker = shared.park_locked(&mut core, 102);
        assert_eq!(core.wakes, [102], "the slot the settled success freed is granted to B");
        assert!(core.held.is_none() && shared.held.take().is_none());
        drop(shared.unlock(core));
        assert!(parker.was_woken_for_tests(), "B is woken as the section ends");
        let mut core = shared.core.lock().unwrap();
        // The core has A's slot back: B, first in the queue, takes it.
        let v = core.raw.try_acquire(102, 4_000).unwrap();
        assert_eq!(v.kind(), Some(VerdictKind::Attempt), "{v:?}");
        drop(core);
        drop(parker);
        assert_eq!(shared.held.parked(), 0);
    }
}
