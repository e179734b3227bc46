//! Circuit breaker (resilience4j semantics, with the known bugs designed out).
//!
//! * Sliding window: `count` (the last N calls) or `time` (a ring of buckets covering the
//!   last `size`, `bucket` wide).
//! * Trips (closed -> open) when at least `min(minimum-calls, window size)` calls are
//!   recorded (count window; `minimum-calls` for a time window) and the failure rate
//!   `>= failure-rate` or the slow-call rate `>= slow-call-rate` (slow: elapsed
//!   `>= slow-call-duration`).
//! * Open for `open-duration`, growing by `open-duration-multiplier` on each consecutive
//!   trip up to `open-duration-max`. After it, the breaker is half-open: exactly
//!   `half-open-permits` trial calls are admitted; when all have reported, it closes if
//!   their failure and slow rates are below the thresholds, else opens again.
//! * A half-open permit that is never reported expires after `half-open-permit-timeout`
//!   and is given back (resilience4j #2172); a permit given back by a cancelled call never
//!   raises capacity above N (failsafe #391); the engine is single-threaded, so no call slips
//!   through during open -> half-open (resilience4j #1432).
//! * Only legal automatic edges: closed->open, open->half-open, half-open->closed,
//!   half-open->open. Forced states are an operator's.

use crate::classify::{self, Rules};
use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, describe, fraction, int, opt_duration, pairs, rows, u32_at, u64_at, uint};
use crate::time::{format_duration, SECOND};
use crate::types::BreakerState as S;

/// Default size of a count window, in calls (resilience4j's `slidingWindowSize`).
pub const DEFAULT_WINDOW_CALLS: u32 = 100;
/// Default sliding window.
pub const DEFAULT_WINDOW: Window = Window::Count(DEFAULT_WINDOW_CALLS);
/// Largest count window.
pub const MAX_WINDOW_CALLS: u32 = 100_000;
/// Default length of a time window.
pub const DEFAULT_TIME_WINDOW: u64 = 60 * SECOND;
/// Default bucket of a time window.
pub const DEFAULT_BUCKET: u64 = SECOND;
/// Most buckets of a time window.
pub const MAX_BUCKETS: u64 = 3600;
/// Default failure-rate threshold, percent.
pub const DEFAULT_FAILURE_RATE: f64 = 50.0;
/// Default slow-call-rate threshold, percent.
pub const DEFAULT_SLOW_CALL_RATE: f64 = 100.0;
/// Default duration from which a call is slow.
pub const DEFAULT_SLOW_CALL_DURATION: u64 = 60 * SECOND;
/// Default calls needed before the breaker may trip.
pub const DEFAULT_MINIMUM_CALLS: u32 = 100;
/// Default time open after a trip.
pub const DEFAULT_OPEN_DURATION: u64 = 60 * SECOND;
/// Default growth of the open time per consecutive trip (when `open-duration-max` lets it grow).
pub const DEFAULT_OPEN_DURATION_MULTIPLIER: f64 = 2.0;
/// Default trial calls in half-open.
pub const DEFAULT_HALF_OPEN_PERMITS: u32 = 10;
/// Default time after which an unreported half-open permit is given back.
pub const DEFAULT_HALF_OPEN_PERMIT_TIMEOUT: u64 = 60 * SECOND;
/// The fields of `breaker`.
pub const FIELDS: &[&str] = &[
    "window",
    "failure-rate",
    "slow-call-rate",
    "slow-call-duration",
    "minimum-calls",
    "open-duration",
    "open-duration-max",
    "open-duration-multiplier",
    "half-open-permits",
    "half-open-permit-timeout",
    "failure-on",
];

/// Sliding window kinds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Window {
    /// The last N calls.
    Count(u32),
    /// The last `size` ns, in buckets of `bucket` ns.
    Time {
        /// Window length.
        size: u64,
        /// Bucket length.
        bucket: u64,
    },
}

