//! Telemetry in the schema every Levee host emits (docs/telemetry.md): events, counters, an
//! attempt-duration histogram and a breaker-state gauge, all in seconds, with the names of
//! [`crate::constants`].
//!
//! A [`Telemetry`] sink receives them ([`crate::Builder::telemetry`]). The default sink,
//! [`Standard`], turns events into `tracing` events (target `levee`, one field per attribute,
//! inside the call's `levee.call` span) and the instruments into the `metrics` facade
//! (`levee.calls`, `levee.attempts`, `levee.attempt.duration`, `levee.retries`,
//! `levee.retry.delay`, `levee.rejections`, `levee.fallbacks`, `levee.hedges`,
//! `levee.breaker.transitions`, `levee.breaker.state`, `levee.engine.faults`, `levee.keys.evicted`,
//! `levee.keys.overflow`), described to
//! the recorder with the units and descriptions of the contract
//! ([`crate::constants::INSTRUMENTS`]), which an OpenTelemetry or Prometheus exporter of
//! `metrics` publishes (seconds, `# HELP`).

use std::sync::atomic::{AtomicUsize, Ordering};

use levee_core::{Event, EventKind};

use crate::constants as k;

/// An attribute's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// A string.
    Str(&'a str),
    /// An integer.
    Int(i64),
    /// A number (seconds, for times).
    Float(f64),
    /// A boolean.
    Bool(bool),
}

impl std::fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Str(s) => f.write_str(s),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// Attributes: names from [`crate::constants`] (`levee.policy`, `levee.reason`, ...).
pub type Attributes<'a> = [(&'static str, Value<'a>)];

/// Where telemetry goes (docs/telemetry.md, "How a host delivers it").
pub trait Telemetry: Send + Sync + 'static {
    /// An event (`retry-scheduled`, ..., `engine-fault`), in the order the core recorded it.
    fn event(&self, name: &str, attributes: &Attributes<'_>);
    /// A counter increment.
    fn add(&self, counter: &'static str, value: u64, attributes: &Attributes<'_>);
    /// A histogram sample, in seconds.
    fn record(&self, histogram: &'static str, value: f64, attributes: &Attributes<'_>);
    /// A gauge's new value.
    fn gauge(&self, gauge: &'static str, value: f64, attributes: &Attributes<'_>);
}

/// The default sink: `tracing` events (target `levee`) and the `metrics` facade, the names and
/// attributes of docs/telemetry.md. `levee.key` is on the breaker gauge only, and dropped
/// from it too with [`Standard::without_gauge_key`].
#[derive(Clone, Copy, Debug)]
pub struct Standard {
    gauge_key: bool,
}

impl Standard {
    /// The default sink.
    pub const fn new() -> Self {
        Standard { gauge_key: true }
    }

    /// Leave `levee.key` off the breaker-state gauge (one series per policy instead of per key).
    pub const fn without_gauge_key(self) -> Self {
        Standard { gauge_key: false }
    }
}

impl Default for Standard {
    fn default() -> Self {
        Standard::new()
    }
}

/// Whether a `metrics` recorder is installed (locally or globally): the facade's stand-in is
/// its zero-sized no-op recorder. Labels are built only then, so that a process without a
/// recorder pays no allocation per call. The first time a recorder is seen, the instruments
/// are described to it.
#[inline]
fn recording() -> bool {
    let id =
        metrics::with_recorder(
            |r| if std::mem::size_of_val(r) == 0 { 0 } else { (r as *const dyn metrics::Recorder).cast::<()>() as usize },
        );
    if id == 0 {
        return false;
    }
    if DESCRIBED.load(Ordering::Relaxed) != id {
        DESCRIBED.store(id, Ordering::Relaxed);
        describe();
    }
    true
}

/// The recorder the instruments were last described to (its address; 0: none yet).
static DESCRIBED: AtomicUsize = AtomicUsize::new(0);

/// The unit of the `metrics` facade for a unit of the contract (UCUM): `s` is seconds, an
/// annotation (`{call}`, `{attempt}`, ...) a count, and `1` (the breaker state) none.
fn unit_of(unit: &str) -> Option<metrics::Unit> {
    match unit {
        "s" => Some(metrics::Unit::Seconds),
        u if u.starts_with('{') => Some(metrics::Unit::Count),
        _ => None,
    }
}

