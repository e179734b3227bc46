//! The public handle: [`Levee`] (one engine shared by every task) and its [`Builder`]. Calls
//! are described and run by [`crate::Call`]; the engine behind the handle is
//! [`crate::runtime`], the protocol [`crate::driver`].

use std::any::{Any, TypeId};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use levee_core::{BreakerState, Event, LoadError, PolicyInfo};

use crate::call::{BoxFuture, Call, FallbackContext, FallbackFn, RetryFn, RetryInfo};
use crate::error::result_name;
use crate::error::{LeveeError, LoadErrors};
use crate::outcome::IntoOutcome;
use crate::raw::{Backend, Limits, RawEngine};
use crate::runtime::{Core, ListenFn, Policies, Registered, Shared, Step, TraceFn};
use crate::telemetry::{Standard, Telemetry};
use crate::time::{Clock, EngineClock};
use crate::Attempt;

/// Builds a [`Levee`] handle.
#[derive(Clone, Default)]
pub struct Builder {
    seed: Option<u64>,
    backend: Option<Backend>,
    limits: Option<Limits>,
    trace: Option<TraceFn>,
    listener: Option<ListenFn>,
    clock: Option<Arc<dyn Clock>>,
    telemetry: Option<Arc<dyn Telemetry>>,
    on_retry: Option<RetryFn>,
    retry_if: std::collections::HashMap<Box<str>, crate::call::RetryIf>,
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field("seed", &self.seed)
            .field("backend", &self.backend)
            .field("limits", &self.limits)
            .field("clock", &if self.clock.is_some() { "injected" } else { "default" })
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

    /// The clock of the engine's `now`, of the attempt timeouts and of the sleeps between
    /// attempts (default: the CPU's time-stamp counter and tokio's timers, which do not follow
    /// `tokio::time::pause`). [`crate::time::TokioClock`] follows tokio's paused time, for tests;
    /// any [`Clock`] of your own is used for all three. See [`crate::time`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Where telemetry goes (default [`crate::telemetry::Standard`]: `tracing` and the `metrics`
    /// facade, in the schema of docs/telemetry.md).
    pub fn telemetry(mut self, sink: impl Telemetry) -> Self {
        self.telemetry = Some(Arc::new(sink));
        self
    }

    /// Call `f` before the sleep of every retry of every call (tenacity's `before_sleep`); a
    /// call's own [`Call::on_retry`] runs after it. A hook that panics is reported and ignored.
    pub fn on_retry(mut self, f: impl Fn(&RetryInfo<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(f));
        self
    }