/// Breaker configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerCfg {
    /// Sliding window (default count, 100).
    pub window: Window,
    /// Failure-rate threshold in percent (default 50).
    pub failure_rate: f64,
    /// Slow-call-rate threshold in percent (default 100).
    pub slow_call_rate: f64,
    /// A call at least this long is slow (default 60s).
    pub slow_call_duration: u64,
    /// Calls needed before the breaker may trip (default 100).
    pub minimum_calls: u32,
    /// Time open after the first trip (default 60s).
    pub open_duration: u64,
    /// Longest time open (default: `open-duration`, i.e. fixed).
    pub open_duration_max: u64,
    /// Growth per consecutive trip (default 2).
    pub open_duration_multiplier: f64,
    /// Trial calls in half-open (default 10).
    pub half_open_permits: u32,
    /// A half-open permit unreported this long is given back (default 60s).
    pub half_open_permit_timeout: u64,
    /// Outcomes that count as failures.
    pub failure_on: Rules,
}

/// Live breaker state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    /// Current state (an `Open` past its time is promoted on the next check).
    pub state: S,
    /// When an open breaker may go half-open.
    pub open_until: u64,
    /// Consecutive trips (for the growing open duration).
    pub trips: u32,
    /// Window contents.
    pub window: WindowState,
    /// Half-open epoch (incremented on every entry to half-open).
    pub epoch: u64,
    /// The half-open episode's trials.
    pub trials: Trials,
    /// Latest `now` seen (a `now` earlier than it counts as no time passed).
    pub last_now: u64,
}

/// A half-open episode's bookkeeping.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HalfOpen {
    /// Live half-open permits: (call, issued at).
    pub permits: Vec<(u64, u64)>,
    /// Half-open permits issued this epoch (reported or live).
    pub issued: u32,
    /// Half-open outcomes this epoch: (calls, failures, slow).
    pub trial: (u32, u32, u32),
}

impl HalfOpen {
    /// Remove `call`'s live permit; whether it had one.
    fn take_back(&mut self, call: u64) -> bool {
        let before = self.permits.len();
        self.permits.retain(|(c, _)| *c != call);
        self.permits.len() < before
    }
}

/// An episode with nothing issued: what [`Trials`] holds until a permit is taken.
static NO_TRIALS: HalfOpen = HalfOpen { permits: Vec::new(), issued: 0, trial: (0, 0, 0) };

/// A breaker's [`HalfOpen`] bookkeeping, boxed when the first permit is taken (or a non-empty
/// episode is imported) and dropped on each entry to half-open. Every key of a keyed policy
/// carries its breaker inline, most of them never go half-open, and the episode's 48 bytes
/// would be a fifth of each key's entry. Equal episodes compare equal whether boxed or not.
#[derive(Clone, Debug, Default)]
pub struct Trials(Option<Box<HalfOpen>>);

impl Trials {
    /// Holds `h`, boxed unless it is empty (an imported episode may have trial counts and no
    /// permit).
    pub fn new(h: HalfOpen) -> Self {
        Trials(if h == NO_TRIALS { None } else { Some(Box::new(h)) })
    }

    /// The episode (the empty one when none is boxed).
    pub fn get(&self) -> &HalfOpen {
        self.0.as_deref().unwrap_or(&NO_TRIALS)
    }

    /// The episode to change, boxed first if it was not.
    fn make(&mut self) -> &mut HalfOpen {
        self.0.get_or_insert_with(Box::default)
    }

    /// The episode to change, if one is boxed (the empty one has nothing to remove or clear).
    fn live(&mut self) -> Option<&mut HalfOpen> {
        self.0.as_deref_mut()
    }
}

impl PartialEq for Trials {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for Trials {}

/// Window contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowState {
    /// Ring of outcomes (bit 0 failure, bit 1 slow) and its counters.
    Count {
        /// Outcomes, oldest overwritten first.
        ring: Vec<u8>,
        /// Next slot.
        pos: u32,
        /// Failures in the ring.
        failures: u32,
        /// Slow calls in the ring.
        slow: u32,
    },
    /// Buckets: (bucket number, calls, failures, slow).
    Time {
        /// Live buckets.
        buckets: Vec<(u64, u32, u32, u32)>,
    },
}

/// Answer of [`Breaker::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Admitted; `permit` when a half-open permit must be taken.
    Allow {
        /// A half-open trial.
        permit: bool,
    },
    /// Rejected; retry-after hint in ns (0 = unknown).
    Reject(u64),
}

