//! Hedging: several attempts of one call in flight at once, the first acceptable result wins
//! and the rest are cancelled. gRPC A6's semantics by default; Polly's, failsafe-go's and
//! Envoy's behaviour as named presets where they differ (`docs/policy.md`, "Hedging").
//!
//! The strategy is a pure state machine ([`Hedge`]): the engine feeds it the time (`step`)
//! and each hedged attempt's classified outcome (`report`), with an admission function that
//! says whether one more hedge may go (the deadline, idempotency, the breaker, the limits and
//! the budget: A6 sends a hedge only while the throttle holds more than half its tokens) and
//! under which timeout, and it answers with [`Command`]s for the host: start an attempt,
//! cancel one, wait until a time, the call is done with an attempt's result, or it failed.
//!
//! gRPC A6 (preset `grpc`, the default):
//! * `attempts` counts the original and is at most [`MAX_ATTEMPTS`]; attempt `n + 1` starts
//!   `delay` after attempt `n` (`delay: 0` starts them all at once);
//! * a non-fatal failure sends the next hedge at once; with server pushback `n` the next
//!   hedge waits `n` instead, and a negative or unparseable pushback sends no more hedges;
//! * success or a fatal failure ends the call and cancels every other attempt in flight;
//! * when every attempt has failed the call fails with the last failure: no retries follow;
//! * a hedge is sent only while the budget allows it; a refused hedge is never sent, and the
//!   call goes on with the attempts in flight.

use crate::classify::{self, Rules};
use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, opt_duration, uint};
use crate::time::{format_duration, SECOND};
use crate::types::Reason;

/// Most attempts under gRPC A6, failsafe-go and Envoy presets (A6 caps `maxAttempts` at 5).
pub const MAX_ATTEMPTS: u32 = 5;
/// Most attempts under the Polly preset (`MaxHedgedAttempts` 1 to 10, plus the primary).
pub const MAX_ATTEMPTS_POLLY: u32 = 11;
/// Default attempts, counting the original: one hedge (Polly's and failsafe-go's default).
pub const DEFAULT_ATTEMPTS: u32 = 2;
/// Default delay between hedges (Polly's `Delay`, 2 s; A6's `hedgingDelay` has none).
pub const DEFAULT_DELAY: u64 = 2 * SECOND;
/// Default non-fatal outcomes: the transient failures that `retry-on` retries by default.
pub const DEFAULT_NON_FATAL: &[&str] = classify::DEFAULT_RETRY_ON;
/// The fields of `hedge`.
pub const FIELDS: &[&str] = &["attempts", "delay", "non-fatal", "preset"];

/// Whose semantics a hedge follows where the anchors differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// gRPC A6 (the default).
    Grpc,
    /// Polly v8: when every attempt fails, the primary's failure is returned.
    Polly,
    /// failsafe-go: hedges go by time only; any result other than a non-fatal failure ends the
    /// call and cancels the outstanding hedges (`CancelIf` narrowed to the fatal outcomes).
    Failsafe,
    /// Envoy's `hedge_on_per_try_timeout`: a hedge starts when the latest attempt has run
    /// for the policy's `attempt-timeout`, which then does not cancel the attempt.
    Envoy,
}

const PRESETS: &[(&str, Preset)] =
    &[("grpc", Preset::Grpc), ("polly", Preset::Polly), ("failsafe", Preset::Failsafe), ("envoy", Preset::Envoy)];

impl Preset {
    /// The preset's name in a policy.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Grpc => "grpc",
            Preset::Polly => "polly",
            Preset::Failsafe => "failsafe",
            Preset::Envoy => "envoy",
        }
    }

    /// Most attempts the preset accepts.
    pub fn max_attempts(self) -> u32 {
        if self == Preset::Polly {
            MAX_ATTEMPTS_POLLY
        } else {
            MAX_ATTEMPTS
        }
    }
}

