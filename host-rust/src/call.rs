//! The call builder ([`Call`]: policy, key, flags, fallbacks) and the executor that does the
//! I/O the driver ([`crate::driver`]) asks for: it runs the attempts under their timeouts,
//! sleeps, runs the fallbacks and reports what happened, on the handle's clock.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use levee_core::{HedgeCommand, InvalidCode, OutcomeKind, Reason};
use tracing::Instrument;

use crate::driver::{Action, Crossing, Driver, Recovery};
use crate::error::LeveeError;
use crate::handle::Levee;
use crate::outcome::{IntoOutcome, Outcome};
use crate::park::Parker;
use crate::raw::Trap;
use crate::runtime::{crossing, deliver, Held, Injected, Shared, Started};
use crate::telemetry;
use crate::time::{EngineClock, Timer};

/// The outcome of an attempt's result when its error describes itself: `Ok` is a success (what
/// `run` means, as opposed to `run_classified`).
pub(crate) fn of_result<T, E: IntoOutcome>(r: &Result<T, E>) -> Outcome {
    match r {
        Ok(_) => Outcome::Success,
        Err(e) => e.outcome(),
    }
}

/// What the `on_retry` hooks learn before the sleep of a retry (docs/telemetry.md, "The
/// retry hook").
#[derive(Clone, Debug)]
pub struct RetryInfo<'a> {
    /// The policy.
    pub policy: &'a str,
    /// The call's key (`""` for none).
    pub key: &'a str,
    /// The attempt that failed (1 for the first).
    pub attempt: u32,
    /// The sleep about to start.
    pub delay: Duration,
    /// What the failed attempt gave: its error's outcome, or the response's (`Outcome::Http`).
    pub outcome: &'a Outcome,
    /// `none` for a retry.
    pub reason: Reason,
}

/// What a retry predicate is given (docs/hosts.md, section 9): the attempt's result or error,
/// and the outcome the host reports for it.
#[derive(Clone, Copy)]
pub struct Attempted<'a> {
    outcome: &'a Outcome,
    value: Option<&'a dyn std::any::Any>,
    error: Option<&'a dyn std::any::Any>,
}

impl<'a> Attempted<'a> {
    /// What the host reports for the attempt (`Outcome::Timeout` when it timed out).
    pub fn outcome(&self) -> &'a Outcome {
        self.outcome
    }

    /// The value the attempt returned (an HTTP integration's: the response), as a `T`.
    pub fn value<T: 'static>(&self) -> Option<&'a T> {
        self.value.and_then(|v| v.downcast_ref())
    }

    /// The error the attempt returned, as an `E`.
    pub fn error<E: 'static>(&self) -> Option<&'a E> {
        self.error.and_then(|e| e.downcast_ref())
    }

    /// The attempt's timeout fired: it has neither value nor error.
    pub fn timed_out(&self) -> bool {
        self.value.is_none() && self.error.is_none()
    }
}

impl std::fmt::Debug for Attempted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempted").field("outcome", &self.outcome).field("value", &self.value.is_some()).finish_non_exhaustive()
    }
}

/// A retry predicate: `Some(true)` retry, `Some(false)` do not retry, `None` the policy decides.
pub type RetryIf = Arc<dyn Fn(&Attempted<'_>) -> Option<bool> + Send + Sync>;

/// Ask the retry predicate (if any) about an attempt that ended with `result` (`None`: its
/// timeout fired); its answer as `report` flags.
#[inline]
pub(crate) fn asked<T: 'static, E: 'static>(pred: Option<&RetryIf>, result: &Option<Result<T, E>>, outcome: &Outcome, policy: &str) -> u32 {
    let Some(p) = pred else { return 0 };
    let (value, error): (Option<&dyn std::any::Any>, Option<&dyn std::any::Any>) = match result {
        None => (None, None),
        Some(Ok(v)) => (Some(v), None),
        Some(Err(e)) => (None, Some(e)),
    };
    ask(p, &Attempted { outcome, value, error }, policy)
}

/// Ask `pred` about an attempt; its answer as `report` flags. A predicate that panics is
/// reported and counts as no answer.
fn ask(pred: &RetryIf, attempted: &Attempted<'_>, policy: &str) -> u32 {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pred(attempted))) {
        Ok(Some(true)) => crate::constants::REPORT_CALLER_RETRY,
        Ok(Some(false)) => crate::constants::REPORT_CALLER_NO_RETRY,
        Ok(None) => 0,
        Err(_) => {
            tracing::error!(target: "levee", policy = %policy, "a retry_if predicate panicked; counted as no answer");
            0
        }
    }
}