fn parse_window(wp: &str, w: &Value, errors: &mut Vec<LoadError>) -> Option<Window> {
    let mut wf = Fields::new(wp, w, errors)?;
    let kind = match wf.take("kind") {
        None => Some(0u8),
        Some(k) => choose(&wf.path_of("kind"), k, &[("count", 0u8), ("time", 1u8)], errors),
    };
    let out = match kind {
        Some(1) => {
            let size = opt_duration(&mut wf, "size", errors, false).unwrap_or(DEFAULT_TIME_WINDOW);
            let bucket = opt_duration(&mut wf, "bucket", errors, false).unwrap_or(DEFAULT_BUCKET);
            if bucket == 0 || size < bucket || size / bucket.max(1) > MAX_BUCKETS {
                errors.push(LoadError::new(wp, "a time window needs 0 < bucket <= size and at most 3600 buckets"));
            }
            Window::Time { size, bucket }
        }
        _ => match wf.take("size") {
            None => DEFAULT_WINDOW,
            Some(s) => match int(s) {
                Some(n) if (1..=i64::from(MAX_WINDOW_CALLS)).contains(&n) => Window::Count(n as u32),
                _ => {
                    errors.push(LoadError::new(
                        &wf.path_of("size"),
                        format!("a count window's size is a number of calls from 1 to 100000, found {}", describe(s)),
                    ));
                    DEFAULT_WINDOW
                }
            },
        },
    };
    wf.finish(&["kind", "size", "bucket"], errors);
    Some(out)
}

/// Parse `breaker`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BreakerCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let window = match b.take("window") {
        None => DEFAULT_WINDOW,
        Some(w) => parse_window(&b.path_of("window"), w, errors)?,
    };
    let failure_rate = fraction(&mut b, "failure-rate", DEFAULT_FAILURE_RATE, 0.001, 100.0, errors);
    let slow_call_rate = fraction(&mut b, "slow-call-rate", DEFAULT_SLOW_CALL_RATE, 0.001, 100.0, errors);
    let slow_call_duration = opt_duration(&mut b, "slow-call-duration", errors, false).unwrap_or(DEFAULT_SLOW_CALL_DURATION);
    let minimum_calls = uint(&mut b, "minimum-calls", DEFAULT_MINIMUM_CALLS, 1, 1_000_000, errors);
    let open_duration = opt_duration(&mut b, "open-duration", errors, false).unwrap_or(DEFAULT_OPEN_DURATION);
    let open_duration_max = opt_duration(&mut b, "open-duration-max", errors, false).unwrap_or(open_duration);
    if open_duration_max < open_duration {
        errors.push(LoadError::new(&b.path_of("open-duration-max"), "must not be below open-duration"));
    }
    let open_duration_multiplier = fraction(&mut b, "open-duration-multiplier", DEFAULT_OPEN_DURATION_MULTIPLIER, 1.0, 1000.0, errors);
    let half_open_permits = uint(&mut b, "half-open-permits", DEFAULT_HALF_OPEN_PERMITS, 1, 10_000, errors);
    let half_open_permit_timeout =
        opt_duration(&mut b, "half-open-permit-timeout", errors, false).unwrap_or(DEFAULT_HALF_OPEN_PERMIT_TIMEOUT);
    if half_open_permit_timeout == 0 {
        errors.push(LoadError::new(&b.path_of("half-open-permit-timeout"), "must be above 0"));
    }
    let failure_on = classify::parse_rules(&mut b, "failure-on", classify::DEFAULT_BREAKER_FAILURE_ON, errors);
    b.finish(FIELDS, errors);
    Some(BreakerCfg {
        window,
        failure_rate,
        slow_call_rate,
        slow_call_duration,
        minimum_calls,
        open_duration,
        open_duration_max,
        open_duration_multiplier,
        half_open_permits,
        half_open_permit_timeout,
        failure_on,
    })
}

impl Window {
    /// The window as exported state's fingerprint shows it (sizes in ns): a state is kept
    /// across a reload only under the same fingerprint.
    pub(crate) fn fingerprint(&self) -> Value {
        match *self {
            Window::Count(n) => obj([("kind", "count".into()), ("size", n.into())]),
            Window::Time { size, bucket } => obj([("kind", "time".into()), ("size", size.into()), ("bucket", bucket.into())]),
        }
    }
}

