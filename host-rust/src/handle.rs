//! The async handle: one engine shared by every task, the step protocol driven on tokio.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use levee_core::{BreakerState, Event, InvalidCode, LoadError, OutcomeKind, PolicyInfo, Reason, Verdict, VerdictKind};

use crate::error::{LeveeError, LoadErrors};
use crate::events;
use crate::outcome::{IntoOutcome, Outcome};
use crate::raw::{is_trapped, Backend, Limits, RawEngine, Trap};

/// A boxed future, as fallbacks return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A fallback: called with what triggered it, returns the call's value or an error.
pub type FallbackFn<T, E> = Arc<dyn Fn(FallbackContext) -> BoxFuture<'static, Result<T, E>> + Send + Sync>;

/// What a fallback learns of the call it stands in for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallbackContext {
    /// The policy.
    pub policy: String,
    /// The fallback's name.
    pub name: String,
    /// Why the call fell back.
    pub reason: Reason,
    /// Attempts that ran.
    pub attempts: u32,
}

/// One attempt, as the guarded closure sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// The attempt number, from 1.
    pub number: u32,
    /// The per-attempt timeout the host enforces (`None`: no timeout).
    pub timeout: Option<Duration>,
    /// The call id.
    pub call: u64,
}

/// One step of the protocol, for tracing hooks ([`Builder::trace`]).
#[derive(Clone, Debug)]
pub struct Step<'a> {
    /// `start`, `acquire`, `report`, `hold-success` (a success held back, settled by the next
    /// `start`), `report-fallback`.
    pub op: &'static str,
    /// The host's monotonic time of the step, in ns since the handle was made.
    pub now: u64,
    /// The call id.
    pub call: u64,
    /// The policy.
    pub policy: &'a str,
    /// The outcome reported (for `report` and `hold-success`).
    pub outcome: Option<&'a Outcome>,
    /// The core's answer (`None` for `hold-success`, whose answer is `done`).
    pub verdict: Option<Verdict>,
}

