//! The call builder ([`Call`]: policy, key, flags, fallbacks) and the executor that does the
//! I/O the driver ([`crate::driver`]) asks for: it runs the attempts under their timeouts,
//! sleeps, runs the fallbacks and reports what happened, on the handle's clock.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use levee_core::{InvalidCode, OutcomeKind, Reason};

use crate::driver::{Action, Crossing, Driver};
use crate::error::LeveeError;
use crate::handle::Levee;
use crate::outcome::{IntoOutcome, Outcome};
use crate::raw::Trap;
use crate::runtime::{Held, Shared};
use crate::time::{EngineClock, Sleep};

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

    fn is_some(&self) -> bool {
        !matches!(self, Last::None)
    }
}

/// Cancels the call in the engine when the future running it is dropped mid-way.
struct Guard<'a> {
    shared: &'a Shared,
    call: u64,
    live: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.live {
            self.shared.cancel(self.call);
        }
    }
}

pin_project_lite::pin_project! {
    /// An attempt under its timeout (`deadline`, a reading of `clock`; `None`: no timeout). The
    /// attempt is polled first and the timer is made only when it does not finish at once, so
    /// that an attempt that completes on its first poll (a cache hit, a ready future) costs no
    /// timer registration; `None` when the timeout fired.
    struct AttemptTimeout<'c, F> {
        #[pin]
        attempt: F,
        clock: &'c EngineClock,
        deadline: Option<u64>,
        timer: Option<Sleep>,
    }
}

impl<'c, F> AttemptTimeout<'c, F> {
    /// `f` under `timeout` ns counted from `begin`, a reading of `clock` already taken.
    #[inline]
    fn new(attempt: F, clock: &'c EngineClock, begin: u64, timeout: Option<u64>) -> Self {
        AttemptTimeout { attempt, clock, deadline: timeout.map(|t| begin.saturating_add(t)), timer: None }
    }
}

impl<F: Future> Future for AttemptTimeout<'_, F> {
    type Output = Option<F::Output>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        if let std::task::Poll::Ready(v) = this.attempt.poll(cx) {
            return std::task::Poll::Ready(Some(v));
        }
        let Some(deadline) = *this.deadline else { return std::task::Poll::Pending };
        let clock = *this.clock;
        let timer = this.timer.get_or_insert_with(|| clock.sleep_until(deadline));
        timer.as_mut().poll(cx).map(|()| None)
    }
}

fn nanos(d: u64) -> Duration {
    Duration::from_nanos(d)
}

impl<'a, T, E> Call<'a, T, E> {
    pub(crate) fn new(levee: &'a Levee, policy: &'a str) -> Self {
        Call { levee, policy, key: String::new(), flags: 0, fallbacks: Vec::new() }
    }
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
        let shared = &*self.levee.shared;
        let policy = self.policy;
        let started = shared.now();

        // Start (settling a held-back success first), in one guest call.
        let s = match shared.start(policy, &self.key, self.flags, started) {
            Ok(s) => s,
            Err(known) => {
                let mut err = LeveeError::new(Reason::None, policy);
                err.invalid = Some(InvalidCode::UnknownPolicy);
                err.known_policies = known;
                return Err(err);
            }
        };
        let call = s.call;
        let mut driver = Driver::new(s.limits, started);
        let mut guard = Guard { shared, call, live: true };
        let mut last: Last<T, E> = Last::None;
        let mut fallbacks = self.fallbacks;
        let mut fallback_err: Option<E> = None;
        // Fallbacks the chain named that nobody registered: they fail, and the error says so.
        let mut unregistered: Vec<String> = Vec::new();
        // The trap that ended the protocol, if one did.
        let mut trap: Option<Trap> = None;

