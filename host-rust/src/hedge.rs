//! Hedged calls (docs/policy.md, "Hedging"; docs/hosts.md). After a `hedge` verdict the call
//! runs attempt 1 of the guarded closure, asks the core `hedge-step`, and carries out, in
//! order, the commands that it and `report-attempt` answer: start an attempt (concurrently,
//! under the timeout given), cancel one, wait (for a time, or until an attempt ends), end the
//! call. The host decides nothing here: it has no hedge timer of its own and never picks the
//! winner; it holds the commands to the contract ([`Plan`], in the style of docs/hosts.md
//! section 2) and takes the one recovery path when they break it, when a crossing traps, or
//! when the core no longer knows the call.
//!
//! # How the attempts run
//! The attempts are futures of the call's own task, polled together as `tokio::select!` polls
//! its branches (and `futures::future::join_all` any set of fewer than 30), not spawned tasks:
//! - the closure is called once per attempt exactly as for retries, and neither it nor its
//!   futures need be `Send` or `'static` (a borrowed client, a `!Send` future still works);
//! - cancelling an attempt drops its future, which closes it there and then (a request in
//!   flight is aborted and its connection released by the drop): the attempt is reported
//!   closed at once, so the bulkhead slot it holds is freed exactly when it is really free. An
//!   aborted task closes later, on another worker, and must be awaited to know when;
//! - dropping the call's future (the caller cancelled) drops every attempt with it;
//! - no spawn, `JoinHandle` or scheduler round trip per attempt.
//!
//! `FuturesUnordered` polls only the futures that woke, but cannot drop one future of its set
//! by name; with at most 11 attempts, polling those in flight on a wake-up costs less than its
//! bookkeeping.
//!
//! The path is taken only on verdict kind 7: a call that is not hedged never enters this
//! module, and the call's own future holds this one boxed (its state does not grow).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use levee_core::hedge::MAX_ATTEMPTS_POLLY;
use levee_core::{HedgeCommand, OutcomeKind, Verdict, VerdictKind};
use tokio::sync::mpsc::{self, error::TryRecvError};
use tokio::task::futures::TaskLocalFuture;
use tracing::instrument::Instrumented;
use tracing::Instrument;

use crate::call::{asked, attempt_span, nanos, take_hedge, Attempt, AttemptTimeout, FaultOp, Faults, Last, RetryIf};
use crate::driver::{Action, Crossing, Driver, Recovery};
use crate::handle::Levee;
use crate::outcome::Outcome;
use crate::raw::{RawEngine, Trap};
use crate::runtime::{deliver, Shared};
use crate::telemetry::{self, Fault};
use crate::time::Sleep;

/// The error class a cancelled attempt is reported with (the core does not look at it).
const CANCELLED: &str = "levee:cancelled";

/// Answers of `hedge-step` in a row that start, cancel and end nothing and wait for no time,
/// past which the guest is taken to be spinning (a contract fault) rather than waking the host
/// in a loop forever.
const MAX_IDLE_STEPS: u32 = 64;

/// A command of the core, checked: what the host does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// Run attempt `attempt` now under `timeout` ns (`None`: none).
    Start { attempt: u32, timeout: Option<u64> },
    /// Drop attempt `attempt` and report it closed.
    Cancel { attempt: u32 },
    /// Step again at `until`, unless an attempt ends first.
    Wait { until: u64 },
    /// The call is over: `verdict` (done, fail, fallback or invalid), with attempt `attempt`'s
    /// result or failure.
    End { attempt: u32, verdict: Verdict },
}