impl BreakerCfg {
    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([
            (
                "window",
                match self.window {
                    Window::Count(n) => obj([("kind", "count".into()), ("size", n.into())]),
                    Window::Time { size, bucket } => {
                        obj([("kind", "time".into()), ("size", format_duration(size).into()), ("bucket", format_duration(bucket).into())])
                    }
                },
            ),
            ("failure-rate", self.failure_rate.into()),
            ("slow-call-rate", self.slow_call_rate.into()),
            ("slow-call-duration", format_duration(self.slow_call_duration).into()),
            ("minimum-calls", self.minimum_calls.into()),
            ("open-duration", format_duration(self.open_duration).into()),
            ("open-duration-max", format_duration(self.open_duration_max).into()),
            ("open-duration-multiplier", self.open_duration_multiplier.into()),
            ("half-open-permits", self.half_open_permits.into()),
            ("half-open-permit-timeout", format_duration(self.half_open_permit_timeout).into()),
            ("failure-on", self.failure_on.texts().into()),
        ])
    }

    /// Import a breaker's exported state (see [`Breaker::to_json`]); its window is kept only
    /// when `same_window`.
    pub(crate) fn import(&self, b: &Value, bp: &str, same_window: bool) -> Result<Breaker, LoadError> {
        let state = b
            .get("state")
            .and_then(Value::as_str)
            .and_then(S::from_name)
            .ok_or_else(|| LoadError::new(&format!("{bp}.state"), "is not a breaker state"))?;
        let trial = pairs(Some(&Value::List(vec![b.get("trial").cloned().unwrap_or(Value::Null)])), &format!("{bp}.trial"), 3)?;
        let trial = trial.first().cloned().unwrap_or_default();
        let t = |i: usize| trial.get(i).copied().unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32;
        let window_v = b.get("window").ok_or_else(|| LoadError::new(&format!("{bp}.window"), "is missing"))?;
        let window = if let Some(c) = window_v.get("count") {
            let wp = format!("{bp}.window.count");
            let ring: Vec<u8> = c
                .get("ring")
                .and_then(Value::as_list)
                .ok_or_else(|| LoadError::new(&wp, "ring must be a list"))?
                .iter()
                .map(|x| x.as_u64().filter(|b| *b < 4).map(|b| b as u8).ok_or_else(|| LoadError::new(&wp, "ring entries are 0 to 3")))
                .collect::<Result<_, _>>()?;
            let failures = ring.iter().filter(|b| *b & 1 != 0).count() as u32;
            let slow = ring.iter().filter(|b| *b & 2 != 0).count() as u32;
            let pos = u32_at(c, "pos", &wp)?;
            let size = match self.window {
                Window::Count(n) => n.max(1),
                Window::Time { .. } => 1,
            };
            WindowState::Count { pos: pos % size, ring, failures, slow }
        } else if let Some(t) = window_v.get("time") {
            let rows = pairs(Some(t), &format!("{bp}.window.time"), 4)?;
            let clamp = |x: i64| x.clamp(0, i64::from(u32::MAX)) as u32;
            WindowState::Time {
                buckets: rows
                    .iter()
                    .map(|r| {
                        (
                            r.first().copied().unwrap_or(0).max(0) as u64,
                            clamp(r.get(1).copied().unwrap_or(0)),
                            clamp(r.get(2).copied().unwrap_or(0)),
                            clamp(r.get(3).copied().unwrap_or(0)),
                        )
                    })
                    .collect(),
            }
        } else {
            return Err(LoadError::new(&format!("{bp}.window"), "must be {\"count\": ...} or {\"time\": ...}"));
        };
        let permits = pairs(b.get("permits"), &format!("{bp}.permits"), 2)?
            .iter()
            .map(|r| (r.first().copied().unwrap_or(0) as u64, r.get(1).copied().unwrap_or(0) as u64))
            .collect();
        let imported = Breaker {
            state,
            open_until: u64_at(b, "open_until", bp)?,
            trips: u32_at(b, "trips", bp)?,
            window,
            epoch: u64_at(b, "epoch", bp)?,
            trials: Trials::new(HalfOpen { permits, issued: u32_at(b, "issued", bp)?, trial: (t(0), t(1), t(2)) }),
            last_now: u64_at(b, "last_now", bp)?,
        };
        Ok(self.adopt(imported, same_window))
    }

    /// Open duration after `trips` consecutive trips.
    pub fn open_for(&self, trips: u32) -> u64 {
        crate::backoff::exponential(
            self.open_duration,
            self.open_duration_multiplier,
            trips.saturating_sub(1),
            self.open_duration_max.max(self.open_duration),
        )
    }

    /// A fresh, closed breaker.
    pub fn fresh(&self) -> Breaker {
        Breaker { state: S::Closed, open_until: 0, trips: 0, window: self.empty_window(), epoch: 0, trials: Trials::default(), last_now: 0 }
    }

    fn empty_window(&self) -> WindowState {
        match self.window {
            Window::Count(_) => WindowState::Count { ring: Vec::new(), pos: 0, failures: 0, slow: 0 },
            Window::Time { .. } => WindowState::Time { buckets: Vec::new() },
        }
    }

    fn window_matches(&self, w: &WindowState) -> bool {
        match (&self.window, w) {
            (Window::Count(n), WindowState::Count { ring, .. }) => ring.len() <= *n as usize,
            (Window::Time { .. }, WindowState::Time { .. }) => true,
            _ => false,
        }
    }

    /// Keep what applies of an imported breaker under this configuration.
    pub fn adopt(&self, mut b: Breaker, same_window: bool) -> Breaker {
        if !same_window || !self.window_matches(&b.window) {
            b.window = self.empty_window();
        }
        if let Some(h) = b.trials.live() {
            h.permits.truncate(self.half_open_permits as usize);
            h.issued = h.issued.min(self.half_open_permits);
        }
        b
    }
}