type TraceFn = Arc<dyn Fn(&Step<'_>) + Send + Sync>;
type ListenFn = Arc<dyn Fn(&Event, &str) + Send + Sync>;

#[derive(Clone, Copy)]
struct Held {
    call: u64,
    at: u64,
    elapsed: u64,
}

/// Where a call that succeeded leaves its held-back report without taking the engine's lock
/// (the lock is the one `start` takes; a second per call doubled the contention between
/// tasks). Whoever takes the lock next moves it into [`Core::held`] ([`Shared::lock`]), so
/// that it is settled before anything else the engine does.
struct HeldSlot {
    state: AtomicU8,
    call: AtomicU64,
    at: AtomicU64,
    elapsed: AtomicU64,
}

impl HeldSlot {
    const EMPTY: u8 = 0;
    const WRITING: u8 = 1;
    const FULL: u8 = 2;

    fn new() -> Self {
        HeldSlot { state: AtomicU8::new(Self::EMPTY), call: AtomicU64::new(0), at: AtomicU64::new(0), elapsed: AtomicU64::new(0) }
    }

    /// Leave `h` here; `false` when the slot is taken (the caller takes the lock instead).
    #[inline]
    fn put(&self, h: Held) -> bool {
        if self.state.compare_exchange(Self::EMPTY, Self::WRITING, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        self.call.store(h.call, Ordering::Relaxed);
        self.at.store(h.at, Ordering::Relaxed);
        self.elapsed.store(h.elapsed, Ordering::Relaxed);
        self.state.store(Self::FULL, Ordering::Release);
        true
    }

    /// Take what was left here. Only under the engine's lock, so there is one taker at a time;
    /// a report still being written is left for the next taker.
    #[inline]
    fn take(&self) -> Option<Held> {
        if self.state.load(Ordering::Acquire) != Self::FULL {
            return None;
        }
        let h = Held {
            call: self.call.load(Ordering::Relaxed),
            at: self.at.load(Ordering::Relaxed),
            elapsed: self.elapsed.load(Ordering::Relaxed),
        };
        self.state.store(Self::EMPTY, Ordering::Release);
        Some(h)
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

struct Policies {
    info: Vec<Arc<PolicyInfo>>,
    /// For documents of many policies; a few are found faster by comparing names in order.
    by_name: Option<HashMap<String, u32, BuildHasherDefault<Fnv>>>,
}

/// Up to this many policies, a name is looked up by comparing it with each in turn.
const SCAN_POLICIES: usize = 8;

impl Policies {
    fn read(raw: &mut RawEngine) -> Result<Policies, Trap> {
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
    fn named(&self, name: &str) -> Option<(u32, &PolicyInfo)> {
        let index = match &self.by_name {
            None => self.info.iter().position(|p| p.name == name)? as u32,
            Some(map) => *map.get(name)?,
        };
        self.info.get(index as usize).map(|p| (index, &**p))
    }

    fn index(&self, name: &str) -> Option<u32> {
        self.named(name).map(|(i, _)| i)
    }

    fn len(&self) -> usize {
        self.info.len()
    }
}

struct Core {
    raw: RawEngine,
    /// The next call id (taken under the lock that `start` holds anyway).
    next_call: u64,
    held: Option<Held>,
    policies: Policies,
    events: Vec<Event>,
    traps: Vec<Trap>,
}

impl Core {
    fn note(&mut self, v: Verdict) {
        if v.events_pending() {
            match self.raw.try_drain_events() {
                Ok(mut e) => self.events.append(&mut e),
                Err(t) => self.traps.push(t),
            }
        }
    }

    /// Send a held-back success now (before any operation other than `start`).
    fn flush(&mut self) {
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

/// The monotonic `now` the host passes the core: ns since the handle was made, never 0 (so
/// that `settle-at` and deadlines are never mistaken for "none"). Read from the CPU's
/// invariant time-stamp counter through `quanta` (calibrated against the OS clock; the OS
/// clock where there is no such counter): two readings per call, each about half the cost of
/// `Instant::now` on this hardware. Timers use tokio's own clock ([`Clock::instant`]).
struct Clock {
    source: quanta::Clock,
    origin: quanta::Instant,
}

impl Clock {
    fn new() -> Self {
        let source = quanta::Clock::new();
        let origin = source.now();
        Clock { source, origin }
    }

    #[inline]
    fn now(&self) -> u64 {
        (self.source.now().saturating_duration_since(self.origin).as_nanos() as u64).saturating_add(1)
    }

    /// The tokio instant of a reading of [`Clock::now`] (by the time still to go, so that the
    /// two clocks need not share an origin).
    fn instant(&self, at: u64) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_nanos(at.saturating_sub(self.now()))
    }
}

struct Shared {
    core: Mutex<Core>,
    held: HeldSlot,
    clock: Clock,
    traps: AtomicU64,
    fallbacks: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
    trace: Option<TraceFn>,
    listener: Option<ListenFn>,
}

impl Shared {
    #[inline]
    fn step(&self, op: &'static str, now: u64, call: u64, policy: &str, outcome: Option<&Outcome>, verdict: Option<Verdict>) {
        if let Some(t) = &self.trace {
            t(&Step { op, now, call, policy, outcome, verdict });
        }
    }

    /// The engine, with any success left in the slot moved in to be settled first.
    #[inline]
    fn lock(&self) -> MutexGuard<'_, Core> {
        let mut core = self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(h) = self.held.take() {
            core.hold(h);
        }
        core
    }

    /// Hold back the report of a success (its answer is always `done`) for the next `start`.
    #[inline]
    fn hold(&self, h: Held) {
        if !self.held.put(h) {
            // Another success is in the slot (or being written): settle through the lock.
            self.lock().hold(h);
        }
    }

    #[inline]
    fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Emit what a locked section collected (outside the lock).
    fn emit(&self, events: Vec<Event>, traps: Vec<Trap>, names: &dyn Fn(u32) -> String) {
        for t in &traps {
            self.traps.fetch_add(1, Ordering::Relaxed);
            events::trap(t, "");
        }
        for e in &events {
            let name = names(e.policy);
            events::emit(e, &name);
            if let Some(l) = &self.listener {
                l(e, &name);
            }
        }
    }
}

/// Builds a [`Levee`] handle.
#[derive(Clone, Default)]
pub struct Builder {
    seed: Option<u64>,
    backend: Option<Backend>,
    limits: Option<Limits>,
    trace: Option<TraceFn>,
    listener: Option<ListenFn>,
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field("seed", &self.seed)
            .field("backend", &self.backend)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Builder {
    /// Fix the jitter seed (default: drawn from the OS).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Choose the backend (default [`Backend::DEFAULT`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Bounds on the guest (epoch deadlines, memory, snapshot interval).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = Some(limits);
        self
    }

    /// Call `f` at every step of the protocol (for demos and debugging; it runs on the
    /// calling task, outside the engine lock).
    pub fn trace(mut self, f: impl Fn(&Step<'_>) + Send + Sync + 'static) -> Self {
        self.trace = Some(Arc::new(f));
        self
    }

    /// Call `f` with every engine event and its policy's name (besides `tracing` and `metrics`).
    pub fn on_event(mut self, f: impl Fn(&Event, &str) + Send + Sync + 'static) -> Self {
        self.listener = Some(Arc::new(f));
        self
    }

    /// Load a policy document (YAML or JSON).
    pub fn load(self, document: &str) -> Result<Levee, LoadErrors> {
        let seed = self.seed.unwrap_or_else(os_seed);
        let mut raw =
            RawEngine::load_with(self.backend.unwrap_or_default(), document, seed, self.limits.unwrap_or_default()).map_err(LoadErrors)?;
        let policies = Policies::read(&mut raw).map_err(|t| LoadErrors(vec![LoadError::new("", t.to_string())]))?;
        // The first snapshot: a trap before any state change restores to this.
        let _ = raw.checkpoint();
        let core = Core { raw, next_call: 1, held: None, policies, events: Vec::new(), traps: Vec::new() };
        Ok(Levee {
            shared: Arc::new(Shared {
                core: Mutex::new(core),
                held: HeldSlot::new(),
                clock: Clock::new(),
                traps: AtomicU64::new(0),
                fallbacks: Mutex::new(HashMap::new()),
                trace: self.trace,
                listener: self.listener,
            }),
        })
    }

    /// Load a policy file.
    pub fn load_file(self, path: impl AsRef<Path>) -> Result<Levee, LoadErrors> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| LoadErrors(vec![LoadError::new("", format!("reading {}: {e}", path.display()))]))?;
        self.load(&text)
    }
}

fn os_seed() -> u64 {
    // `RandomState` keys come from the OS random source.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

fn wall_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The Levee handle: a policy document loaded into one engine that every task shares.
/// Cheap to clone, `Send + Sync`.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let levee = levee::Levee::from_str("policies:\n  api:\n    attempts: 3\n    attempt-timeout: 2s\n")?;
/// let body: Result<String, _> = levee
///     .call("api")
///     .run(|_attempt| async { Ok::<_, std::io::Error>("hello".to_string()) })
///     .await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Levee {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Levee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = self.shared.lock();
        f.debug_struct("Levee").field("backend", &core.raw.backend()).field("policies", &core.policies.len()).finish()
    }
}

impl Levee {
    /// A builder (seed, backend, limits).
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Load a document with the defaults.
    #[allow(clippy::should_implement_trait)]
    pub fn from_str(document: &str) -> Result<Levee, LoadErrors> {
        Builder::default().load(document)
    }

    /// Load a policy file with the defaults.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Levee, LoadErrors> {
        Builder::default().load_file(path)
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.shared.lock().raw.backend()
    }

    /// Names of the policies, in document order.
    pub fn policy_names(&self) -> Vec<String> {
        self.shared.lock().policies.info.iter().map(|p| p.name.clone()).collect()
    }

    /// What the host knows of a policy.
    pub fn policy_info(&self, name: &str) -> Option<PolicyInfo> {
        let core = self.shared.lock();
        core.policies.named(name).map(|(_, p)| p.clone())
    }

    /// Traps the engine recovered from.
    pub fn traps(&self) -> u64 {
        self.shared.traps.load(Ordering::Relaxed)
    }

    /// Hot reload: replace the policies keeping breaker, budget and limiter state (the WIT
    /// `reload`). On error nothing changes.
    pub fn reload(&self, document: &str) -> Result<(), LoadErrors> {
        let mut core = self.shared.lock();
        core.flush();
        let r = match core.raw.try_reload(document) {
            Ok(Ok(())) => match Policies::read(&mut core.raw) {
                Ok(p) => {
                    core.policies = p;
                    Ok(())
                }
                Err(t) => Err(LoadErrors(vec![LoadError::new("", t.to_string())])),
            },
            Ok(Err(e)) => Err(LoadErrors(e)),
            Err(t) => Err(LoadErrors(vec![LoadError::new("", t.to_string())])),
        };
        self.finish_locked(core);
        r
    }

    /// Hot reload from a file.
    pub fn reload_file(&self, path: impl AsRef<Path>) -> Result<(), LoadErrors> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| LoadErrors(vec![LoadError::new("", format!("reading {}: {e}", path.display()))]))?;
        self.reload(&text)
    }

    /// Watch a policy file: every `every`, reload it when its contents changed. Errors are
    /// logged (target `levee`) and the running policies stay. Stops when the returned task is
    /// aborted or every other clone of the handle is dropped.
    pub fn watch_file(&self, path: impl AsRef<Path>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.shared);
        let path = path.as_ref().to_path_buf();
        // What is on disk now is what runs (or the caller loaded); changes from here on reload.
        let mut last = std::fs::read(&path).ok();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(shared) = weak.upgrade() else { return };
                let now = std::fs::read(&path).ok();
                if now.is_some() && now != last {
                    let text = String::from_utf8_lossy(now.as_deref().unwrap_or_default()).into_owned();
                    match (Levee { shared }).reload(&text) {
                        Ok(()) => tracing::info!(target: "levee", path = %path.display(), "policy document reloaded"),
                        Err(e) => tracing::error!(target: "levee", path = %path.display(), error = %e, "policy document not reloaded"),
                    }
                    last = now;
                }
            }
        })
    }

    /// Breaker state of a policy and key (`None`: no such policy, or it has no breaker).
    pub fn breaker_state(&self, policy: &str, key: &str) -> Option<BreakerState> {
        let now = self.shared.now();
        let mut core = self.shared.lock();
        core.flush();
        let index = core.policies.index(policy)?;
        let r = core.raw.try_breaker_state(index, key, now);
        self.finish_locked(core);
        r.ok().flatten()
    }

    /// Force a breaker state (an operator's switch).
    pub fn set_breaker_state(&self, policy: &str, key: &str, state: BreakerState) -> Result<(), String> {
        let now = self.shared.now();
        let mut core = self.shared.lock();
        core.flush();
        let Some(index) = core.policies.index(policy) else {
            let known = core.policies.info.iter().map(|p| p.name.clone()).collect();
            return Err(crate::UnknownPolicy::new(policy, known).to_string());
        };
        let r = core.raw.try_set_breaker_state(index, key, state, now).unwrap_or_else(|t| Err(t.to_string()));
        self.finish_locked(core);
        r
    }

    /// Export the engine state (breakers, budgets, limiters) as versioned bytes.
    pub fn export_state(&self) -> Vec<u8> {
        let mut core = self.shared.lock();
        core.flush();
        let r = core.raw.try_export_state().unwrap_or_default();
        self.finish_locked(core);
        r
    }

    /// Import state exported by [`Levee::export_state`] (of this or another process).
    pub fn import_state(&self, bytes: &[u8]) -> Result<(), LoadError> {
        let mut core = self.shared.lock();
        core.flush();
        let r = core.raw.try_import_state(bytes).unwrap_or_else(|t| Err(LoadError::new("", t.to_string())));
        self.finish_locked(core);
        r
    }

    /// Run `f` with the locked raw engine (after sending any held-back success). For tests
    /// and tools; a long `f` blocks every call.
    pub fn with_raw<R>(&self, f: impl FnOnce(&mut RawEngine) -> R) -> R {
        let mut core = self.shared.lock();
        core.flush();
        let r = f(&mut core.raw);
        self.finish_locked(core);
        r
    }

    /// Register a fallback by name for calls returning `Result<T, E>` (a call's own
    /// [`Call::fallback`] wins over this).
    pub fn register_fallback<T, E, F, Fut>(&self, name: &str, f: F)
    where
        T: 'static,
        E: 'static,
        F: Fn(FallbackContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let boxed: FallbackFn<T, E> = Arc::new(move |ctx| -> BoxFuture<'static, Result<T, E>> { Box::pin(f(ctx)) });
        let any: Arc<dyn Any + Send + Sync> = Arc::new(boxed);
        self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), any);
    }

    pub(crate) fn registered_fallback<T: 'static, E: 'static>(&self, name: &str) -> Option<FallbackFn<T, E>> {
        let map = self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner());
        map.get(name).and_then(|a| a.downcast_ref::<FallbackFn<T, E>>()).cloned()
    }

    /// Unlock, then emit the events and traps collected.
    fn finish_locked(&self, core: MutexGuard<'_, Core>) {
        drop(self.unlock(core));
    }

    /// Unlock; the events and traps collected are emitted when the result is dropped (so
    /// that a trace hook sees a step before the events it caused).
    #[inline]
    fn unlock(&self, mut core: MutexGuard<'_, Core>) -> Option<Pending<'_>> {
        if core.events.is_empty() && core.traps.is_empty() {
            drop(core);
            return None;
        }
        let (events, traps) = core.take_events();
        let names = if events.is_empty() { Vec::new() } else { core.policies.info.iter().map(|p| p.name.clone()).collect() };
        drop(core);
        Some(Pending { levee: self, events, traps, names })
    }

    /// Start describing a call under a named policy.
    pub fn call<'a, T, E>(&'a self, policy: &'a str) -> Call<'a, T, E> {
        Call { levee: self, policy, key: String::new(), flags: 0, fallbacks: Vec::new() }
    }

    /// Run `f` under a named policy; `Ok` is a success, an `Err` is described by
    /// [`IntoOutcome`].
    pub async fn run<T, E, F, Fut>(&self, policy: &str, f: F) -> Result<T, LeveeError<E>>
    where
        T: 'static,
        E: IntoOutcome + 'static,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call(policy).run(f).await
    }
}