/// What the host knows of a hedged call, to hold the core's commands to the contract
/// (docs/hosts.md, section 2). Sans-I/O, like [`Driver`]. A command breaks the contract when:
/// - `start` is not of the next attempt (or past the most any preset allows), or its timeout
///   ends past the deadline, or is 0 (none) under a deadline;
/// - `cancel` names an attempt that is not in flight (never started, ended or cancelled);
/// - `wait` ends past the deadline;
/// - `end` names an attempt never started, carries a verdict other than done, fail, fallback or
///   invalid, pairs `invalid` with an attempt or an attempt 0 with anything else, or is `done`
///   with an attempt that did not end with a result;
/// - anything but `cancel` follows `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    deadline: Option<u64>,
    started: u32,
    /// Bit `n`: attempt `n` is in flight.
    in_flight: u16,
    /// Bit `n`: attempt `n` ended and its outcome was reported.
    ended: u16,
    over: bool,
}

fn bit(attempt: u32) -> u16 {
    1u16.checked_shl(attempt).unwrap_or(0)
}

impl Plan {
    /// A hedged call whose attempt 1 is running, under the call's `deadline` (`None`: none).
    pub(crate) fn new(deadline: Option<u64>) -> Self {
        Plan { deadline, started: 1, in_flight: bit(1), ended: 0, over: false }
    }

    /// Attempts started.
    pub(crate) fn started(&self) -> u32 {
        self.started
    }

    /// Attempt `attempt` ended on its own and is reported with its outcome.
    pub(crate) fn ended(&mut self, attempt: u32) {
        self.in_flight &= !bit(attempt);
        self.ended |= bit(attempt);
    }

    /// The command `c`, answered at `now`, as the host carries it out; `None` when it breaks
    /// the contract.
    pub(crate) fn check(&mut self, c: HedgeCommand, now: u64) -> Option<Command> {
        if self.over && !matches!(c, HedgeCommand::Cancel { .. }) {
            return None;
        }
        let left = self.deadline.map(|d| d.saturating_sub(now));
        match c {
            HedgeCommand::Start { attempt, timeout } => {
                if attempt != self.started.saturating_add(1) || attempt > MAX_ATTEMPTS_POLLY {
                    return None;
                }
                if left.is_some_and(|left| timeout > left || timeout == 0) {
                    return None;
                }
                self.started = attempt;
                self.in_flight |= bit(attempt);
                Some(Command::Start { attempt, timeout: (timeout > 0).then_some(timeout) })
            }
            HedgeCommand::Cancel { attempt } => {
                if attempt == 0 || self.in_flight & bit(attempt) == 0 {
                    return None;
                }
                self.in_flight &= !bit(attempt);
                Some(Command::Cancel { attempt })
            }
            HedgeCommand::Wait { delay } => {
                let until = now.saturating_add(delay);
                if self.deadline.is_some_and(|d| until > d) {
                    return None;
                }
                Some(Command::Wait { until })
            }
            HedgeCommand::End { attempt, verdict } => {
                if attempt > self.started {
                    return None;
                }
                let fits = match verdict.kind() {
                    Some(VerdictKind::Invalid) => attempt == 0,
                    Some(VerdictKind::Done) => attempt > 0 && self.ended & bit(attempt) != 0,
                    Some(VerdictKind::Fail | VerdictKind::Fallback) => attempt > 0,
                    _ => false,
                };
                if !fits {
                    return None;
                }
                self.over = true;
                Some(Command::End { attempt, verdict })
            }
        }
    }
}

/// Keeps a hedged attempt open after its future is dropped, for work the attempt handed to
/// something that outlives it (a spawned task that still holds the connection, say). A
/// cancelled attempt is reported closed, and frees its bulkhead slot, only when its future is
/// dropped **and** every lease on it is (docs/policy.md, "Host contract": a slot is never
/// freed at cancel time). Take one inside the attempt with [`Attempt::lease`]; drop it when
/// the work is done. Without a lease, dropping the future closes the attempt.
#[derive(Clone, Debug)]
pub struct AttemptLease {
    /// The attempt is open while a sender (the host's own, and each lease's) is alive.
    _open: mpsc::Sender<()>,
}

/// The lease of the attempt whose future is being polled.
#[derive(Clone)]
struct Leased {
    call: u64,
    number: u32,
    lease: AttemptLease,
}

tokio::task_local! {
    static LEASE: Leased;
}