/// A retry hook.
pub type RetryFn = Arc<dyn Fn(&RetryInfo<'_>) + Send + Sync>;

/// A crossing of the host scenarios' fault seam ([`Call::fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    /// `start`.
    Start,
    /// `acquire`.
    Acquire,
    /// `report` (never of a success, which may be held back).
    Report,
    /// `report-fallback`.
    ReportFallback,
    /// `hedge-step` (a hedged call's; [`Call::hedge_fault`]).
    HedgeStep,
    /// `report-attempt` (a hedged call's; [`Call::hedge_fault`]).
    ReportAttempt,
}

/// Faults for the fault seam: `(crossing, nth, verdict)`, `verdict` `None` for a trap
/// ([`Call::fault`]). The tower layer reads one from a request's extensions.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan(pub Vec<(FaultOp, u32, Option<u64>)>);

/// Faults to inject into one call's crossings.
#[derive(Default)]
pub(crate) struct Faults {
    plan: Vec<(FaultOp, u32, Injected)>,
    /// A hedged call's: a trap (`None`), or the commands answered instead of the guest's.
    hedge: Vec<(FaultOp, u32, Option<Vec<HedgeCommand>>)>,
    seen: [u32; 6],
}

impl Faults {
    /// Count a crossing of `op`; which one it is.
    fn count(&mut self, op: FaultOp) -> u32 {
        let i = op as usize;
        let n = self.seen.get(i).copied().unwrap_or(0).saturating_add(1);
        if let Some(slot) = self.seen.get_mut(i) {
            *slot = n;
        }
        n
    }

    /// Count a crossing of `op`; what to inject into it.
    fn take(&mut self, op: FaultOp) -> Option<Injected> {
        let n = self.count(op);
        self.plan.iter().find(|(o, nth, _)| *o == op && *nth == n).map(|(_, _, f)| *f)
    }
}

/// Count a crossing `op` of a hedged call; what to inject into it: `Some(None)` a trap,
/// `Some(Some(commands))` an answer in place of the guest's.
pub(crate) fn take_hedge(faults: &mut Option<Box<Faults>>, op: FaultOp) -> Option<Option<Vec<HedgeCommand>>> {
    let f = faults.as_mut()?;
    let n = f.count(op);
    f.hedge.iter().find(|(o, nth, _)| *o == op && *nth == n).map(|(_, _, c)| c.clone())
}

#[inline]
fn take(faults: &mut Option<Box<Faults>>, op: FaultOp) -> Option<Injected> {
    match faults {
        None => None,
        Some(f) => f.take(op),
    }
}

/// Call the retry hooks; a hook that panics is reported and ignored.
fn run_hooks(hooks: [Option<&RetryFn>; 2], info: &RetryInfo<'_>) {
    for h in hooks.into_iter().flatten() {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(info))).is_err() {
            tracing::error!(target: "levee", policy = %info.policy, "an on_retry hook panicked; ignored");
        }
    }
}

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
    /// The degraded attempt of the recovery path (docs/hosts.md, section 3): run without the
    /// core's leave after the engine faulted.
    pub degraded: bool,
}

/// A call being described: policy, key, flags and fallbacks; then [`Call::run`].
pub struct Call<'a, T, E> {
    levee: &'a Levee,
    policy: &'a str,
    key: String,
    flags: u32,
    fallbacks: Vec<(String, FallbackFn<T, E>)>,
    on_retry: Option<RetryFn>,
    retry_if: Option<RetryIf>,
    faults: Option<Box<Faults>>,
    /// An HTTP integration's call: its attempt spans carry `http.request.resend_count`.
    http: bool,
}

/// What an attempt left behind.
pub(crate) enum Last<T, E> {
    None,
    Value(T),
    Error(E),
}

/// Cancels the call in the engine when the future running it is dropped mid-way, and counts
/// it as `cancelled`.
struct Guard<'a> {
    span: tracing::Span,
    shared: &'a Shared,
    policy: &'a str,
    call: u64,
    live: bool,
    attempts: u32,
}