/// What a running call needs of its policy (copied at `start`: no allocation, no shared count).
#[derive(Clone, Copy)]
struct PolicyLimits {
    max_attempts: u32,
    attempt_timeout: u64,
    deadline: u64,
}

impl PolicyLimits {
    fn of(p: &PolicyInfo) -> Self {
        PolicyLimits { max_attempts: p.max_attempts, attempt_timeout: p.attempt_timeout, deadline: p.deadline }
    }
}

pin_project_lite::pin_project! {
    /// An attempt under its timeout. The attempt is polled first and the timer is made only
    /// when it does not finish at once, so that an attempt that completes on its first poll (a
    /// cache hit, a ready future) costs no timer registration; `None` when the timeout fired.
    struct AttemptTimeout<'c, F> {
        #[pin]
        attempt: F,
        clock: &'c Clock,
        // A reading of `clock`.
        deadline: u64,
        timer: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<'c, F> AttemptTimeout<'c, F> {
    fn new(attempt: F, clock: &'c Clock, deadline: u64) -> Self {
        AttemptTimeout { attempt, clock, deadline, timer: None }
    }
}

impl<F: Future> Future for AttemptTimeout<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        if let std::task::Poll::Ready(v) = this.attempt.poll(cx) {
            return std::task::Poll::Ready(Some(v));
        }
        let (clock, deadline) = (*this.clock, *this.deadline);
        let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(clock.instant(deadline))));
        timer.as_mut().poll(cx).map(|()| None)
    }
}