impl Attempt {
    /// A lease on this attempt ([`AttemptLease`]), when it is a hedged attempt and this runs
    /// inside its future; `None` otherwise (a lease is only needed where attempts overlap).
    pub fn lease(&self) -> Option<AttemptLease> {
        LEASE.try_with(|l| (l.call == self.call && l.number == self.number).then(|| l.lease.clone())).ok().flatten()
    }
}

/// What a hedged call needs of the call running it.
pub(crate) struct Hedging<'a> {
    pub(crate) levee: &'a Levee,
    pub(crate) shared: &'a Shared,
    pub(crate) policy: &'a str,
    pub(crate) key: &'a str,
    pub(crate) call: u64,
    /// The call's span, parent of each attempt's.
    pub(crate) span: &'a tracing::Span,
    /// An HTTP integration's call.
    pub(crate) http: bool,
    pub(crate) retry_if: Option<&'a RetryIf>,
    /// Attempts started, as the call counts them (`levee.retried`, should it be cancelled).
    pub(crate) attempts: &'a mut u32,
    /// The fault seam of the host scenarios.
    pub(crate) faults: &'a mut Option<Box<Faults>>,
}

/// How a hedged call ended, for the call's own loop to finish it.
pub(crate) struct Ended<T, E> {
    /// What the `end` verdict says (done, fail, fallback: as after a `report`), or the
    /// recovery path.
    pub(crate) action: Action,
    /// The result or failure of the attempt the call ends with.
    pub(crate) last: Last<T, E>,
    /// Its outcome.
    pub(crate) outcome: Option<Outcome>,
    /// The trap that sent the call down the recovery path, if one did.
    pub(crate) trap: Option<Trap>,
}

type AttemptFuture<'a, Fut> = Instrumented<AttemptTimeout<'a, TaskLocalFuture<Leased, Fut>>>;

/// An attempt in flight.
struct Running<'a, Fut> {
    number: u32,
    begin: u64,
    timeout: Option<u64>,
    span: tracing::Span,
    /// Closed when the future and every lease on it are dropped.
    closed: mpsc::Receiver<()>,
    fut: Pin<Box<AttemptFuture<'a, Fut>>>,
}

/// A cancelled attempt whose future is dropped but a lease is not.
struct Closing {
    number: u32,
    begin: u64,
    closed: mpsc::Receiver<()>,
}

/// An attempt that ended on its own: its result (`None`: its timeout fired) and outcome.
struct Finished<T, E> {
    number: u32,
    result: Option<Result<T, E>>,
    outcome: Outcome,
}

impl<T, E> Finished<T, E> {
    fn into_last(self) -> (Last<T, E>, Option<Outcome>) {
        let last = match self.result {
            None => Last::None,
            Some(Ok(v)) => Last::Value(v),
            Some(Err(e)) => Last::Error(e),
        };
        (last, Some(self.outcome))
    }
}

/// What woke the call.
enum Woke<O> {
    /// The attempt at this index of those in flight ended.
    Attempt(usize, O),
    /// The cancelled attempt at this index of those closing has closed.
    Closed(usize),
    /// The `wait` is over.
    Timer,
}

/// The first of `running` to end (the lowest number first, at one instant), of `closing` to
/// close, or the timer.
async fn race<Fut: Future>(
    running: &mut [Running<'_, Fut>],
    closing: &mut [Closing],
    timer: &mut Option<Sleep>,
) -> Woke<Option<Fut::Output>> {
    std::future::poll_fn(|cx| {
        for (i, r) in running.iter_mut().enumerate() {
            if let Poll::Ready(out) = r.fut.as_mut().poll(cx) {
                return Poll::Ready(Woke::Attempt(i, out));
            }
        }
        for (i, c) in closing.iter_mut().enumerate() {
            if c.closed.poll_recv(cx).is_ready() {
                return Poll::Ready(Woke::Closed(i));
            }
        }
        match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(Woke::Timer),
            _ => Poll::Pending,
        }
    })
    .await
}