impl Guard<'_> {
    /// The call ended: count it in `levee.calls`.
    #[inline]
    fn end(&mut self, result: &'static str, reason: Option<Reason>) {
        self.live = false;
        self.span.record("levee.result", result);
        if let Some(r) = reason {
            self.span.record("levee.reason", r.name());
        }
        telemetry::call(&*self.shared.telemetry, self.policy, result, self.attempts > 1, reason.map(Reason::name));
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.live {
            let _in = self.span.enter(); // the cancel's events are the call's
            self.shared.cancel(self.call);
            self.span.record("levee.result", "cancelled");
            telemetry::call(&*self.shared.telemetry, self.policy, "cancelled", self.attempts > 1, None);
        }
    }
}

pin_project_lite::pin_project! {
    /// An attempt under its timeout (`deadline`, a reading of `clock`; `None`: no timeout). The
    /// attempt is polled first and the timer is made only when it does not finish at once, so
    /// that an attempt that completes on its first poll (a cache hit, a ready future) costs no
    /// timer registration; `None` when the timeout fired.
    pub(crate) struct AttemptTimeout<'c, F> {
        #[pin]
        attempt: F,
        clock: &'c EngineClock,
        deadline: Option<u64>,
        #[pin]
        timer: Option<Timer>,
    }
}

impl<'c, F> AttemptTimeout<'c, F> {
    /// `f` under `timeout` ns counted from `begin`, a reading of `clock` already taken.
    #[inline]
    pub(crate) fn new(attempt: F, clock: &'c EngineClock, begin: u64, timeout: Option<u64>) -> Self {
        AttemptTimeout { attempt, clock, deadline: timeout.map(|t| begin.saturating_add(t)), timer: None }
    }
}

impl<F: Future> Future for AttemptTimeout<'_, F> {
    type Output = Option<F::Output>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let mut this = self.project();
        if let std::task::Poll::Ready(v) = this.attempt.poll(cx) {
            return std::task::Poll::Ready(Some(v));
        }
        let Some(deadline) = *this.deadline else { return std::task::Poll::Pending };
        if this.timer.is_none() {
            this.timer.set(Some(this.clock.timer_until(deadline)));
        }
        match this.timer.as_pin_mut() {
            Some(timer) => timer.poll(cx).map(|()| None),
            None => std::task::Poll::Pending,
        }
    }
}