/// Events and traps to emit once the lock is released.
struct Pending<'a> {
    levee: &'a Levee,
    events: Vec<Event>,
    traps: Vec<Trap>,
    names: Vec<String>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.events.is_empty() && self.traps.is_empty() {
            return;
        }
        let names = std::mem::take(&mut self.names);
        self.levee.shared.emit(std::mem::take(&mut self.events), std::mem::take(&mut self.traps), &|i| {
            names.get(i as usize).cloned().unwrap_or_default()
        });
    }
}

/// A call being described: policy, key, flags and fallbacks; then [`Call::run`].
pub struct Call<'a, T, E> {
    levee: &'a Levee,
    policy: &'a str,
    key: String,
    flags: u32,
    fallbacks: Vec<(String, FallbackFn<T, E>)>,
}

/// What an attempt left behind.
enum Last<T, E> {
    None,
    Value(T),
    Error(E),
}

impl<T, E> Last<T, E> {
    fn take_error(&mut self) -> Option<E> {
        match std::mem::replace(self, Last::None) {
            Last::Error(e) => Some(e),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// Cancels the call in the engine when the future running it is dropped mid-way.
struct Guard<'a> {
    levee: &'a Levee,
    call: u64,
    live: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.live {
            let now = self.levee.shared.now();
            let mut core = self.levee.shared.lock();
            core.flush();
            if let Err(t) = core.raw.try_cancel(self.call, now) {
                core.traps.push(t);
            }
            self.levee.finish_locked(core);
        }
    }
}

fn nanos(d: u64) -> Duration {
    Duration::from_nanos(d)
}

impl<'a, T: 'static, E: 'static> Call<'a, T, E> {
    /// The key (say, the downstream host) whose breaker, limiter and budget apply.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// Raw `start` flags (see the WIT): bit 0 not idempotent, bit 1 has an idempotency key,
    /// bits 8-11 the HTTP method.
    pub fn flags(mut self, flags: u32) -> Self {
        self.flags = flags;
        self
    }