/// Hedging configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct HedgeCfg {
    /// Attempts, counting the original (default [`DEFAULT_ATTEMPTS`], 2 to the preset's most).
    pub attempts: u32,
    /// Delay between one attempt's start and the next one's (default [`DEFAULT_DELAY`]; 0
    /// starts every attempt at once). Under `envoy` it is the policy's `attempt-timeout`.
    pub delay: u64,
    /// Failures after which the next hedge starts at once and the call goes on (default
    /// [`DEFAULT_NON_FATAL`]; every other failure is fatal).
    pub non_fatal: Rules,
    /// Whose semantics (default [`Preset::Grpc`]).
    pub preset: Preset,
}

/// Parse `hedge`. `attempt_timeout` is the policy's, which the `envoy` preset hedges on.
pub fn parse(path: &str, v: &Value, attempt_timeout: Option<u64>, errors: &mut Vec<LoadError>) -> Option<HedgeCfg> {
    let before = errors.len();
    let mut h = Fields::new(path, v, errors)?;
    let preset = match h.take("preset") {
        None => Preset::Grpc,
        Some(v) => choose(&h.path_of("preset"), v, PRESETS, errors).unwrap_or(Preset::Grpc),
    };
    let attempts = uint(&mut h, "attempts", DEFAULT_ATTEMPTS, 2, preset.max_attempts(), errors);
    let delay = if preset == Preset::Envoy {
        if h.take("delay").is_some() {
            errors
                .push(LoadError::new(&h.path_of("delay"), "the envoy preset hedges on the policy's `attempt-timeout`: leave `delay` out"));
        }
        match attempt_timeout {
            Some(t) => t,
            None => {
                errors.push(LoadError::new(
                    &h.path_of("preset"),
                    "the envoy preset hedges on the per-try timeout: the policy needs `attempt-timeout`",
                ));
                0
            }
        }
    } else {
        opt_duration(&mut h, "delay", errors, false).unwrap_or(DEFAULT_DELAY)
    };
    let non_fatal = classify::parse_rules(&mut h, "non-fatal", DEFAULT_NON_FATAL, errors);
    h.finish(FIELDS, errors);
    (errors.len() == before).then_some(HedgeCfg { attempts, delay, non_fatal, preset })
}

impl HedgeCfg {
    /// As the policy's JSON shows it.
    pub fn to_json(&self) -> Value {
        obj([
            ("attempts", self.attempts.into()),
            ("delay", format_duration(self.delay).into()),
            ("non-fatal", self.non_fatal.texts().into()),
            ("preset", self.preset.name().into()),
        ])
    }
}

/// What the host is told to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Start attempt `attempt` (numbered from 1, the original) with this timeout (0: none).
    Start {
        /// The attempt's number.
        attempt: u32,
        /// Its timeout in nanoseconds, 0 for none.
        timeout: u64,
    },
    /// Cancel attempt `attempt`, which is in flight; the host reports it closed when it has.
    Cancel {
        /// The attempt's number.
        attempt: u32,
    },
    /// Nothing to do until `until` (or until an attempt's outcome is reported).
    Wait {
        /// Monotonic nanoseconds.
        until: u64,
    },
    /// The call is done: its result is attempt `attempt`'s success.
    Done {
        /// The winning attempt.
        attempt: u32,
    },
    /// The call failed with attempt `attempt`'s failure, for `reason`.
    Fail {
        /// The attempt whose failure the call returns.
        attempt: u32,
        /// Why no attempt is left.
        reason: Reason,
    },
}

/// What the engine tells the host to do next in a hedged call (`hedge-step`,
/// `report-attempt`; docs/policy.md, "Hedging").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HedgeCommand {
    /// Start attempt `attempt` now, concurrently with those in flight, under `timeout` ns
    /// (0: none).
    Start {
        /// The attempt's number (2, 3, ...; the original is 1).
        attempt: u32,
        /// Its timeout in nanoseconds, 0 for none.
        timeout: u64,
    },
    /// Cancel attempt `attempt`; report it with `report-attempt` once it has closed.
    Cancel {
        /// The attempt's number.
        attempt: u32,
    },
    /// Nothing to do for `delay` ns, unless an attempt ends first; then `hedge-step`.
    Wait {
        /// Nanoseconds.
        delay: u64,
    },
    /// The call is over: attempt `attempt`'s result (or failure) is the call's, and `verdict`
    /// says how it ends, as `report` would: done, fail, fallback or invalid (attempt 0).
    End {
        /// The attempt whose result or failure the call returns (0: none).
        attempt: u32,
        /// The packed verdict.
        verdict: crate::types::Verdict,
    },
}