impl Breaker {
    /// As exported state.
    pub(crate) fn to_json(&self) -> Value {
        let window = match &self.window {
            WindowState::Count { ring, pos, failures, slow } => obj([(
                "count",
                obj([
                    ("ring", Value::List(ring.iter().map(|x| u32::from(*x).into()).collect())),
                    ("pos", (*pos).into()),
                    ("failures", (*failures).into()),
                    ("slow", (*slow).into()),
                ]),
            )]),
            WindowState::Time { buckets } => {
                obj([("time", rows(buckets.iter().map(|(i, c, f, s)| [*i, u64::from(*c), u64::from(*f), u64::from(*s)])))])
            }
        };
        let h = self.trials.get();
        obj([
            ("state", self.state.name().into()),
            ("open_until", self.open_until.into()),
            ("trips", self.trips.into()),
            ("epoch", self.epoch.into()),
            ("permits", rows(h.permits.iter().map(|(c, at)| [*c, *at]))),
            ("issued", h.issued.into()),
            ("trial", Value::List(vec![h.trial.0.into(), h.trial.1.into(), h.trial.2.into()])),
            ("last_now", self.last_now.into()),
            ("window", window),
        ])
    }

    /// The state at `now` without changing anything (an expired open reads half-open).
    pub fn peek(&self, now: u64) -> S {
        if self.state == S::Open && now.max(self.last_now) >= self.open_until {
            S::HalfOpen
        } else {
            self.state
        }
    }

    /// When this breaker will next admit an attempt, if it rejects every attempt until then:
    /// an open breaker until its open duration ends (it is half-open from then on), a forced-open
    /// one until an operator changes it (`u64::MAX`). `None` when an attempt may pass now or
    /// later for reasons not yet known (closed, half-open trials, forced-closed, disabled).
    pub fn rejects_until(&self) -> Option<u64> {
        match self.state {
            S::Open => Some(self.open_until),
            S::ForcedOpen => Some(u64::MAX),
            _ => None,
        }
    }

    fn advance(&mut self, now: u64) -> u64 {
        self.last_now = self.last_now.max(now);
        self.last_now
    }