/// Describe every instrument of the schema to the installed `metrics` recorder: its unit and
/// description, from the contract ([`k::INSTRUMENTS`]). [`Standard`] does it when it first
/// records to a recorder; call it yourself to have the descriptions before any call.
pub fn describe() {
    metrics::with_recorder(|r| {
        for (name, kind, unit, help) in k::INSTRUMENTS {
            let (name, unit, help) = (metrics::KeyName::from_const_str(name), unit_of(unit), metrics::SharedString::const_str(help));
            match kind {
                "histogram" => r.describe_histogram(name, unit, help),
                "gauge" => r.describe_gauge(name, unit, help),
                _ => r.describe_counter(name, unit, help),
            }
        }
    });
}

fn labels(attributes: &Attributes<'_>) -> Vec<metrics::Label> {
    attributes.iter().map(|(n, v)| metrics::Label::new(*n, v.to_string())).collect()
}

/// An event's attributes as `tracing` fields: one field per attribute of the schema, named as
/// the contract names it (`levee.policy`, ...), absent when the event has no such attribute.
#[derive(Default)]
struct EventFields<'a> {
    policy: Option<&'a str>,
    key: Option<&'a str>,
    call: Option<i64>,
    attempt: Option<i64>,
    delay: Option<f64>,
    reason: Option<&'a str>,
    from: Option<&'a str>,
    to: Option<&'a str>,
    fallback: Option<&'a str>,
    budget_level: Option<i64>,
    fault: Option<&'a str>,
    /// Attributes of no field above (none today; kept, not dropped).
    other: Vec<(&'static str, Value<'a>)>,
}

impl<'a> EventFields<'a> {
    fn of(attributes: &Attributes<'a>) -> Self {
        let mut f = EventFields::default();
        for &(name, v) in attributes {
            match (name, v) {
                (k::ATTR_POLICY, Value::Str(s)) => f.policy = Some(s),
                (k::ATTR_KEY, Value::Str(s)) => f.key = Some(s),
                (k::ATTR_CALL, Value::Int(i)) => f.call = Some(i),
                (k::ATTR_ATTEMPT, Value::Int(i)) => f.attempt = Some(i),
                (k::ATTR_DELAY, Value::Float(x)) => f.delay = Some(x),
                (k::ATTR_REASON, Value::Str(s)) => f.reason = Some(s),
                (k::ATTR_BREAKER_FROM, Value::Str(s)) => f.from = Some(s),
                (k::ATTR_BREAKER_TO, Value::Str(s)) => f.to = Some(s),
                (k::ATTR_FALLBACK, Value::Str(s)) => f.fallback = Some(s),
                (k::ATTR_BUDGET_LEVEL, Value::Int(i)) => f.budget_level = Some(i),
                (k::ATTR_FAULT, Value::Str(s)) => f.fault = Some(s),
                _ => f.other.push((name, v)),
            }
        }
        f
    }
}

/// Whether two strings are equal, at compile time.
#[allow(clippy::indexing_slicing)] // `i` < both lengths
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// `tracing` takes an event's field names as written in the macro (below): the build fails
// unless they are still the contract's attribute names (wit/constants.json).
const _: () = assert!(
    same(k::ATTR_POLICY, "levee.policy")
        && same(k::ATTR_KEY, "levee.key")
        && same(k::ATTR_CALL, "levee.call")
        && same(k::ATTR_ATTEMPT, "levee.attempt")
        && same(k::ATTR_DELAY, "levee.delay")
        && same(k::ATTR_REASON, "levee.reason")
        && same(k::ATTR_BREAKER_FROM, "levee.breaker.from")
        && same(k::ATTR_BREAKER_TO, "levee.breaker.to")
        && same(k::ATTR_FALLBACK, "levee.fallback")
        && same(k::ATTR_BUDGET_LEVEL, "levee.budget.level")
        && same(k::ATTR_FAULT, "levee.fault"),
    "an event field of Standard::event is not the contract's attribute name"
);