/// The verdict of the `end` among `commands`, for the trace hook.
fn end_verdict(commands: &[HedgeCommand]) -> Option<Verdict> {
    commands.iter().find_map(|c| match c {
        HedgeCommand::End { verdict, .. } => Some(*verdict),
        _ => None,
    })
}

/// Report attempt `number` of `call`, cancelled and now closed, at `now`.
fn report_closed(
    shared: &Shared,
    span: &tracing::Span,
    policy: &str,
    call: u64,
    number: u32,
    begin: u64,
    now: u64,
) -> Result<Vec<HedgeCommand>, Trap> {
    let cancelled = Outcome::error(CANCELLED);
    let (k, code, text, flags) = cancelled.parts();
    let (r, pending) =
        shared.cross_hedge(true, |raw| raw.try_report_attempt(call, number, now, now.saturating_sub(begin), k, code, text, 0, flags));
    if let Ok(commands) = &r {
        shared.step("report-attempt", now, call, policy, None, end_verdict(commands));
    }
    deliver(span, pending);
    r
}

/// One hedged call on the host: the attempts in flight, closing and ended.
struct Hedged<'a, T, E, C, Fut> {
    h: Hedging<'a>,
    classify: &'a C,
    plan: Plan,
    running: Vec<Running<'a, Fut>>,
    closing: Vec<Closing>,
    finished: Vec<Finished<T, E>>,
}