    /// Mark the operation as not idempotent: the core then never retries it (unless
    /// [`Call::idempotency_key`] is set).
    pub fn non_idempotent(mut self) -> Self {
        self.flags |= 1;
        self
    }

    /// The operation carries an idempotency key: retrying is safe.
    pub fn idempotency_key(mut self) -> Self {
        self.flags |= 2;
        self
    }

    /// The HTTP method (its idempotence is the policy's `idempotent-methods`).
    #[cfg(feature = "http")]
    pub fn method(mut self, method: &http::Method) -> Self {
        self.flags = (self.flags & !0xF00) | crate::outcome::method_flags(method);
        self
    }

    /// A fallback for this call, by the name the policy's fallback chain uses.
    pub fn fallback<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(FallbackContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let boxed: FallbackFn<T, E> = Arc::new(move |ctx| -> BoxFuture<'static, Result<T, E>> { Box::pin(f(ctx)) });
        self.fallbacks.push((name.to_string(), boxed));
        self
    }

    /// Run `f` under the policy; `Ok` is a success, an `Err` is described by [`IntoOutcome`].
    pub async fn run<F, Fut>(self, f: F) -> Result<T, LeveeError<E>>
    where
        E: IntoOutcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_classified(
            |r: &Result<T, E>| match r {
                Ok(_) => Outcome::Success,
                Err(e) => e.outcome(),
            },
            f,
        )
        .await
    }