impl Telemetry for Standard {
    fn event(&self, name: &str, attributes: &Attributes<'_>) {
        // One field per attribute, named as the contract names it (checked above at build time).
        let f = EventFields::of(attributes);
        let other = (!f.other.is_empty()).then(|| tracing::field::debug(Fields(f.other.as_slice())));
        macro_rules! levee_event {
            ($level:ident, $message:literal) => {
                tracing::$level!(target: "levee", event = name, levee.policy = f.policy, levee.key = f.key, levee.call = f.call,
                    levee.attempt = f.attempt, levee.delay = f.delay, levee.reason = f.reason, levee.breaker.from = f.from,
                    levee.breaker.to = f.to, levee.fallback = f.fallback, levee.budget.level = f.budget_level, levee.fault = f.fault,
                    attributes = other, $message)
            };
        }
        if name == k::EVENT_ENGINE_FAULT {
            levee_event!(error, "policy engine fault; the call finishes degraded");
        } else {
            levee_event!(debug, "levee event");
        }
    }

    fn add(&self, counter: &'static str, value: u64, attributes: &Attributes<'_>) {
        if !recording() {
            return;
        }
        metrics::counter!(counter, labels(attributes)).increment(value);
    }

    fn record(&self, histogram: &'static str, value: f64, attributes: &Attributes<'_>) {
        if !recording() {
            return;
        }
        metrics::histogram!(histogram, labels(attributes)).record(value);
    }

    fn gauge(&self, gauge: &'static str, value: f64, attributes: &Attributes<'_>) {
        if !recording() {
            return;
        }
        let attrs: Vec<metrics::Label> = if self.gauge_key {
            labels(attributes)
        } else {
            attributes.iter().filter(|(n, _)| *n != k::ATTR_KEY).map(|(n, v)| metrics::Label::new(*n, v.to_string())).collect()
        };
        metrics::gauge!(gauge, attrs).set(value);
    }
}

struct Fields<'a, 'b>(&'a Attributes<'b>);

impl std::fmt::Debug for Fields<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_map();
        for (n, v) in self.0 {
            m.entry(n, &format_args!("{v}"));
        }
        m.finish()
    }
}

/// Seconds of a duration in ns, as the schema writes every time.
pub(crate) fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The event name of a core event kind.
pub(crate) fn event_name(kind: EventKind) -> &'static str {
    k::EVENT_KINDS.get(kind as usize).copied().unwrap_or("unknown")
}

/// Emit one core event and the instruments it drives; `policy` is the policy's name.
pub(crate) fn emit(sink: &dyn Telemetry, e: &Event, policy: &str) {
    let reason = e.reason.name();
    let delay = secs(e.duration);
    let base = [(k::ATTR_POLICY, Value::Str(policy)), (k::ATTR_KEY, Value::Str(&e.key))];
    let call = (e.call != 0).then_some((k::ATTR_CALL, Value::Int(e.call as i64)));
    let attempt = (k::ATTR_ATTEMPT, Value::Int(i64::from(e.attempt)));
    let own: Vec<(&'static str, Value<'_>)> = match e.kind {
        EventKind::RetryScheduled => vec![attempt, (k::ATTR_DELAY, Value::Float(delay))],
        EventKind::GaveUp => vec![attempt, (k::ATTR_REASON, Value::Str(reason))],
        EventKind::Rejected => vec![attempt, (k::ATTR_REASON, Value::Str(reason)), (k::ATTR_DELAY, Value::Float(delay))],
        EventKind::BudgetRefused => vec![attempt, (k::ATTR_BUDGET_LEVEL, Value::Int(e.value))],
        EventKind::BreakerTransition => {
            vec![(k::ATTR_BREAKER_FROM, Value::Str(e.state_from.name())), (k::ATTR_BREAKER_TO, Value::Str(e.state_to.name()))]
        }
        EventKind::FallbackChosen => vec![(k::ATTR_FALLBACK, Value::Str(&e.name)), (k::ATTR_REASON, Value::Str(reason))],
        EventKind::RateLimitWait => vec![attempt, (k::ATTR_DELAY, Value::Float(delay))],
        EventKind::HedgeStarted => vec![attempt],
        EventKind::KeyEvicted | EventKind::KeyOverflow | EventKind::CallEvicted | EventKind::PermitExpired => Vec::new(),
    };
    // A key eviction names the evicted key; a key overflow the caller's key (its `key` is the
    // shared overflow entry, `levee:overflow`).
    let key = if matches!(e.kind, EventKind::KeyEvicted | EventKind::KeyOverflow) { e.name.as_str() } else { e.key.as_str() };
    let mut attrs: Vec<(&'static str, Value<'_>)> = vec![base[0], (k::ATTR_KEY, Value::Str(key))];
    attrs.extend(call);
    attrs.extend(own);
    sink.event(event_name(e.kind), &attrs);
    let p = (k::ATTR_POLICY, Value::Str(policy));
    match e.kind {
        EventKind::RetryScheduled => {
            sink.add(k::METRIC_RETRIES, 1, &[p]);
            sink.record(k::METRIC_RETRY_DELAY, delay, &[p]);
        }
        EventKind::HedgeStarted => sink.add(k::METRIC_HEDGES, 1, &[p]),
        // Per policy only, as every counter here (a key on a counter is a series per key).
        EventKind::KeyEvicted => sink.add(k::METRIC_KEYS_EVICTED, 1, &[p]),
        EventKind::KeyOverflow => sink.add(k::METRIC_KEYS_OVERFLOW, 1, &[p]),
        EventKind::Rejected => sink.add(k::METRIC_REJECTIONS, 1, &[p, (k::ATTR_REASON, Value::Str(reason))]),
        EventKind::FallbackChosen => {
            sink.add(k::METRIC_FALLBACKS, 1, &[(k::ATTR_FALLBACK, Value::Str(&e.name)), p, (k::ATTR_REASON, Value::Str(reason))])
        }
        EventKind::BreakerTransition => {
            let (from, to) = (Value::Str(e.state_from.name()), Value::Str(e.state_to.name()));
            sink.add(k::METRIC_BREAKER_TRANSITIONS, 1, &[(k::ATTR_BREAKER_FROM, from), (k::ATTR_BREAKER_TO, to), p]);
            sink.gauge(k::METRIC_BREAKER_STATE, f64::from(e.state_to as u8), &[(k::ATTR_KEY, Value::Str(&e.key)), p]);
        }
        _ => {}
    }
}