/// A hedged attempt's outcome, as the engine classified it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Success.
    Ok,
    /// A failure that `non-fatal` matches; `pushback` is gRPC's server pushback, when sent:
    /// `Some(Some(n))` a valid delay of `n` ns, `Some(None)` negative or unparseable.
    NonFatal {
        /// The server's pushback.
        pushback: Option<Option<u64>>,
    },
    /// Any other failure.
    Fatal,
}

/// One hedged call's state. Attempts are numbered from 1; at most [`MAX_ATTEMPTS_POLLY`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hedge {
    attempts: u32,
    delay: u64,
    preset: Preset,
    started: u32,
    in_flight: u16,
    next_at: u64,
    stopped: Option<Reason>,
    primary_failed: bool,
    last_failure: u32,
    over: bool,
}

impl Hedge {
    /// A hedged call whose first attempt started at `now` (the engine's `start` answered it).
    pub fn new(cfg: &HedgeCfg, now: u64) -> Hedge {
        let attempts = cfg.attempts.clamp(1, MAX_ATTEMPTS_POLLY);
        Hedge {
            attempts,
            delay: cfg.delay,
            preset: cfg.preset,
            started: 1,
            in_flight: 1 << 1,
            next_at: now.saturating_add(cfg.delay),
            stopped: None,
            primary_failed: false,
            last_failure: 0,
            over: false,
        }
    }