        let mut action = match s.verdict {
            Ok(v) => {
                shared.step("start", started, call, policy, None, Some(v));
                drop(s.pending);
                driver.next(v, started, false)
            }
            Err(t) => {
                drop(s.pending);
                shared.trapped(&t, policy);
                trap = Some(t);
                driver.trapped(Crossing::Start, shared.now())
            }
        };
        loop {
            match action {
                Action::Attempt { number, begin, timeout } => {
                    let attempt = Attempt { number, timeout: timeout.map(nanos), call };
                    let result = AttemptTimeout::new(f(attempt), &shared.clock, begin, timeout).await;
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
                            shared.step("hold-success", now, call, policy, Some(&outcome), None);
                            return Ok(v);
                        }
                    }
                    last = match result {
                        None => Last::None,
                        Some(Ok(v)) => Last::Value(v),
                        Some(Err(e)) => Last::Error(e),
                    };
                    let (k, code, text, flags) = outcome.parts();
                    let wall = if k == OutcomeKind::HttpStatus && !text.is_empty() { shared.clock.unix_seconds() } else { 0 };
                    let (r, pending) = shared.cross(|raw| raw.try_report(call, now, elapsed, k, code, text, wall, flags));
                    action = match r {
                        Ok(v) => {
                            shared.step("report", now, call, policy, Some(&outcome), Some(v));
                            drop(pending);
                            driver.next(v, now, last.is_some())
                        }
                        Err(t) => {
                            drop(pending);
                            shared.trapped(&t, policy);
                            trap = Some(t);
                            driver.trapped(Crossing::Report, now)
                        }
                    };
                }
                Action::Sleep { until, retry } => {
                    if retry {
                        if let Last::Value(_) = last {
                            // The value is dropped: a retry replaces it.
                            last = Last::None;
                        }
                    }
                    // Sleep holding nothing: the engine released the attempt's permits.
                    shared.clock.sleep_until(until).await;
                    let now = shared.now();
                    let (r, pending) = shared.cross(|raw| raw.try_acquire(call, now));
                    action = match r {
                        Ok(v) => {
                            shared.step("acquire", now, call, policy, None, Some(v));
                            drop(pending);
                            driver.next(v, now, last.is_some())
                        }
                        Err(t) => {
                            drop(pending);
                            shared.trapped(&t, policy);
                            trap = Some(t);
                            driver.trapped(Crossing::Acquire, now)
                        }
                    };
                }
                Action::Fallback { index, reason } => {
                    // The policy as the engine has it now (a reload may have changed the chain).
                    let name = {
                        let core = shared.lock();
                        core.policies.named(policy).and_then(|(_, p)| p.fallbacks.get(index as usize)).cloned().unwrap_or_default()
                    };
                    let ctx = FallbackContext { policy: policy.to_string(), name: name.clone(), reason, attempts: driver.attempts() };
                    let fb = fallbacks
                        .iter()
                        .position(|(n, _)| *n == name)
                        .map(|i| fallbacks.swap_remove(i).1)
                        .or_else(|| self.levee.registered_fallback::<T, E>(&name));
                    let ok = match fb {
                        None => {
                            tracing::warn!(target: "levee", policy = %policy, fallback = %name, "no fallback registered under this name");
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
                    let (r, pending) = shared.cross(|raw| raw.try_report_fallback(call, now, ok));
                    action = match r {
                        Ok(v) => {
                            shared.step("report-fallback", now, call, policy, None, Some(v));
                            drop(pending);
                            driver.next(v, now, last.is_some())
                        }
                        Err(t) => {
                            drop(pending);
                            shared.trapped(&t, policy);
                            trap = Some(t);
                            driver.trapped(Crossing::ReportFallback, now)
                        }
                    };
                }
                Action::Done => {
                    // Only after a fallback succeeded (a success returns above).
                    guard.live = false;
                    return match last {
                        Last::Value(v) => Ok(v),
                        _ => {
                            let mut err = LeveeError::new(Reason::None, policy);
                            err.invalid = Some(InvalidCode::WrongStep);
                            err.attempts = driver.attempts();
                            Err(err)
                        }
                    };
                }
                Action::Fail { reason, hint } => {
                    guard.live = false;
                    return finish_fail(reason, hint, policy, driver.attempts(), last, fallback_err).map_err(|mut e| {
                        e.unregistered = unregistered;
                        e
                    });
                }
                Action::Abort { reason } => {
                    guard.live = false;
                    shared.cancel(call);
                    return finish_fail(reason, 0, policy, driver.attempts(), last, fallback_err);
                }
                Action::Degraded { number, timeout } => {
                    guard.live = false;
                    let attempt = Attempt { number, timeout: timeout.map(nanos), call };
                    let begin = shared.now();
                    let result = AttemptTimeout::new(f(attempt), &shared.clock, begin, timeout).await;
                    let mut err = LeveeError::new(Reason::RetriesExhausted, policy);
                    err.attempts = number;
                    err.trap = trap;
                    return match result {
                        Some(Ok(v)) => Ok(v),
                        Some(Err(e)) => {
                            err.last = Some(e);
                            Err(err)
                        }
                        None => Err(err),
                    };
                }
                Action::Lost => {
                    guard.live = false;
                    return finish_fail(Reason::RetriesExhausted, 0, policy, driver.attempts(), last, None).map_err(|mut e| {
                        e.trap = trap;
                        e
                    });
                }
                Action::Invalid(code) => {
                    guard.live = false;
                    let mut err = LeveeError::new(Reason::None, policy);
                    err.invalid = Some(code);
                    err.attempts = driver.attempts();
                    err.last = last.take_error();
                    return Err(err);
                }
            }
        }
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