    fn enter(&mut self, cfg: &BreakerCfg, to: S, now: u64, transitions: &mut Vec<(S, S)>) {
        let from = self.state;
        if from == to {
            return;
        }
        match to {
            S::Open => {
                self.trips = self.trips.saturating_add(1);
                self.open_until = now.saturating_add(cfg.open_for(self.trips));
                self.window = cfg.empty_window();
            }
            S::HalfOpen => {
                self.epoch = self.epoch.wrapping_add(1);
                self.trials = Trials::default();
            }
            S::Closed => {
                self.trips = 0;
                self.window = cfg.empty_window();
                self.drop_permits();
            }
            S::ForcedOpen | S::ForcedClosed | S::Disabled => self.drop_permits(),
        }
        self.state = to;
        transitions.push((from, to));
    }

    /// Before an attempt: time-driven transitions and permit expiry, then the answer.
    /// Returns the calls whose half-open permits expired.
    pub fn check(&mut self, cfg: &BreakerCfg, now: u64, transitions: &mut Vec<(S, S)>, expired: &mut Vec<u64>) -> Check {
        let now = self.advance(now);
        if self.state == S::Open && now >= self.open_until {
            self.enter(cfg, S::HalfOpen, now, transitions);
        }
        match self.state {
            S::Closed | S::ForcedClosed | S::Disabled => Check::Allow { permit: false },
            S::Open => Check::Reject(self.open_until.saturating_sub(now)),
            S::ForcedOpen => Check::Reject(0),
            S::HalfOpen => {
                let timeout = cfg.half_open_permit_timeout;
                if let Some(h) = self.trials.live() {
                    let before = h.permits.len();
                    h.permits.retain(|(call, at)| {
                        let keep = at.saturating_add(timeout) > now;
                        if !keep {
                            expired.push(*call);
                        }
                        keep
                    });
                    let gone = (before - h.permits.len()) as u32;
                    h.issued = h.issued.saturating_sub(gone);
                }
                let h = self.trials.get();
                if h.issued < cfg.half_open_permits {
                    Check::Allow { permit: true }
                } else {
                    let next_expiry = h.permits.iter().map(|(_, at)| at.saturating_add(timeout)).min().unwrap_or(now);
                    Check::Reject(next_expiry.saturating_sub(now))
                }
            }
        }
    }

    /// Take a half-open permit for `call` (after `check` said `permit`).
    pub fn take_permit(&mut self, call: u64, now: u64) {
        let at = now.max(self.last_now);
        let h = self.trials.make();
        h.permits.push((call, at));
        h.issued = h.issued.saturating_add(1);
    }

    /// A call gave its permit back without an outcome (cancelled).
    pub fn give_back(&mut self, call: u64) {
        if let Some(h) = self.trials.live() {
            if h.take_back(call) {
                h.issued = h.issued.saturating_sub(1);
            }
        }
    }

    /// Leaving half-open: its live permits are void (what was issued and tried stays, as
    /// exported state shows it).
    fn drop_permits(&mut self) {
        if let Some(h) = self.trials.live() {
            h.permits.clear();
        }
    }

    /// Record an outcome of `call` that ran while the breaker admitted it.
    pub fn record(&mut self, cfg: &BreakerCfg, call: u64, now: u64, failure: bool, slow: bool, transitions: &mut Vec<(S, S)>) {
        let now = self.advance(now);
        match self.state {
            S::Closed | S::ForcedClosed => {
                self.push(cfg, now, failure, slow);
                if self.state == S::Closed && self.should_trip(cfg, now) {
                    self.enter(cfg, S::Open, now, transitions);
                }
            }
            S::HalfOpen => {
                let Some(h) = self.trials.live() else { return };
                if !h.take_back(call) {
                    return; // not a trial of this half-open episode
                }
                let (calls, failures, slows) = h.trial;
                h.trial = (calls.saturating_add(1), failures.saturating_add(u32::from(failure)), slows.saturating_add(u32::from(slow)));
                let (c, f, s) = h.trial;
                if c >= cfg.half_open_permits {
                    if over(f, c, cfg.failure_rate) || over(s, c, cfg.slow_call_rate) {
                        self.enter(cfg, S::Open, now, transitions);
                    } else {
                        self.enter(cfg, S::Closed, now, transitions);
                    }
                }
            }
            S::Open | S::ForcedOpen | S::Disabled => {}
        }
    }