    /// Whether the call has ended (done or failed).
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// Attempts in flight.
    pub fn in_flight(&self) -> impl Iterator<Item = u32> + '_ {
        (1..=self.started).filter(|a| self.in_flight & (1 << a) != 0)
    }

    /// Whether attempt `attempt` is in flight (started, not ended and not cancelled).
    pub fn is_in_flight(&self, attempt: u32) -> bool {
        attempt <= MAX_ATTEMPTS_POLLY && self.in_flight & (1 << attempt) != 0
    }

    /// Attempts started, counting the original.
    pub fn started(&self) -> u32 {
        self.started
    }

    /// Advance to `now`. `admit` is asked before each hedge (not the original) is sent with
    /// the hedge's number: `Ok(timeout)` sends it under that timeout (0: none), `Err(reason)`
    /// never sends it, and no hedge follows (the call goes on with the attempts in flight and,
    /// if they all fail, fails for `reason`).
    pub fn step(&mut self, now: u64, admit: &mut dyn FnMut(u32) -> Result<u64, Reason>, out: &mut Vec<Command>) {
        if self.over {
            return;
        }
        while self.stopped.is_none() && self.started < self.attempts && now >= self.next_at {
            let attempt = self.started + 1;
            match admit(attempt) {
                Ok(timeout) => {
                    self.started = attempt;
                    self.in_flight |= 1 << attempt;
                    out.push(Command::Start { attempt, timeout });
                    self.next_at = now.saturating_add(self.delay);
                }
                Err(reason) => self.stopped = Some(reason),
            }
        }
        if self.stopped.is_none() && self.started < self.attempts {
            out.push(Command::Wait { until: self.next_at });
            return;
        }
        if self.in_flight != 0 {
            return;
        }
        // Nothing in flight and nothing more to send: every attempt failed.
        self.over = true;
        let attempt = if self.preset == Preset::Polly && self.primary_failed { 1 } else { self.last_failure };
        let reason = self.stopped.unwrap_or(Reason::RetriesExhausted);
        out.push(Command::Fail { attempt, reason });
    }

    /// Attempt `attempt` ended at `now` with `outcome`. A report of an attempt not in flight
    /// (late, cancelled, unknown) changes nothing.
    pub fn report(
        &mut self,
        attempt: u32,
        now: u64,
        outcome: Outcome,
        admit: &mut dyn FnMut(u32) -> Result<u64, Reason>,
        out: &mut Vec<Command>,
    ) {
        if self.over || attempt == 0 || attempt > self.started || !self.is_in_flight(attempt) {
            return;
        }
        self.in_flight &= !(1 << attempt);
        match outcome {
            Outcome::Ok => self.end(Command::Done { attempt }, out),
            Outcome::Fatal => self.end(Command::Fail { attempt, reason: Reason::NonRetryable }, out),
            Outcome::NonFatal { pushback } => {
                self.last_failure = attempt;
                self.primary_failed |= attempt == 1;
                if self.preset != Preset::Failsafe {
                    match pushback {
                        None => self.next_at = now,
                        Some(Some(n)) => self.next_at = now.saturating_add(n),
                        Some(None) => {
                            if self.stopped.is_none() {
                                self.stopped = Some(Reason::Pushback);
                            }
                        }
                    }
                }
                self.step(now, admit, out);
            }
        }
    }

    /// Send no more hedges, for `reason` (the call's reason if every attempt in flight fails):
    /// the engine's word when the next hedge could not start before the deadline.
    pub fn stop(&mut self, reason: Reason) {
        if self.stopped.is_none() {
            self.stopped = Some(reason);
        }
    }

    /// The call was cancelled by its caller: cancel every attempt in flight.
    pub fn cancel(&mut self, out: &mut Vec<Command>) {
        if self.over {
            return;
        }
        self.over = true;
        out.extend(self.in_flight().map(|attempt| Command::Cancel { attempt }));
        self.in_flight = 0;
    }

    fn end(&mut self, last: Command, out: &mut Vec<Command>) {
        self.over = true;
        out.extend(self.in_flight().map(|attempt| Command::Cancel { attempt }));
        self.in_flight = 0;
        out.push(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::MILLISECOND;

    const MS: u64 = MILLISECOND;

    fn cfg(attempts: u32, delay: u64, preset: Preset) -> HedgeCfg {
        HedgeCfg { attempts, delay, non_fatal: Rules::parse_all(&["grpc:unavailable"]).unwrap_or_default(), preset }
    }

    fn yes() -> impl FnMut(u32) -> Result<u64, Reason> {
        |_| Ok(0)
    }

    fn step(h: &mut Hedge, now: u64) -> Vec<Command> {
        let mut out = Vec::new();
        h.step(now, &mut yes(), &mut out);
        out
    }

    fn report(h: &mut Hedge, attempt: u32, now: u64, o: Outcome) -> Vec<Command> {
        let mut out = Vec::new();
        h.report(attempt, now, o, &mut yes(), &mut out);
        out
    }

    const UNAVAILABLE: Outcome = Outcome::NonFatal { pushback: None };
    use Command::{Cancel, Done, Fail, Start, Wait};

    #[test]
    fn the_a6_example() {
        // 4 attempts, delay 500 ms, UNAVAILABLE non-fatal.
        let mut h = Hedge::new(&cfg(4, 500 * MS, Preset::Grpc), 0);
        assert_eq!(step(&mut h, 0), [Wait { until: 500 * MS }]);
        assert_eq!(step(&mut h, 499 * MS), [Wait { until: 500 * MS }]);
        assert_eq!(step(&mut h, 500 * MS), [Start { attempt: 2, timeout: 0 }, Wait { until: 1000 * MS }]);
        // #1 fails UNAVAILABLE at 700: #3 at once.
        assert_eq!(report(&mut h, 1, 700 * MS, UNAVAILABLE), [Start { attempt: 3, timeout: 0 }, Wait { until: 1200 * MS }]);
        // #2 succeeds at 900: #3 is cancelled, #4 never starts.
        assert_eq!(report(&mut h, 2, 900 * MS, Outcome::Ok), [Cancel { attempt: 3 }, Done { attempt: 2 }]);
        assert!(h.is_over());
        assert_eq!(step(&mut h, 2000 * MS), []);
        assert_eq!(report(&mut h, 3, 2000 * MS, Outcome::Ok), []);
    }

    #[test]
    fn delay_zero_sends_all_at_once() {
        let mut h = Hedge::new(&cfg(3, 0, Preset::Grpc), 7);
        let mut out = Vec::new();
        h.step(7, &mut |a| Ok(u64::from(a) * 100), &mut out);
        assert_eq!(out, [Start { attempt: 2, timeout: 200 }, Start { attempt: 3, timeout: 300 }]);
        assert_eq!(h.in_flight().collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn a_fatal_outcome_cancels_the_rest() {
        let mut h = Hedge::new(&cfg(3, 0, Preset::Grpc), 0);
        step(&mut h, 0);
        assert_eq!(
            report(&mut h, 2, 5, Outcome::Fatal),
            [Cancel { attempt: 1 }, Cancel { attempt: 3 }, Fail { attempt: 2, reason: Reason::NonRetryable }]
        );
    }

    #[test]
    fn when_all_fail_there_are_no_retries() {
        let mut h = Hedge::new(&cfg(2, 10, Preset::Grpc), 0);
        assert_eq!(report(&mut h, 1, 3, UNAVAILABLE), [Start { attempt: 2, timeout: 0 }]);
        assert_eq!(report(&mut h, 2, 8, UNAVAILABLE), [Fail { attempt: 2, reason: Reason::RetriesExhausted }]);
        assert!(h.is_over());
        // Polly returns the primary's failure.
        let mut h = Hedge::new(&cfg(2, 10, Preset::Polly), 0);
        report(&mut h, 1, 3, UNAVAILABLE);
        assert_eq!(report(&mut h, 2, 8, UNAVAILABLE), [Fail { attempt: 1, reason: Reason::RetriesExhausted }]);
    }

    #[test]
    fn a_throttled_hedge_is_never_sent() {
        let mut h = Hedge::new(&cfg(3, 10, Preset::Grpc), 0);
        let mut out = Vec::new();
        h.step(10, &mut |_| Err(Reason::Budget), &mut out);
        assert_eq!(out, []);
        out.clear();
        h.step(50, &mut |_| Ok(0), &mut out);
        assert_eq!(out, [], "throttled once, no more hedges");
        assert_eq!(report(&mut h, 1, 60, UNAVAILABLE), [Fail { attempt: 1, reason: Reason::Budget }]);
    }

    #[test]
    fn pushback_delays_the_next_hedge() {
        let mut h = Hedge::new(&cfg(3, 500 * MS, Preset::Grpc), 0);
        let pushed = Outcome::NonFatal { pushback: Some(Some(300 * MS)) };
        assert_eq!(report(&mut h, 1, 100 * MS, pushed), [Wait { until: 400 * MS }]);
        assert_eq!(step(&mut h, 400 * MS), [Start { attempt: 2, timeout: 0 }, Wait { until: 900 * MS }]);
        // A negative pushback stops hedging; the attempt in flight goes on.
        let stop = Outcome::NonFatal { pushback: Some(None) };
        let mut h = Hedge::new(&cfg(3, 500 * MS, Preset::Grpc), 0);
        step(&mut h, 500 * MS);
        assert_eq!(report(&mut h, 1, 600 * MS, stop), []);
        assert_eq!(step(&mut h, 2000 * MS), []);
        assert_eq!(report(&mut h, 2, 2100 * MS, UNAVAILABLE), [Fail { attempt: 2, reason: Reason::Pushback }]);
    }

    #[test]
    fn failsafe_hedges_by_time_only() {
        let mut h = Hedge::new(&cfg(3, 500 * MS, Preset::Failsafe), 0);
        assert_eq!(report(&mut h, 1, 100 * MS, UNAVAILABLE), [Wait { until: 500 * MS }]);
        assert_eq!(step(&mut h, 500 * MS), [Start { attempt: 2, timeout: 0 }, Wait { until: 1000 * MS }]);
    }

    #[test]
    fn envoy_hedges_on_the_per_try_timeout_without_cancelling() {
        let mut c = cfg(2, 0, Preset::Envoy);
        c.delay = 200 * MS;
        let mut h = Hedge::new(&c, 0);
        assert_eq!(step(&mut h, 200 * MS), [Start { attempt: 2, timeout: 0 }]);
        assert_eq!(report(&mut h, 1, 250 * MS, Outcome::Ok), [Cancel { attempt: 2 }, Done { attempt: 1 }]);
    }

    #[test]
    fn late_and_unknown_reports_change_nothing() {
        let mut h = Hedge::new(&cfg(2, 10, Preset::Grpc), 0);
        for a in [0, 2, 3, 99] {
            assert_eq!(report(&mut h, a, 1, Outcome::Ok), []);
        }
        let mut out = Vec::new();
        h.cancel(&mut out);
        assert_eq!(out, [Cancel { attempt: 1 }]);
        assert_eq!(report(&mut h, 1, 2, Outcome::Ok), []);
    }

    fn parse_one(text: &str) -> Result<HedgeCfg, Vec<LoadError>> {
        let v = crate::doc::parse(text).map_err(|e| vec![e])?;
        let mut errors = Vec::new();
        let timeout = if text.contains("envoy") && !text.contains("bare") { Some(SECOND) } else { None };
        parse("hedge", &v, timeout, &mut errors).ok_or(errors)
    }

    #[test]
    fn parsing_defaults_and_errors() {
        let c = parse_one("{}").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((c.attempts, c.delay, c.preset), (DEFAULT_ATTEMPTS, DEFAULT_DELAY, Preset::Grpc));
        assert_eq!(c.non_fatal.texts().len(), DEFAULT_NON_FATAL.len());
        assert_eq!(crate::doc::to_json(&c.to_json()), "{\"attempts\":2,\"delay\":\"2s\",\"non-fatal\":[\"timeout\",\"connection-error\",\"http:429\",\"http:502\",\"http:503\",\"http:504\",\"grpc:unavailable\",\"grpc:resource-exhausted+pushback\"],\"preset\":\"grpc\"}");
        let err =
            |t: &str| parse_one(t).err().unwrap_or_default().into_iter().map(|e| format!("{}: {}", e.path, e.message)).collect::<Vec<_>>();
        assert_eq!(err("{ attempts: 6 }"), ["hedge.attempts: must be a whole number from 2 to 5, found 6"]);
        assert_eq!(err("{ attempts: 1 }"), ["hedge.attempts: must be a whole number from 2 to 5, found 1"]);
        assert!(parse_one("{ attempts: 11, preset: polly, delay: 0 }").is_ok_and(|c| c.attempts == 11 && c.delay == 0));
        assert_eq!(err("{ preset: gprc }"), ["hedge.preset: `gprc` is not one of grpc, polly, failsafe, envoy; did you mean `grpc`?"]);
        assert_eq!(err("{ non-fatal: [\"grpc:nope\"] }").len(), 1);
        assert_eq!(err("{ delay: 5 }"), ["hedge.delay: `5` needs a unit: ns, us, ms, s, m or h (such as \"5ms\")"]);
        assert_eq!(err("{ attemps: 2 }").len(), 1);
        assert!(parse_one("{ preset: envoy }").is_ok_and(|c| c.delay == SECOND));
        assert_eq!(
            err("{ preset: envoy, delay: 1s }"),
            ["hedge.delay: the envoy preset hedges on the policy's `attempt-timeout`: leave `delay` out"]
        );
        assert_eq!(
            err("{ preset: envoy, bare: 1 }").first().map(String::as_str),
            Some("hedge.preset: the envoy preset hedges on the per-try timeout: the policy needs `attempt-timeout`")
        );
    }
}