/// Why a call went down the recovery path (docs/hosts.md, section 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The guest trapped or ran past its bound.
    Trap,
    /// A verdict broke the contract (docs/hosts.md, section 2).
    Contract,
    /// The core answered `invalid` for a call this host started (evicted, or of a replaced
    /// instance).
    Invalid,
}

impl Fault {
    /// `trap`, `contract` or `invalid`.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Trap => "trap",
            Fault::Contract => "contract",
            Fault::Invalid => "invalid",
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The `engine-fault` event and its counter.
pub(crate) fn fault(sink: &dyn Telemetry, fault: Fault, policy: &str, key: &str, call: u64) {
    let name = Value::Str(fault.name());
    sink.event(
        k::EVENT_ENGINE_FAULT,
        &[
            (k::ATTR_POLICY, Value::Str(policy)),
            (k::ATTR_KEY, Value::Str(key)),
            (k::ATTR_CALL, Value::Int(call as i64)),
            (k::ATTR_FAULT, name),
        ],
    );
    sink.add(k::METRIC_ENGINE_FAULTS, 1, &[(k::ATTR_FAULT, name)]);
}

/// An attempt was reported (or its success held back): `levee.attempts` and its duration.
#[inline]
pub(crate) fn attempt(sink: &dyn Telemetry, policy: &str, outcome: &'static str, elapsed: u64) {
    let attrs = [(k::ATTR_OUTCOME, Value::Str(outcome)), (k::ATTR_POLICY, Value::Str(policy))];
    sink.add(k::METRIC_ATTEMPTS, 1, &attrs);
    sink.record(k::METRIC_ATTEMPT_DURATION, secs(elapsed), &attrs);
}

/// A call ended: `levee.calls`.
#[inline]
pub(crate) fn call(sink: &dyn Telemetry, policy: &str, result: &'static str, retried: bool, reason: Option<&'static str>) {
    let p = (k::ATTR_POLICY, Value::Str(policy));
    let r = (k::ATTR_RESULT, Value::Str(result));
    let t = (k::ATTR_RETRIED, Value::Bool(retried));
    match reason {
        Some(reason) => sink.add(k::METRIC_CALLS, 1, &[p, (k::ATTR_REASON, Value::Str(reason)), r, t]),
        None => sink.add(k::METRIC_CALLS, 1, &[p, r, t]),
    }
}