    /// Run `f` under the policy, describing each result with `classify`. A value that
    /// `classify` calls a failure (say, a 503 response) is retried as the policy says; when
    /// the policy stops, the last such value is returned as `Ok`, as an HTTP client returns
    /// an error status, unless a fallback replaces it.
    pub async fn run_classified<C, F, Fut>(self, classify: C, mut f: F) -> Result<T, LeveeError<E>>
    where
        C: Fn(&Result<T, E>) -> Outcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let shared = &self.levee.shared;
        let started = shared.now();

        // Start (settling a held-back success first), in one guest call.
        let (call, limits, first, pending) = {
            let mut core = shared.lock();
            let limits = core.policies.named(self.policy).map(|(i, p)| (i, PolicyLimits::of(p)));
            let Some((index, limits)) = limits else {
                let mut err = LeveeError::new(Reason::None, self.policy);
                err.invalid = Some(InvalidCode::UnknownPolicy);
                err.known_policies = core.policies.info.iter().map(|p| p.name.clone()).collect();
                drop(core);
                return Err(err);
            };
            let call = core.next_call;
            core.next_call = call.wrapping_add(1).max(1);
            let held = core.held.take();
            let (sc, sa, se) = held.map(|h| (h.call, h.at, h.elapsed)).unwrap_or((0, 0, 0));
            let r = core.raw.try_start(call, index, &self.key, self.flags, started, sc, sa, se);
            if let Ok(v) = r {
                core.note(v);
            }
            (call, limits, r, self.levee.unlock(core))
        };
        let deadline = (limits.deadline > 0).then(|| started.saturating_add(limits.deadline));
        let mut guard = Guard { levee: self.levee, call, live: true };
        let mut attempts: u32 = 0;
        let mut last: Last<T, E> = Last::None;
        let mut fallbacks = self.fallbacks;
        let mut fallback_err: Option<E> = None;
        // Fallbacks the chain named that nobody registered: they fail, and the error says so.
        let mut unregistered: Vec<String> = Vec::new();