    /// An operator sets a state: forced-open, forced-closed, disabled, or closed (back to
    /// normal with a fresh window, resilience4j's `reset()`: also when it is closed already,
    /// so that the outcomes recorded before the reset never trip it).
    pub fn force(&mut self, cfg: &BreakerCfg, to: S, now: u64, transitions: &mut Vec<(S, S)>) -> Result<(), String> {
        let now = self.advance(now);
        match to {
            S::ForcedOpen | S::ForcedClosed | S::Disabled | S::Closed => {
                if to == S::Closed {
                    let from = self.state;
                    *self = Breaker { epoch: self.epoch, last_now: now, ..cfg.fresh() };
                    if from != S::Closed {
                        transitions.push((from, S::Closed));
                    }
                    return Ok(());
                }
                self.enter(cfg, to, now, transitions);
                Ok(())
            }
            S::Open | S::HalfOpen => Err(format!(
                "`{}` is reached by the breaker itself; an operator sets forced-open, forced-closed, disabled or closed",
                to.name()
            )),
        }
    }

    fn push(&mut self, cfg: &BreakerCfg, now: u64, failure: bool, slow: bool) {
        let bits = u8::from(failure) | (u8::from(slow) << 1);
        match (&cfg.window, &mut self.window) {
            (Window::Count(n), WindowState::Count { ring, pos, failures, slow: slows }) => {
                let n = (*n).max(1) as usize;
                if ring.len() < n {
                    ring.push(bits);
                } else if let Some(old) = ring.get_mut(*pos as usize) {
                    *failures = failures.saturating_sub(u32::from(*old & 1));
                    *slows = slows.saturating_sub(u32::from((*old >> 1) & 1));
                    *old = bits;
                }
                *failures = failures.saturating_add(u32::from(failure));
                *slows = slows.saturating_add(u32::from(slow));
                *pos = ((*pos as usize + 1) % n) as u32;
            }
            (Window::Time { size, bucket }, WindowState::Time { buckets }) => {
                let b = (*bucket).max(1);
                let idx = now / b;
                let span = (size / b).max(1);
                buckets.retain(|(i, ..)| i.saturating_add(span) > idx && *i <= idx);
                match buckets.iter_mut().find(|(i, ..)| *i == idx) {
                    Some((_, c, f, s)) => {
                        *c = c.saturating_add(1);
                        *f = f.saturating_add(u32::from(failure));
                        *s = s.saturating_add(u32::from(slow));
                    }
                    None => buckets.push((idx, 1, u32::from(failure), u32::from(slow))),
                }
            }
            _ => self.window = cfg.empty_window(),
        }
    }

    /// (calls, failures, slow) in the window at `now`.
    pub fn totals(&self, cfg: &BreakerCfg, now: u64) -> (u32, u32, u32) {
        match (&cfg.window, &self.window) {
            (Window::Count(_), WindowState::Count { ring, failures, slow, .. }) => (ring.len() as u32, *failures, *slow),
            (Window::Time { size, bucket }, WindowState::Time { buckets }) => {
                let b = (*bucket).max(1);
                let idx = now / b;
                let span = (size / b).max(1);
                buckets
                    .iter()
                    .filter(|(i, ..)| i.saturating_add(span) > idx && *i <= idx)
                    .fold((0u32, 0u32, 0u32), |(c, f, s), (_, bc, bf, bs)| {
                        (c.saturating_add(*bc), f.saturating_add(*bf), s.saturating_add(*bs))
                    })
            }
            _ => (0, 0, 0),
        }
    }

    fn should_trip(&self, cfg: &BreakerCfg, now: u64) -> bool {
        let (calls, failures, slow) = self.totals(cfg, now);
        let needed = match cfg.window {
            Window::Count(n) => cfg.minimum_calls.min(n),
            Window::Time { .. } => cfg.minimum_calls,
        }
        .max(1);
        calls >= needed && (over(failures, calls, cfg.failure_rate) || over(slow, calls, cfg.slow_call_rate))
    }
}