impl<'a, T, E, C, Fut> Hedged<'a, T, E, C, Fut>
where
    T: 'static,
    E: 'static,
    C: Fn(&Result<T, E>) -> Outcome,
    Fut: Future<Output = Result<T, E>>,
{
    /// Run attempt `number` from `begin` under `timeout`.
    fn launch<F: FnMut(Attempt) -> Fut>(&mut self, f: &mut F, number: u32, begin: u64, timeout: Option<u64>) {
        *self.h.attempts = number;
        let attempt = Attempt { number, timeout: timeout.map(nanos), call: self.h.call, degraded: false };
        let span = attempt_span(self.h.span, number, false, self.h.http);
        let (lease, closed) = mpsc::channel(1);
        let leased = LEASE.scope(Leased { call: self.h.call, number, lease: AttemptLease { _open: lease } }, f(attempt));
        let fut = Box::pin(AttemptTimeout::new(leased, &self.h.shared.clock, begin, timeout).instrument(span.clone()));
        self.running.push(Running { number, begin, timeout, span, closed, fut });
    }

    /// A crossing `op` of the call, or what the fault seam injects instead.
    fn cross(
        &mut self,
        op: FaultOp,
        real: impl FnOnce(&mut RawEngine) -> Result<(Vec<HedgeCommand>, bool), Trap>,
    ) -> Result<Vec<HedgeCommand>, Trap> {
        let inject = take_hedge(self.h.faults, op);
        // The report of an attempt may free its slot.
        let closes = op == FaultOp::ReportAttempt;
        let (r, pending) = self.h.shared.cross_hedge(closes, |raw| match inject {
            None => real(raw),
            Some(None) => Err(raw.reinstantiate(
                if op == FaultOp::HedgeStep { "hedge-step" } else { "report-attempt" },
                "a trap injected by the fault seam",
            )),
            Some(Some(commands)) => {
                // The real crossing happens; its events are lost, as a trap's are.
                if let Ok((_, true)) = real(raw) {
                    let _ = raw.try_drain_events();
                }
                Ok((commands, false))
            }
        });
        deliver(self.h.span, pending);
        r
    }

    /// `hedge-step` at `now`.
    fn step(&mut self, now: u64) -> Result<Vec<HedgeCommand>, Trap> {
        let call = self.h.call;
        let r = self.cross(FaultOp::HedgeStep, |raw| raw.try_hedge_step(call, now));
        if let Ok(commands) = &r {
            self.h.shared.step("hedge-step", now, call, self.h.policy, None, end_verdict(commands));
        }
        r
    }

    /// Drop attempt `number` (the core cancelled it, or the call is over): report it closed
    /// now, or once its leases are dropped. The core's answer, if it was reported.
    fn close(&mut self, number: u32) -> Option<Result<Vec<HedgeCommand>, Trap>> {
        let i = self.running.iter().position(|r| r.number == number)?;
        let Running { begin, mut closed, .. } = self.running.remove(i);
        // The future is dropped: whatever the attempt was doing is aborted.
        if closed.try_recv() != Err(TryRecvError::Disconnected) {
            self.closing.push(Closing { number, begin, closed });
            return None;
        }
        let now = self.h.shared.now();
        Some(self.closed(number, begin, now))
    }

    /// Report attempt `number`, begun at `begin`, cancelled and now closed, at `now` (through
    /// the fault seam, as every `report-attempt` of the call).
    fn closed(&mut self, number: u32, begin: u64, now: u64) -> Result<Vec<HedgeCommand>, Trap> {
        let cancelled = Outcome::error(CANCELLED);
        let (kind, code, text, flags) = cancelled.parts();
        let call = self.h.call;
        let r = self.cross(FaultOp::ReportAttempt, |raw| {
            raw.try_report_attempt(call, number, now, now.saturating_sub(begin), kind, code, text, 0, flags)
        });
        if let Ok(commands) = &r {
            self.h.shared.step("report-attempt", now, call, self.h.policy, None, end_verdict(commands));
        }
        r
    }

    /// What attempt `r` ended with: the time, the outcome, the elapsed time (a timeout that
    /// fired reports the timeout itself).
    fn observe(&self, r: &Running<'a, Fut>, out: &Option<Result<T, E>>) -> (u64, Outcome, u64) {
        let now = self.h.shared.now();
        let elapsed = match (out, r.timeout) {
            (None, Some(t)) => t,
            _ => now.saturating_sub(r.begin),
        };
        let outcome = match out {
            None => Outcome::Timeout,
            Some(result) => (self.classify)(result),
        };
        r.span.record("levee.outcome", outcome.kind_name());
        (now, outcome, elapsed)
    }

    /// The attempt at `index` of those in flight ended with `out`: report it. Its number, the
    /// time of the report and the core's answer.
    fn finish(&mut self, index: usize, out: Option<Result<T, E>>) -> (u32, u64, Result<Vec<HedgeCommand>, Trap>) {
        let r = self.running.remove(index);
        let (now, outcome, elapsed) = self.observe(&r, &out);
        let number = r.number;
        drop(r);
        let asked = asked(self.h.retry_if, &out, &outcome, self.h.policy);
        self.plan.ended(number);
        let (kind, code, text, flags) = outcome.parts();
        let wall = if kind == OutcomeKind::HttpStatus && !text.is_empty() { self.h.shared.clock.unix_seconds() } else { 0 };
        let call = self.h.call;
        let answer = self
            .cross(FaultOp::ReportAttempt, |raw| raw.try_report_attempt(call, number, now, elapsed, kind, code, text, wall, flags | asked));
        if let Ok(commands) = &answer {
            self.h.shared.step("report-attempt", now, call, self.h.policy, Some(&outcome), end_verdict(commands));
            telemetry::attempt(&*self.h.shared.telemetry, self.h.policy, outcome.kind_name(), elapsed);
        }
        self.finished.push(Finished { number, result: out, outcome });
        (number, now, answer)
    }

    /// The result attempt `number` ended with (taken: the call ends with it).
    fn take(&mut self, number: u32) -> Option<Finished<T, E>> {
        let i = self.finished.iter().position(|f| f.number == number)?;
        Some(self.finished.swap_remove(i))
    }

    /// The call is over: close what still runs, and report the attempts still closing when
    /// they have closed, without the caller waiting for them.
    fn release(mut self) {
        while let Some(number) = self.running.first().map(|r| r.number) {
            let _ = self.close(number);
        }
        if self.closing.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to wait on: the core hears of them now.
            let h = &self.h;
            for c in self.closing.drain(..) {
                let _ = report_closed(h.shared, h.span, h.policy, h.call, c.number, c.begin, h.shared.now());
            }
            return;
        };
        let (levee, policy, call, span) = (self.h.levee.clone(), self.h.policy.to_string(), self.h.call, self.h.span.clone());
        let mut closing = std::mem::take(&mut self.closing);
        drop(rt.spawn(async move {
            while !closing.is_empty() {
                let i = std::future::poll_fn(|cx| {
                    closing.iter_mut().position(|c| c.closed.poll_recv(cx).is_ready()).map_or(Poll::Pending, Poll::Ready)
                })
                .await;
                let c = closing.swap_remove(i);
                let shared = &*levee.shared;
                let _ = report_closed(shared, &span, &policy, call, c.number, c.begin, shared.now());
            }
        }));
    }

    /// The one recovery path (docs/hosts.md, section 3) for `fault` (with the `trap`, if one),
    /// the crossing that failed having been the report of attempt `in_hand` (if it was one).
    /// The call degrades to a single attempt, with no more reports: the one in hand, else the
    /// oldest in flight (the others are dropped), else the last that ended; with none of
    /// those, one degraded attempt as after a failed `start`.
    async fn recover(mut self, fault: Fault, trap: Option<Trap>, in_hand: Option<u32>, driver: &mut Driver) -> Ended<T, E> {
        driver.hedged(self.plan.started());
        let now = self.h.shared.now();
        let stands = in_hand.and_then(|n| self.take(n));
        if stands.is_none() && self.running.is_empty() && self.finished.is_empty() {
            return Ended { action: driver.degraded(fault, now), last: Last::None, outcome: None, trap };
        }
        let h = &self.h;
        if fault == Fault::Contract {
            h.shared.reinstantiate(h.call);
        }
        {
            let _in = h.span.enter(); // the call's `engine-fault` event
            h.shared.fault(fault, h.policy, h.key, h.call);
        }
        let finished = match stands {
            Some(f) => Some(f),
            None if !self.running.is_empty() => {
                // `running` is in the order the attempts started.
                let mut r = self.running.remove(0);
                // The others close now, unreported: the engine has forgotten the call.
                self.running.clear();
                let out = r.fut.as_mut().await;
                let (_, outcome, _) = self.observe(&r, &out);
                Some(Finished { number: r.number, result: out, outcome })
            }
            None => self.finished.pop(),
        };
        self.running.clear();
        let (last, outcome) = finished.map_or((Last::None, None), Finished::into_last);
        Ended { action: Action::Recover { fault, then: Recovery::Hedged }, last, outcome, trap }
    }
}
/// Run a hedged call whose `hedge` verdict admitted attempt 1 at `begin` under `timeout`,
/// until its `end` (or the recovery path).
pub(crate) async fn run<T, E, C, F, Fut>(
    h: Hedging<'_>,
    driver: &mut Driver,
    classify: &C,
    f: &mut F,
    begin: u64,
    timeout: Option<u64>,
) -> Ended<T, E>
where
    T: 'static,
    E: 'static,
    C: Fn(&Result<T, E>) -> Outcome,
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let plan = Plan::new(driver.deadline());
    let mut s = Hedged { h, classify, plan, running: Vec::with_capacity(2), closing: Vec::new(), finished: Vec::new() };
    s.launch(f, 1, begin, timeout);
    // The answer to carry out, the time of the crossing that gave it, and the attempt whose
    // report it answers (`None`: a `hedge-step`, or the report of a cancelled attempt).
    let mut at = begin;
    let mut answer = s.step(at);
    let mut in_hand: Option<u32> = None;
    // The time the last `wait` asked for: an answer to a step or to an attempt that ended
    // replaces it (none in the answer: wait for an attempt only); the answer to the report of
    // a cancelled attempt leaves it unless it has one.
    let mut wait: Option<u64> = None;
    let mut replaces = true;
    let mut idle = 0u32;
    loop {
        let commands = match answer {
            Ok(c) => c,
            Err(t) => return s.recover(Fault::Trap, Some(t), in_hand, driver).await,
        };
        if replaces {
            wait = None;
        }
        // The whole answer is checked before any command runs.
        let Some(checked) = commands.into_iter().map(|c| s.plan.check(c, at)).collect::<Option<Vec<Command>>>() else {
            return s.recover(Fault::Contract, None, in_hand, driver).await;
        };
        let (mut end, mut acted, mut more) = (None, false, Vec::new());
        for c in checked {
            match c {
                Command::Start { attempt, timeout } => {
                    s.launch(f, attempt, at, timeout);
                    acted = true;
                }
                Command::Cancel { attempt } => {
                    acted = true;
                    match s.close(attempt) {
                        None => {}
                        Some(Ok(answer)) => more.extend(answer),
                        Some(Err(t)) => return s.recover(Fault::Trap, Some(t), in_hand, driver).await,
                    }
                }
                Command::Wait { until } => {
                    wait = Some(until);
                    s.h.shared.step_sleep(s.h.call, s.h.policy, until.saturating_sub(at));
                }
                Command::End { attempt, verdict } => end = Some((attempt, verdict)),
            }
        }
        // What the reports of the cancelled attempts answered (nothing, as a rule).
        if !more.is_empty() {
            let Some(checked) = more.into_iter().map(|c| s.plan.check(c, at)).collect::<Option<Vec<Command>>>() else {
                return s.recover(Fault::Contract, None, in_hand, driver).await;
            };
            if checked.iter().any(|c| !matches!(c, Command::End { .. })) {
                return s.recover(Fault::Contract, None, in_hand, driver).await;
            }
            end = end.or(checked.into_iter().find_map(|c| match c {
                Command::End { attempt, verdict } => Some((attempt, verdict)),
                _ => None,
            }));
        }
        if let Some((attempt, verdict)) = end {
            driver.hedged(s.plan.started());
            let action = driver.next(verdict, at, Crossing::Report);
            if let Action::Recover { fault, .. } = action {
                return s.recover(fault, None, in_hand, driver).await;
            }
            let (last, outcome) = s.take(attempt).map_or((Last::None, None), Finished::into_last);
            s.release();
            return Ended { action, last, outcome, trap: None };
        }
        // Nothing in flight and no time to wait for: the core left the call stranded.
        if s.running.is_empty() && s.closing.is_empty() && wait.is_none() {
            return s.recover(Fault::Contract, None, in_hand, driver).await;
        }
        idle = if acted || in_hand.is_some() || wait.is_some_and(|until| until > at) { 0 } else { idle.saturating_add(1) };
        if idle > MAX_IDLE_STEPS {
            return s.recover(Fault::Contract, None, in_hand, driver).await;
        }
        let mut timer = wait.map(|until| s.h.shared.clock.sleep_until(until));
        match race(&mut s.running, &mut s.closing, &mut timer).await {
            Woke::Attempt(index, out) => {
                let (number, now, a) = s.finish(index, out);
                (at, answer, in_hand, replaces) = (now, a, Some(number), true);
            }
            Woke::Closed(index) => {
                let c = s.closing.swap_remove(index);
                at = s.h.shared.now();
                answer = s.closed(c.number, c.begin, at);
                (in_hand, replaces) = (None, false);
            }
            Woke::Timer => {
                at = s.h.shared.now();
                answer = s.step(at);
                (in_hand, replaces) = (None, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(attempt: u32, kind: VerdictKind) -> HedgeCommand {
        HedgeCommand::End { attempt, verdict: Verdict::new(kind, 0, 0) }
    }

    #[test]
    fn commands_within_the_contract_are_carried_out() {
        let mut p = Plan::new(Some(1_000));
        assert_eq!(p.check(HedgeCommand::Wait { delay: 500 }, 0), Some(Command::Wait { until: 500 }));
        assert_eq!(p.check(HedgeCommand::Start { attempt: 2, timeout: 500 }, 500), Some(Command::Start { attempt: 2, timeout: Some(500) }));
        assert_eq!(p.check(HedgeCommand::Start { attempt: 3, timeout: 300 }, 700), Some(Command::Start { attempt: 3, timeout: Some(300) }));
        p.ended(2);
        assert_eq!(p.check(HedgeCommand::Cancel { attempt: 3 }, 900), Some(Command::Cancel { attempt: 3 }));
        assert_eq!(p.check(HedgeCommand::Cancel { attempt: 1 }, 900), Some(Command::Cancel { attempt: 1 }));
        assert_eq!(
            p.check(end(2, VerdictKind::Done), 900),
            Some(Command::End { attempt: 2, verdict: Verdict::new(VerdictKind::Done, 0, 0) })
        );
        assert_eq!(p.started(), 3);
        // Without a deadline, a start may have no timeout and a wait any length.
        let mut p = Plan::new(None);
        assert_eq!(p.check(HedgeCommand::Start { attempt: 2, timeout: 0 }, 5), Some(Command::Start { attempt: 2, timeout: None }));
        assert_eq!(p.check(HedgeCommand::Wait { delay: u64::MAX }, 5), Some(Command::Wait { until: u64::MAX }));
        assert!(p.check(end(1, VerdictKind::Fail), 9).is_some());
        let mut p = Plan::new(None);
        assert!(p.check(end(0, VerdictKind::Invalid), 9).is_some());
    }

    type Case = dyn Fn(&mut Plan) -> Option<Command>;

    #[test]
    fn commands_that_break_the_contract_are_refused() {
        let deadline = Some(1_000);
        let cases: [(&str, &Case); 14] = [
            ("start of an attempt already started", &|p| p.check(HedgeCommand::Start { attempt: 1, timeout: 10 }, 0)),
            ("start that skips one", &|p| p.check(HedgeCommand::Start { attempt: 3, timeout: 10 }, 0)),
            ("start past the deadline", &|p| p.check(HedgeCommand::Start { attempt: 2, timeout: 901 }, 100)),
            ("start without a timeout under a deadline", &|p| p.check(HedgeCommand::Start { attempt: 2, timeout: 0 }, 100)),
            ("cancel of an attempt never started", &|p| p.check(HedgeCommand::Cancel { attempt: 2 }, 0)),
            ("cancel of attempt 0", &|p| p.check(HedgeCommand::Cancel { attempt: 0 }, 0)),
            ("cancel of an attempt that ended", &|p| {
                p.ended(1);
                p.check(HedgeCommand::Cancel { attempt: 1 }, 0)
            }),
            ("wait past the deadline", &|p| p.check(HedgeCommand::Wait { delay: 901 }, 100)),
            ("end of an attempt never started", &|p| p.check(end(2, VerdictKind::Fail), 0)),
            ("done of an attempt that did not end", &|p| p.check(end(1, VerdictKind::Done), 0)),
            ("invalid with an attempt", &|p| p.check(end(1, VerdictKind::Invalid), 0)),
            ("fail without an attempt", &|p| p.check(end(0, VerdictKind::Fail), 0)),
            ("an end with a retry", &|p| p.check(end(1, VerdictKind::Retry), 0)),
            ("a start after the end", &|p| {
                p.check(end(1, VerdictKind::Fail), 0)?;
                p.check(HedgeCommand::Start { attempt: 2, timeout: 10 }, 0)
            }),
        ];
        for (what, case) in cases {
            assert_eq!(case(&mut Plan::new(deadline)), None, "{what}");
        }
        // A cancel after the end is how the core closes the rest.
        let mut p = Plan::new(None);
        assert!(p.check(HedgeCommand::Start { attempt: 2, timeout: 0 }, 0).is_some());
        assert!(p.check(end(1, VerdictKind::Fail), 0).is_some());
        assert_eq!(p.check(HedgeCommand::Cancel { attempt: 2 }, 0), Some(Command::Cancel { attempt: 2 }));
        assert_eq!(p.check(end(1, VerdictKind::Fail), 0), None, "a second end");
    }
}