        let mut verdict = match first {
            Ok(v) => {
                shared.step("start", started, call, self.policy, None, Some(v));
                drop(pending);
                v
            }
            Err(trap) => {
                guard.live = false;
                drop(pending);
                shared.traps.fetch_add(1, Ordering::Relaxed);
                events::trap(&trap, self.policy);
                return degraded(limits.attempt_timeout, deadline, shared.now(), call, 0, self.policy, Some(trap), &mut f).await;
            }
        };
        loop {
            if is_trapped(verdict) {
                // Only the plain methods answer TRAPPED; the try_ ones used here do not.
                verdict = Verdict::invalid(InvalidCode::UnknownCall);
            }
            let kind = verdict.kind().unwrap_or(VerdictKind::Invalid);
            match kind {
                VerdictKind::Attempt => {
                    attempts = attempts.saturating_add(1);
                    if attempts > limits.max_attempts {
                        // The guest asked for more attempts than the policy allows: stop.
                        guard.live = false;
                        self.levee.cancel_now(call);
                        return finish_fail(Reason::RetriesExhausted, 0, self.policy, attempts - 1, last, fallback_err);
                    }
                    // The first attempt begins at `start`'s clock reading: two readings per call
                    // that succeeds first time.
                    let begin = if attempts == 1 { started } else { shared.now() };
                    let timeout = clamp_timeout(verdict.payload(), deadline, begin);
                    let attempt = Attempt { number: attempts, timeout: timeout.map(nanos), call };
                    let result = match timeout {
                        // Counted from the reading already taken; the timer is made only if
                        // the attempt does not finish on its first poll.
                        Some(t) => AttemptTimeout::new(f(attempt), &shared.clock, begin.saturating_add(t)).await,
                        None => Some(f(attempt).await),
                    };
                    let now = shared.now();
                    let elapsed = now.saturating_sub(begin);
                    let outcome = match &result {
                        None => Outcome::Timeout,
                        Some(r) => classify(r),
                    };
                    if outcome.is_plain_success() {
                        // The answer to a success is always `done`: hold the report back; the
                        // next `start` settles it (one guest call per successful call).
                        if let Some(Ok(v)) = result {
                            guard.live = false;
                            shared.hold(Held { call, at: now, elapsed });
                            shared.step("hold-success", now, call, self.policy, Some(&outcome), None);
                            return Ok(v);
                        }
                    }
                    last = match result {
                        None => Last::None,
                        Some(Ok(v)) => Last::Value(v),
                        Some(Err(e)) => Last::Error(e),
                    };
                    let (k, code, text, flags) = outcome.parts();
                    let wall = if k == OutcomeKind::HttpStatus && !text.is_empty() { wall_secs() } else { 0 };
                    let (r, pending) = {
                        let mut core = shared.lock();
                        core.flush();
                        let r = core.raw.try_report(call, now, elapsed, k, code, text, wall, flags);
                        if let Ok(v) = r {
                            core.note(v);
                        }
                        (r, self.levee.unlock(core))
                    };
                    match r {
                        Ok(v) => {
                            shared.step("report", now, call, self.policy, Some(&outcome), Some(v));
                            drop(pending);
                            verdict = v;
                        }
                        Err(trap) => {
                            guard.live = false;
                            drop(pending);
                            shared.traps.fetch_add(1, Ordering::Relaxed);
                            events::trap(&trap, self.policy);
                            return lost(last, self.policy, attempts, Some(trap));
                        }
                    }
                }
                VerdictKind::Wait | VerdictKind::Retry => {
                    let now = shared.now();
                    let Some(delay) = clamp_delay(verdict.payload(), deadline, now) else {
                        // A delay that would end past the deadline: the guest was wrong; stop.
                        guard.live = false;
                        self.levee.cancel_now(call);
                        return finish_fail(Reason::Deadline, 0, self.policy, attempts, last, fallback_err);
                    };
                    if kind == VerdictKind::Retry {
                        if let Last::Value(_) = last {
                            // The value is dropped: a retry replaces it.
                            last = Last::None;
                        }
                    }
                    // Sleep holding nothing: the engine released the attempt's permits.
                    tokio::time::sleep(nanos(delay)).await;
                    let now = shared.now();
                    let (r, pending) = {
                        let mut core = shared.lock();
                        core.flush();
                        let r = core.raw.try_acquire(call, now);
                        if let Ok(v) = r {
                            core.note(v);
                        }
                        (r, self.levee.unlock(core))
                    };
                    match r {
                        Ok(v) => {
                            shared.step("acquire", now, call, self.policy, None, Some(v));
                            drop(pending);
                            verdict = v;
                        }
                        Err(trap) => {
                            guard.live = false;
                            drop(pending);
                            shared.traps.fetch_add(1, Ordering::Relaxed);
                            events::trap(&trap, self.policy);
                            return degraded(limits.attempt_timeout, deadline, now, call, attempts, self.policy, Some(trap), &mut f).await;
                        }
                    }
                }
                VerdictKind::Done => {
                    // Only after a fallback succeeded (a success returns above).
                    guard.live = false;
                    return match last {
                        Last::Value(v) => Ok(v),
                        _ => {
                            let mut err = LeveeError::new(Reason::None, self.policy);
                            err.invalid = Some(InvalidCode::WrongStep);
                            err.attempts = attempts;
                            Err(err)
                        }
                    };
                }
                VerdictKind::Fallback => {
                    // The policy as the engine has it now (a reload may have changed the chain).
                    let index = verdict.payload() as usize;
                    let name = {
                        let core = shared.lock();
                        core.policies.named(self.policy).and_then(|(_, p)| p.fallbacks.get(index)).cloned().unwrap_or_default()
                    };
                    let ctx = FallbackContext { policy: self.policy.to_string(), name: name.clone(), reason: verdict.reason(), attempts };
                    let fb = fallbacks
                        .iter()
                        .position(|(n, _)| *n == name)
                        .map(|i| fallbacks.swap_remove(i).1)
                        .or_else(|| self.levee.registered_fallback::<T, E>(&name));
                    let ok = match fb {
                        None => {
                            tracing::warn!(target: "levee", policy = %self.policy, fallback = %name, "no fallback registered under this name");
                            if !unregistered.contains(&name) {
                                unregistered.push(name);
                            }
                            false
                        }
                        Some(fb) => match fb(ctx).await {
                            Ok(v) => {
                                last = Last::Value(v);
                                true
                            }
                            Err(e) => {
                                fallback_err = Some(e);
                                false
                            }
                        },
                    };
                    let now = shared.now();
                    let (r, pending) = {
                        let mut core = shared.lock();
                        core.flush();
                        let r = core.raw.try_report_fallback(call, now, ok);
                        if let Ok(v) = r {
                            core.note(v);
                        }
                        (r, self.levee.unlock(core))
                    };
                    match r {
                        Ok(v) => {
                            shared.step("report-fallback", now, call, self.policy, None, Some(v));
                            drop(pending);
                            verdict = v;
                        }
                        Err(trap) => {
                            guard.live = false;
                            drop(pending);
                            shared.traps.fetch_add(1, Ordering::Relaxed);
                            events::trap(&trap, self.policy);
                            return lost(last, self.policy, attempts, Some(trap));
                        }
                    }
                }
                VerdictKind::Fail => {
                    guard.live = false;
                    return finish_fail(verdict.reason(), verdict.payload(), self.policy, attempts, last, fallback_err).map_err(|mut e| {
                        e.unregistered = unregistered;
                        e
                    });
                }
                VerdictKind::Invalid => {
                    guard.live = false;
                    let code = InvalidCode::from_index(u32::from(verdict.detail())).unwrap_or(InvalidCode::UnknownCall);
                    if code == InvalidCode::UnknownCall {
                        // Another task's trap recovery dropped this call from the engine: it
                        // proceeds as a single attempt (or ends with what it has).
                        if attempts == 0 || matches!(last, Last::None) {
                            return degraded(limits.attempt_timeout, deadline, shared.now(), call, attempts, self.policy, None, &mut f)
                                .await;
                        }
                        return lost(last, self.policy, attempts, None);
                    }
                    let mut err = LeveeError::new(Reason::None, self.policy);
                    err.invalid = Some(code);
                    err.attempts = attempts;
                    err.last = last.take_error();
                    return Err(err);
                }
            }
        }
    }
}