    /// Call `f` at every step of the protocol (for demos and debugging; it runs on the
    /// calling task, outside the engine lock).
    pub fn trace(mut self, f: impl Fn(&Step<'_>) + Send + Sync + 'static) -> Self {
        self.trace = Some(Arc::new(f));
        self
    }

    /// The retry predicate of `policy` (docs/hosts.md, section 9): called once per reported
    /// attempt of its calls that have no [`crate::Call::retry_if`] of their own, with the
    /// attempt's result or error; `Some(true)` asks for a retry, `Some(false)` refuses one,
    /// `None` leaves it to the policy's rules. The core places the answer in its retry
    /// ladder; a predicate that panics is reported and counts as `None`.
    pub fn retry_if(mut self, policy: &str, f: impl Fn(&crate::call::Attempted<'_>) -> Option<bool> + Send + Sync + 'static) -> Self {
        self.retry_if.insert(Box::from(policy), Arc::new(f));
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
        let clock = match self.clock {
            Some(c) => EngineClock::Injected(c),
            None => EngineClock::tsc(),
        };
        let telemetry = self.telemetry.unwrap_or_else(|| Arc::new(Standard::new()));
        Ok(Levee {
            shared: Arc::new(Shared::new(
                Core::new(raw, policies),
                clock,
                self.trace,
                self.listener,
                telemetry,
                self.on_retry,
                self.retry_if,
            )),
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
    pub(crate) shared: Arc<Shared>,
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
        self.shared.lock().policies.names()
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
        self.shared.finish_locked(core);
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

    /// Breaker state of a policy and key (`None`: no such policy, or it has no breaker, or
    /// the key is longer than a key may be, [`crate::KeyTooLong`]).
    pub fn breaker_state(&self, policy: &str, key: &str) -> Option<BreakerState> {
        crate::KeyTooLong::check(key).ok()?;
        let now = self.shared.now();
        let mut core = self.shared.lock();
        core.flush();
        let index = core.policies.index(policy)?;
        let r = core.raw.try_breaker_state(index, key, now);
        self.shared.finish_locked(core);
        r.ok().flatten()
    }

    /// Force a breaker state (an operator's switch).
    pub fn set_breaker_state(&self, policy: &str, key: &str, state: BreakerState) -> Result<(), String> {
        crate::KeyTooLong::check(key).map_err(|e| e.to_string())?;
        let now = self.shared.now();
        let mut core = self.shared.lock();
        core.flush();
        let Some(index) = core.policies.index(policy) else {
            let known = core.policies.names();
            return Err(crate::UnknownPolicy::new(policy, known).to_string());
        };
        let r = core.raw.try_set_breaker_state(index, key, state, now).unwrap_or_else(|t| Err(t.to_string()));
        self.shared.finish_locked(core);
        r
    }

    /// Export the engine state (breakers, budgets, limiters) as versioned bytes.
    pub fn export_state(&self) -> Vec<u8> {
        let mut core = self.shared.lock();
        core.flush();
        let r = core.raw.try_export_state().unwrap_or_default();
        self.shared.finish_locked(core);
        r
    }

    /// Import state exported by [`Levee::export_state`] (of this or another process).
    pub fn import_state(&self, bytes: &[u8]) -> Result<(), LoadError> {
        let mut core = self.shared.lock();
        core.flush();
        let r = core.raw.try_import_state(bytes).unwrap_or_else(|t| Err(LoadError::new("", t.to_string())));
        self.shared.finish_locked(core);
        r
    }

    /// Run `f` with the locked raw engine (after sending any held-back success). For tests
    /// and tools; a long `f` blocks every call.
    pub fn with_raw<R>(&self, f: impl FnOnce(&mut RawEngine) -> R) -> R {
        let mut core = self.shared.lock();
        core.flush();
        let r = f(&mut core.raw);
        self.shared.finish_locked(core);
        r
    }

    /// Register a fallback by name for calls returning `Result<T, E>` (a call's own
    /// [`Call::fallback`] wins over this). The registry keeps one fallback per name **and**
    /// result type: `stale` for the reqwest [`crate::client::Client`]'s
    /// `Result<reqwest::Response, reqwest::Error>` and `stale` for a tower layer's response
    /// live side by side, and registering again for the same type replaces only that one. A
    /// call of a type no registration of the name fits fails that fallback, and its error's
    /// [`LeveeError::mistyped`] names the types registered.
    pub fn register_fallback<T, E, F, Fut>(&self, name: &str, f: F)
    where
        T: 'static,
        E: 'static,
        F: Fn(FallbackContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let boxed: FallbackFn<T, E> = Arc::new(move |ctx| -> BoxFuture<'static, Result<T, E>> { Box::pin(f(ctx)) });
        let any: Arc<dyn Any + Send + Sync> = Arc::new(boxed);
        let entry = Registered { f: any, result: result_name::<T, E>() };
        self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).insert((name.to_string(), TypeId::of::<FallbackFn<T, E>>()), entry);
    }

    /// Remove the fallback registered under `name` for calls returning `Result<T, E>`; whether
    /// there was one.
    pub fn unregister_fallback<T: 'static, E: 'static>(&self, name: &str) -> bool {
        let mut map = self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(&(name.to_string(), TypeId::of::<FallbackFn<T, E>>())).is_some()
    }

    pub(crate) fn registered_fallback<T: 'static, E: 'static>(&self, name: &str) -> Option<FallbackFn<T, E>> {
        let map = self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(name.to_string(), TypeId::of::<FallbackFn<T, E>>())).and_then(|r| r.f.downcast_ref::<FallbackFn<T, E>>()).cloned()
    }

    /// The result types `name` is registered for, sorted (for the error of a call of another).
    pub(crate) fn fallback_types(&self, name: &str) -> Vec<String> {
        let map = self.shared.fallbacks.lock().unwrap_or_else(|p| p.into_inner());
        let mut types: Vec<String> = map.iter().filter(|((n, _), _)| n == name).map(|(_, r)| r.result.clone()).collect();
        types.sort();
        types
    }

    /// Start describing a call under a named policy.
    pub fn call<'a, T, E>(&'a self, policy: &'a str) -> Call<'a, T, E> {
        Call::new(self, policy)
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