/// Wait for whichever of `a` and `b` completes first.
async fn first(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    std::future::poll_fn(|cx| {
        if a.as_mut().poll(cx).is_ready() || b.as_mut().poll(cx).is_ready() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

/// The `levee.attempt` span of attempt `number` under the call's span.
pub(crate) fn attempt_span(call: &tracing::Span, number: u32, degraded: bool, http: bool) -> tracing::Span {
    let span = tracing::info_span!(target: "levee", parent: call, "levee.attempt", levee.attempt = number, levee.outcome = tracing::field::Empty, levee.degraded = tracing::field::Empty, http.request.resend_count = tracing::field::Empty);
    if degraded {
        span.record("levee.degraded", true);
    }
    if http && number > 1 {
        span.record("http.request.resend_count", number - 1);
    }
    span
}

pub(crate) fn nanos(d: u64) -> Duration {
    Duration::from_nanos(d)
}

impl<'a, T, E> Call<'a, T, E> {
    pub(crate) fn new(levee: &'a Levee, policy: &'a str) -> Self {
        Call {
            levee,
            policy,
            key: String::new(),
            flags: 0,
            fallbacks: Vec::new(),
            on_retry: None,
            retry_if: None,
            faults: None,
            http: false,
        }
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

    /// Call `f` before the sleep of each retry of this call (after the handle's
    /// [`crate::Builder::on_retry`]).
    pub fn on_retry(mut self, f: impl Fn(&RetryInfo<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(f));
        self
    }

    /// This call's retry predicate (docs/hosts.md, section 9; it wins over the policy's
    /// [`crate::Builder::retry_if`]): called once per reported attempt with its result or
    /// error; `Some(true)` asks for a retry, `Some(false)` refuses one, `None` leaves it to the
    /// policy's rules. The host only passes the answer on: the core places it in its retry
    /// ladder (a non-idempotent call, the budget, the deadline still stop a retry). A predicate
    /// that panics is reported and counts as `None`.
    pub fn retry_if(mut self, f: impl Fn(&Attempted<'_>) -> Option<bool> + Send + Sync + 'static) -> Self {
        self.retry_if = Some(Arc::new(f));
        self
    }

    /// [`Call::retry_if`] with a shared predicate (`None`: the policy's).
    #[cfg(feature = "tower")]
    pub(crate) fn retry_if_shared(mut self, f: Option<RetryIf>) -> Self {
        if f.is_some() {
            self.retry_if = f;
        }
        self
    }

    /// The fault seam of the host scenarios (conformance/hosts/README.md, "A fault"): make the
    /// `nth` crossing of `op` of this call trap (`verdict: None`), or answer the packed
    /// `verdict` instead of the core's. For tests of the recovery path only.
    pub fn fault(mut self, op: FaultOp, nth: u32, verdict: Option<u64>) -> Self {
        let inject = verdict.map_or(Injected::Trap, Injected::Verdict);
        self.faults.get_or_insert_with(Default::default).plan.push((op, nth, inject));
        self
    }

    /// Mark the call as an HTTP integration's (attempt spans get `http.request.resend_count`).
    #[cfg(feature = "http")]
    pub(crate) fn http(mut self) -> Self {
        self.http = true;
        self
    }

    /// The fault seam for a hedged call's crossings ([`FaultOp::HedgeStep`],
    /// [`FaultOp::ReportAttempt`]): make the `nth` one trap (`commands: None`), or answer
    /// `commands` instead of the guest's answer (the real crossing's events are lost). For
    /// tests of the recovery path only.
    pub fn hedge_fault(mut self, op: FaultOp, nth: u32, commands: Option<Vec<HedgeCommand>>) -> Self {
        self.faults.get_or_insert_with(Default::default).hedge.push((op, nth, commands));
        self
    }

    /// [`Call::fault`] for every entry of `plan`.
    pub fn faults(mut self, plan: &FaultPlan) -> Self {
        for (op, nth, verdict) in &plan.0 {
            self = self.fault(*op, *nth, *verdict);
        }
        self
    }

    /// Run `f` under the policy; `Ok` is a success, an `Err` is described by [`IntoOutcome`].
    ///
    /// (A plain `fn` returning [`Call::run_classified`]'s future, not an `async fn` awaiting
    /// it: an `async fn` would keep its own copy of the call in the future, for the whole call.)
    pub fn run<F, Fut>(self, f: F) -> impl Future<Output = Result<T, LeveeError<E>>> + use<'a, T, E, F, Fut>
    where
        E: IntoOutcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_classified(of_result::<T, E>, f)
    }

    /// Run `f` under the policy, describing each result with `classify`. A value that
    /// `classify` calls a failure (say, a 503 response) is retried as the policy says; when
    /// the policy stops, the last such value is returned as `Ok`, as an HTTP client returns
    /// an error status, unless a fallback replaces it.
    pub fn run_classified<C, F, Fut>(
        self,
        classify: C,
        mut f: F,
    ) -> impl Future<Output = Result<T, LeveeError<E>>> + use<'a, T, E, C, F, Fut>
    where
        C: Fn(&Result<T, E>) -> Outcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // Taken apart before the future is made, which then holds each part once (an `async fn`
        // holds its arguments for its whole life, beside whatever is moved out of them).
        let Call { levee, policy, key, flags, fallbacks, on_retry, retry_if, mut faults, http } = self;
        async move {
            let shared = &*levee.shared;
            let key = key.as_str();
            if let Err(e) = crate::error::KeyTooLong::check(key) {
                let mut err = LeveeError::new(Reason::None, policy);
                err.key_too_long = Some(e);
                return Err(err);
            }
            let started = shared.now();

            // Start (settling a held-back success first), in one guest call.
            // Taken apart at once: a part of it kept across an await would keep all of it in the future.
            // `parker`: the call's park in its bulkhead queue, if the verdict queued it.
            let Started { call, limits, verdict, pending, parker } =
                match shared.start(policy, key, flags, started, take(&mut faults, FaultOp::Start)) {
                    Ok(s) => s,
                    Err(known) => {
                        let mut err = LeveeError::new(Reason::None, policy);
                        err.invalid = Some(InvalidCode::UnknownPolicy);
                        err.known_policies = known;
                        return Err(err);
                    }
                };
            let mut driver = Driver::new(limits, started);
            // The spans of docs/telemetry.md (`tracing`; an OpenTelemetry layer exports them).
            let span = tracing::info_span!(target: "levee", "levee.call", levee.policy = policy, levee.key = key, levee.result = tracing::field::Empty, levee.reason = tracing::field::Empty);
            let mut guard = Guard { span, shared, policy, call, live: true, attempts: 0 };
            let retry_if = match retry_if {
                Some(p) => Some(p),
                None if shared.retry_if.is_empty() => None,
                None => shared.retry_if.get(policy).cloned(),
            };
            // The trap that sent the call down the recovery path, if one did.
            let mut trap: Option<Trap> = None;

            // The hot path: a first attempt whose `start` had no events. Its success is held back
            // for the next `start`; any other success is reported at once (so that the events it
            // causes, a half-open breaker closing, belong to this call).
            let hot = matches!(verdict, Ok(v) if !v.events_pending());
            let action = match verdict {
                Ok(v) => {
                    shared.step("start", started, call, policy, None, Some(v));
                    deliver(&guard.span, pending);
                    driver.next(v, started, Crossing::Start)
                }
                Err(t) => {
                    deliver(&guard.span, pending);
                    trap = Some(t);
                    driver.trapped(Crossing::Start, shared.now())
                }
            };
            // The first attempt of a hot call runs here, in a future that holds only what it needs;
            // everything else (a report, retries, sleeps, fallbacks, hedging, recovery) runs in
            // `Slow::run`, boxed when reached: a call's future is 928 bytes instead of 1,432 (the
            // load bench's; `SIZES=1` prints it), and at 10,000 calls in flight and more the bytes
            // a call keeps are what it costs (docs/performance.md, "At production load").
            // (After the await, only what `guard` holds is used: a copy in a local of its own would
            // take room in the future too.)
            let ran = match (hot, action) {
                (true, Action::Attempt { number: 1, begin, timeout }) => {
                    guard.attempts = 1;
                    let attempt = Attempt { number: 1, timeout: timeout.map(nanos), call, degraded: false };
                    let aspan = attempt_span(&guard.span, 1, false, http);
                    let result = AttemptTimeout::new(f(attempt), &shared.clock, begin, timeout).instrument(aspan.clone()).await;
                    let (shared, call) = (guard.shared, guard.call);
                    let ended = Ended::of(1, result, aspan, shared.now(), begin, timeout, &classify, retry_if.as_ref(), guard.policy);
                    match ended.hold(true, shared, &mut guard, call) {
                        Ok(v) => return Ok(v),
                        Err(ended) => Some(ended),
                    }
                }
                _ => None,
            };
            let (shared, policy, call) = (guard.shared, guard.policy, guard.call);
            let slow = Slow { levee, shared, policy, key, call, http, driver, guard, on_retry, retry_if, fallbacks, faults, parker, trap };
            // `hot` no longer: the first attempt's success, if one, was offered to the slot already.
            let hot = hot && ran.is_none();
            Box::pin(slow.run(action, ran, hot, &classify, &mut f)).await
        }
    }
}

/// An attempt that ended: its result (`None`: its timeout fired), its span, when it ended, how
/// long it took, the outcome the host reports and the retry predicate's answer (as flags).
struct Ended<T, E> {
    number: u32,
    timeout: Option<u64>,
    result: Option<Result<T, E>>,
    span: tracing::Span,
    now: u64,
    elapsed: u64,
    outcome: Outcome,
    asked: u32,
}

impl<T: 'static, E: 'static> Ended<T, E> {
    /// Describe attempt `number`, begun at `begin` under `timeout`, that ended at `now` with
    /// `result`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn of<C: Fn(&Result<T, E>) -> Outcome>(
        number: u32,
        result: Option<Result<T, E>>,
        span: tracing::Span,
        now: u64,
        begin: u64,
        timeout: Option<u64>,
        classify: &C,
        retry_if: Option<&RetryIf>,
        policy: &str,
    ) -> Self {
        // A timeout that fired reports the timeout itself as the elapsed time.
        let elapsed = match (&result, timeout) {
            (None, Some(t)) => t,
            _ => now.saturating_sub(begin),
        };
        let outcome = match &result {
            None => Outcome::Timeout,
            Some(r) => classify(r),
        };
        span.record("levee.outcome", outcome.kind_name());
        let asked = asked(retry_if, &result, &outcome, policy);
        Ended { number, timeout, result, span, now, elapsed, outcome, asked }
    }

    /// Hold back the report of a plain success of the first attempt of a `hot` call (its
    /// answer is always `done`; the next `start` settles it: one guest call per successful
    /// call) and end the call with its value; else give the attempt back, to be reported.
    /// A success the caller wants retried is reported, never held back; so is a late success
    /// (the core makes it a timeout), and one while calls wait in a bulkhead queue (it frees
    /// a slot).
    #[inline]
    fn hold(self, hot: bool, shared: &Shared, guard: &mut Guard<'_>, call: u64) -> Result<T, Self> {
        let Ended { number, timeout, result, span, now, elapsed, outcome, asked } = self;
        match result {
            Some(Ok(v))
                if hot
                    && asked & crate::constants::REPORT_CALLER_RETRY == 0
                    && number == 1
                    && outcome.is_plain_success()
                    && timeout.is_none_or(|t| elapsed < t) =>
            {
                if shared.hold(Held { call, at: now, elapsed }) {
                    shared.step("hold-success", now, call, guard.policy, Some(&outcome), None);
                    telemetry::attempt(&*shared.telemetry, guard.policy, outcome.kind_name(), elapsed);
                    guard.end("success", None);
                    return Ok(v);
                }
                Err(Ended { number, timeout, result: Some(Ok(v)), span, now, elapsed, outcome, asked })
            }
            result => Err(Ended { number, timeout, result, span, now, elapsed, outcome, asked }),
        }
    }
}

/// A call past its hot path (see [`Call::run_classified`]): what the rest of it needs.
struct Slow<'a, T, E> {
    levee: &'a Levee,
    shared: &'a Shared,
    policy: &'a str,
    key: &'a str,
    call: u64,
    http: bool,
    driver: Driver,
    guard: Guard<'a>,
    on_retry: Option<RetryFn>,
    retry_if: Option<RetryIf>,
    fallbacks: Vec<(String, FallbackFn<T, E>)>,
    faults: Option<Box<Faults>>,
    parker: Option<Parker<'a>>,
    trap: Option<Trap>,
}

impl<T: 'static, E: 'static> Slow<'_, T, E> {
    /// Carry out `action` and every step after it; `ran` is the first attempt when the hot
    /// path ran it (and did not hold its success back).
    async fn run<C, F, Fut>(
        self,
        mut action: Action,
        mut ran: Option<Ended<T, E>>,
        hot: bool,
        classify: &C,
        f: &mut F,
    ) -> Result<T, LeveeError<E>>
    where
        C: Fn(&Result<T, E>) -> Outcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let Slow {
            levee,
            shared,
            policy,
            key,
            call,
            http,
            mut driver,
            mut guard,
            on_retry,
            retry_if,
            mut fallbacks,
            mut faults,
            mut parker,
            mut trap,
        } = self;
        let mut last: Last<T, E> = Last::None;
        let mut last_outcome: Option<Outcome> = None;
        let hooks = [shared.on_retry.as_ref(), on_retry.as_ref()];
        let hooked = hooks.iter().any(Option::is_some);
        let mut fell_back = false;
        let mut fallback_err: Option<E> = None;
        // Fallbacks the chain named that nobody registered: they fail, and the error says so.
        let mut unregistered: Vec<String> = Vec::new();
        // Fallbacks the chain named that are registered for other result types only.
        let mut mistyped: Vec<crate::error::MistypedFallback> = Vec::new();
        loop {
            if !matches!(action, Action::Sleep { park: true, .. }) {
                // Not (or no longer) waiting in the queue: the park is over.
                parker = None;
            }
            match action {
                Action::Attempt { number, begin, timeout } => {
                    let ended = match ran.take() {
                        Some(ended) => ended,
                        None => {
                            guard.attempts = number;
                            let attempt = Attempt { number, timeout: timeout.map(nanos), call, degraded: false };
                            let aspan = attempt_span(&guard.span, number, false, http);
                            let result = AttemptTimeout::new(f(attempt), &shared.clock, begin, timeout).instrument(aspan.clone()).await;
                            Ended::of(number, result, aspan, shared.now(), begin, timeout, classify, retry_if.as_ref(), policy)
                        }
                    };
                    let Ended { result, span: _attempt_span, now, elapsed, outcome, asked, .. } =
                        match ended.hold(hot, shared, &mut guard, call) {
                            Ok(v) => return Ok(v),
                            Err(ended) => ended,
                        };
                    last = match result {
                        None => Last::None,
                        Some(Ok(v)) => Last::Value(v),
                        Some(Err(e)) => Last::Error(e),
                    };
                    let (k, code, text, flags) = outcome.parts();
                    let flags = flags | asked;
                    let wall = if k == OutcomeKind::HttpStatus && !text.is_empty() { shared.clock.unix_seconds() } else { 0 };
                    let inject = take(&mut faults, FaultOp::Report);
                    // The report frees the attempt's slot: the core grants it to the oldest
                    // waiter, whom the crossing wakes.
                    let (r, pending) = shared.report(|raw| {
                        crossing(raw, inject, "report", |raw| raw.try_report(call, now, elapsed, k, code, text, wall, flags))
                    });
                    action = match r {
                        Ok(v) => {
                            shared.step("report", now, call, policy, Some(&outcome), Some(v));
                            telemetry::attempt(&*shared.telemetry, policy, outcome.kind_name(), elapsed);
                            deliver(&guard.span, pending);
                            driver.next(v, now, Crossing::Report)
                        }
                        Err(t) => {
                            deliver(&guard.span, pending);
                            trap = Some(t);
                            driver.trapped(Crossing::Report, now)
                        }
                    };
                    last_outcome = Some(outcome);
                }
                Action::Hedge { begin, timeout } => {
                    let (attempts, faults, retry_if) = (&mut guard.attempts, &mut faults, retry_if.as_ref());
                    let hedging =
                        crate::hedge::Hedging { levee, shared, policy, key, call, span: &guard.span, http, retry_if, attempts, faults };
                    // Boxed, so that the hedged path's state does not grow every call's future.
                    let ended = Box::pin(crate::hedge::run(hedging, &mut driver, classify, f, begin, timeout)).await;
                    (last, last_outcome) = (ended.last, ended.outcome);
                    trap = trap.or(ended.trap);
                    action = ended.action;
                }
                Action::Sleep { until, delay, retry, park } => {
                    if retry {
                        if hooked {
                            let fallback_outcome = Outcome::Success;
                            let info = RetryInfo {
                                policy,
                                key,
                                attempt: driver.attempts(),
                                delay: nanos(delay),
                                outcome: last_outcome.as_ref().unwrap_or(&fallback_outcome),
                                reason: Reason::None,
                            };
                            run_hooks(hooks, &info);
                        }
                        if let Last::Value(_) = last {
                            // The value is dropped: a retry replaces it.
                            last = Last::None;
                        }
                    }
                    // Sleep holding nothing: the engine released the attempt's permits. A call
                    // waiting in the bulkhead queue also wakes when the core grants it a slot
                    // (it names the call: nobody else is woken).
                    if delay > 0 {
                        shared.step_sleep(call, policy, delay);
                        let timer = shared.clock.sleep_until(until);
                        match parker.as_ref() {
                            Some(p) if park => first(timer, p.woken()).await,
                            _ => timer.await,
                        }
                    }
                    let now = shared.now();
                    let inject = take(&mut faults, FaultOp::Acquire);
                    // The park lasts until this crossing has answered (a new park, if it queues
                    // the call again, is registered in it).
                    let (r, pending, parked) = shared.acquire(call, now, inject);
                    parker = parked;
                    action = match r {
                        Ok(v) => {
                            shared.step("acquire", now, call, policy, None, Some(v));
                            deliver(&guard.span, pending);
                            driver.next(v, now, Crossing::Acquire)
                        }
                        Err(t) => {
                            deliver(&guard.span, pending);
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
                        .or_else(|| levee.registered_fallback::<T, E>(&name));
                    let ok = match fb {
                        None => {
                            let types = levee.fallback_types(&name);
                            if types.is_empty() {
                                tracing::warn!(target: "levee", policy = %policy, fallback = %name, "no fallback registered under this name");
                                if !unregistered.contains(&name) {
                                    unregistered.push(name);
                                }
                            } else {
                                let m =
                                    crate::error::MistypedFallback { name, registered: types, call: crate::error::result_name::<T, E>() };
                                tracing::warn!(target: "levee", policy = %policy, "{m}");
                                if !mistyped.iter().any(|x| x.name == m.name) {
                                    mistyped.push(m);
                                }
                            }
                            false
                        }
                        Some(fb) => match fb(ctx).await {
                            Ok(v) => {
                                last = Last::Value(v);
                                fell_back = true;
                                true
                            }
                            Err(e) => {
                                fallback_err = Some(e);
                                false
                            }
                        },
                    };
                    let now = shared.now();
                    let inject = take(&mut faults, FaultOp::ReportFallback);
                    let (r, pending) =
                        shared.cross(|raw| crossing(raw, inject, "report-fallback", |raw| raw.try_report_fallback(call, now, ok)));
                    action = match r {
                        Ok(v) => {
                            shared.step("report-fallback", now, call, policy, None, Some(v));
                            deliver(&guard.span, pending);
                            driver.next(v, now, Crossing::ReportFallback)
                        }
                        Err(t) => {
                            deliver(&guard.span, pending);
                            trap = Some(t);
                            driver.trapped(Crossing::ReportFallback, now)
                        }
                    };
                }
                Action::Done => {
                    // After a fallback succeeded, or a value the policy accepted (a success
                    // that was not held back, a response).
                    return match last {
                        Last::Value(v) => {
                            guard.end(if fell_back { "fallback" } else { "success" }, None);
                            Ok(v)
                        }
                        _ => {
                            guard.end("failure", None);
                            let mut err = LeveeError::new(Reason::None, policy);
                            err.invalid = Some(InvalidCode::WrongStep);
                            err.attempts = driver.attempts();
                            Err(err)
                        }
                    };
                }
                Action::Fail { reason, hint } => {
                    guard.end("failure", Some(reason));
                    return finish_fail(reason, hint, policy, driver.attempts(), last, fallback_err).map_err(|mut e| {
                        e.unregistered = unregistered;
                        e.mistyped = mistyped;
                        e.outcome = last_outcome;
                        e
                    });
                }
                Action::Recover { fault, then } => {
                    // A hedged call reported its fault before it waited for the attempt that stands.
                    if then != Recovery::Hedged {
                        if fault == telemetry::Fault::Contract {
                            shared.reinstantiate(call);
                        }
                        let _in = guard.span.enter(); // the call's `engine-fault` event
                        shared.fault(fault, policy, key, call);
                    }
                    // The engine no longer has the call (or never will again).
                    guard.live = false;
                    let mut err = LeveeError::new(Reason::None, policy);
                    err.attempts = driver.attempts();
                    err.trap = trap;
                    err.fault = Some(fault);
                    err.outcome = last_outcome;
                    let result = match then {
                        Recovery::Attempt | Recovery::Hedged => match last {
                            Last::Value(v) => Ok(v),
                            Last::Error(e) => {
                                err.last = Some(e);
                                Err(err)
                            }
                            Last::None => {
                                // The attempt timed out: its own result is the timeout.
                                err.reason = Reason::None;
                                Err(err)
                            }
                        },
                        Recovery::Fallback => match (fell_back, last) {
                            (true, Last::Value(v)) => Ok(v),
                            _ => {
                                err.last = fallback_err;
                                Err(err)
                            }
                        },
                        Recovery::DeadlinePassed => {
                            err.reason = Reason::Deadline;
                            Err(err)
                        }
                        Recovery::Degraded { number, timeout } => {
                            guard.attempts = number;
                            let attempt = Attempt { number, timeout: timeout.map(nanos), call, degraded: true };
                            let begin = shared.now();
                            err.attempts = number;
                            let aspan = attempt_span(&guard.span, number, true, http);
                            match AttemptTimeout::new(f(attempt), &shared.clock, begin, timeout).instrument(aspan).await {
                                Some(Ok(v)) => Ok(v),
                                Some(Err(e)) => {
                                    err.last = Some(e);
                                    Err(err)
                                }
                                None => {
                                    err.outcome = Some(Outcome::Timeout);
                                    Err(err)
                                }
                            }
                        }
                    };
                    let reason = result.as_ref().err().map(|e| e.reason).filter(|r| *r != Reason::None);
                    let ended = match (&result, then) {
                        (Ok(_), Recovery::Fallback) => "fallback",
                        (Ok(_), _) => "success",
                        (Err(_), _) => "failure",
                    };
                    guard.end(ended, reason);
                    return result;
                }
            }
        }
    }
}

// `LeveeError` is the public error of every call; this only builds it.
#[allow(clippy::result_large_err)]
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