impl Levee {
    fn cancel_now(&self, call: u64) {
        let now = self.shared.now();
        let mut core = self.shared.lock();
        core.flush();
        if let Err(t) = core.raw.try_cancel(call, now) {
            core.traps.push(t);
        }
        self.finish_locked(core);
    }
}

/// The attempt timeout to enforce: the core's, never past the deadline.
fn clamp_timeout(payload: u64, deadline: Option<u64>, now: u64) -> Option<u64> {
    let remaining = deadline.map(|d| d.saturating_sub(now).max(1));
    match (payload, remaining) {
        (0, r) => r,
        (t, Some(r)) => Some(t.min(r)),
        (t, None) => Some(t),
    }
}

/// The delay to sleep: the core's, `None` when it would end at or past the deadline.
fn clamp_delay(payload: u64, deadline: Option<u64>, now: u64) -> Option<u64> {
    match deadline {
        Some(d) if now.saturating_add(payload) >= d => None,
        _ => Some(payload),
    }
}

fn finish_fail<T, E>(
    reason: Reason,
    hint: u64,
    policy: &str,
    attempts: u32,
    last: Last<T, E>,
    fallback_err: Option<E>,
) -> Result<T, LeveeError<E>> {
    let mut err = LeveeError::new(reason, policy);
    err.attempts = attempts;
    err.retry_after = (hint > 0).then(|| nanos(hint));
    err.fallback_error = fallback_err;
    match last {
        Last::Value(v) => Ok(v),
        Last::Error(e) => {
            err.last = Some(e);
            Err(err)
        }
        Last::None => Err(err),
    }
}

/// The engine lost the call after an attempt ran: end with what the attempt gave.
fn lost<T, E>(last: Last<T, E>, policy: &str, attempts: u32, trap: Option<Trap>) -> Result<T, LeveeError<E>> {
    let r = finish_fail(Reason::RetriesExhausted, 0, policy, attempts, last, None);
    r.map_err(|mut e| {
        e.trap = trap;
        e
    })
}

/// The engine could not decide (it trapped, or lost the call): run one attempt under the
/// policy's own timeout and deadline, without retries, and return its result.
#[allow(clippy::too_many_arguments)]
async fn degraded<T, E, F, Fut>(
    attempt_timeout: u64,
    deadline: Option<u64>,
    now: u64,
    call: u64,
    attempts: u32,
    policy: &str,
    trap: Option<Trap>,
    f: &mut F,
) -> Result<T, LeveeError<E>>
where
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let timeout = clamp_timeout(attempt_timeout, deadline, now).map(nanos);
    let attempt = Attempt { number: attempts.saturating_add(1), timeout, call };
    let result = match timeout {
        Some(d) => tokio::time::timeout(d, f(attempt)).await.ok(),
        None => Some(f(attempt).await),
    };
    let mut err = LeveeError::new(Reason::RetriesExhausted, policy);
    err.attempts = attempt.number;
    err.trap = trap;
    match result {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => {
            err.last = Some(e);
            Err(err)
        }
        None => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_and_timeouts_never_pass_the_deadline() {
        assert_eq!(clamp_delay(10, Some(100), 50), Some(10));
        assert_eq!(clamp_delay(50, Some(100), 50), None);
        assert_eq!(clamp_delay(u64::MAX, None, 50), Some(u64::MAX));
        assert_eq!(clamp_timeout(0, None, 5), None);
        assert_eq!(clamp_timeout(0, Some(100), 40), Some(60));
        assert_eq!(clamp_timeout(500, Some(100), 40), Some(60));
        assert_eq!(clamp_timeout(30, Some(100), 40), Some(30));
        assert_eq!(clamp_timeout(30, Some(100), 200), Some(1));
    }
}