fn over(part: u32, calls: u32, threshold: f64) -> bool {
    calls > 0 && f64::from(part) * 100.0 >= threshold * f64::from(calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Rules;

    fn cfg() -> BreakerCfg {
        BreakerCfg {
            window: Window::Count(4),
            failure_rate: 50.0,
            slow_call_rate: 100.0,
            slow_call_duration: 1_000,
            minimum_calls: 4,
            open_duration: 100,
            open_duration_max: 400,
            open_duration_multiplier: 2.0,
            half_open_permits: 2,
            half_open_permit_timeout: 50,
            failure_on: Rules::default(),
        }
    }

    #[test]
    fn trips_half_opens_and_closes() {
        let c = cfg();
        let mut b = c.fresh();
        let mut t = Vec::new();
        let mut exp = Vec::new();
        for (i, f) in [false, true, false].iter().enumerate() {
            b.record(&c, i as u64, 0, *f, false, &mut t);
        }
        assert_eq!(b.state, S::Closed, "minimum calls not reached");
        b.record(&c, 3, 0, true, false, &mut t);
        assert_eq!(b.state, S::Open);
        assert_eq!(b.check(&c, 50, &mut t, &mut exp), Check::Reject(50));
        assert_eq!(b.check(&c, 100, &mut t, &mut exp), Check::Allow { permit: true });
        b.take_permit(10, 100);
        assert_eq!(b.check(&c, 100, &mut t, &mut exp), Check::Allow { permit: true });
        b.take_permit(11, 100);
        assert!(matches!(b.check(&c, 100, &mut t, &mut exp), Check::Reject(_)));
        b.record(&c, 10, 101, false, false, &mut t);
        b.record(&c, 99, 101, true, false, &mut t); // not a trial: ignored
        b.record(&c, 11, 102, false, false, &mut t);
        assert_eq!(b.state, S::Closed);
        assert_eq!(t, vec![(S::Closed, S::Open), (S::Open, S::HalfOpen), (S::HalfOpen, S::Closed)]);
    }

    #[test]
    fn the_half_open_episode_is_boxed_only_once_a_permit_is_taken() {
        let c = cfg();
        let mut b = c.fresh();
        let (mut t, mut exp) = (Vec::new(), Vec::new());
        #[cfg(target_pointer_width = "64")]
        assert_eq!(std::mem::size_of::<Breaker>(), 80, "the episode's bookkeeping is not inline");
        for i in 0..4 {
            b.record(&c, i, 0, true, false, &mut t);
        }
        assert!(b.trials.0.is_none(), "closed, then open: nothing issued, nothing boxed");
        assert_eq!(b.check(&c, 100, &mut t, &mut exp), Check::Allow { permit: true });
        assert!(b.trials.0.is_none(), "half-open with nothing issued");
        b.take_permit(7, 100);
        assert_eq!(b.trials.get(), &HalfOpen { permits: vec![(7, 100)], issued: 1, trial: (0, 0, 0) });
        b.give_back(7);
        // Boxed and empty, or never boxed: the same episode, the same export.
        let empty = Breaker { trials: Trials::default(), ..b.clone() };
        assert!(b.trials.0.is_some());
        assert_eq!(b, empty);
        assert_eq!(b.to_json(), empty.to_json());
        assert_eq!(Trials::new(HalfOpen::default()).0, None);
    }

    #[test]
    fn permits_expire_and_open_duration_grows() {
        let c = cfg();
        let mut b = c.fresh();
        let (mut t, mut exp) = (Vec::new(), Vec::new());
        for i in 0..4 {
            b.record(&c, i, 0, true, false, &mut t);
        }
        assert_eq!(b.open_until, 100);
        b.check(&c, 100, &mut t, &mut exp);
        b.take_permit(1, 100);
        b.take_permit(2, 100);
        assert_eq!(b.check(&c, 149, &mut t, &mut exp), Check::Reject(1));
        assert_eq!(b.check(&c, 150, &mut t, &mut exp), Check::Allow { permit: true });
        assert_eq!(exp, vec![1, 2]);
        b.take_permit(3, 150);
        b.take_permit(4, 150);
        b.record(&c, 3, 151, true, false, &mut t);
        b.record(&c, 4, 151, true, false, &mut t);
        assert_eq!(b.state, S::Open);
        assert_eq!(b.open_until, 151 + 200, "second trip doubles");
        assert_eq!(c.open_for(10), 400, "capped");
        assert!(b.force(&c, S::HalfOpen, 0, &mut t).is_err());
    }
}
