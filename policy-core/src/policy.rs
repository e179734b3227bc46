//! Policy documents: parsing, validation and defaults. Every error names its field path.
//!
//! ```yaml
//! policies:
//!   checkout:
//!     attempts: 3
//!     attempt-timeout: 2s
//!     deadline: 10s
//!     backoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 5s, jitter: full }
//!     retry-on: [timeout, connection-error, "http:429", "http:502-504"]
//!     budget: { kind: token, max-tokens: 10, token-ratio: 0.1 }
//!     breaker: { window: { kind: count, size: 20 }, failure-rate: 50, minimum-calls: 10 }
//!     fallbacks: [{ name: cached, on: [breaker-open, retries-exhausted] }]
//! ```
//!
//! `docs/policy.md` documents every field with its type, default and meaning.

use crate::backoff::{Backoff, Jitter, Kind};
use crate::breaker::{BreakerCfg, Window};
use crate::budget::BudgetCfg;
use crate::classify::{self, Rules, HTTP_METHODS};
use crate::doc::{self, Fields, Value};
use crate::limiter::{BulkheadCfg, RateCfg};
use crate::time::{parse_duration, SECOND};
use crate::types::Reason;

/// An error in a document: where, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    /// Field path, such as `policies.checkout.backoff.base`.
    pub path: String,
    /// What is wrong and what is expected.
    pub message: String,
}

impl LoadError {
    /// Make an error. Control, bidirectional and other invisible characters that came from
    /// the document are escaped (`\u{202e}`), so that an error never reorders or hides the text
    /// around it in a terminal or a log.
    pub fn new(path: &str, message: impl Into<String>) -> Self {
        LoadError { path: escape(path), message: escape(&message.into()) }
    }
}

/// Whether a character must not reach a message as it is: C0 and C1 controls, DEL, the
/// bidirectional marks, embeddings, overrides and isolates, zero-width characters, line and
/// paragraph separators, and the byte order mark.
fn needs_escape(c: char) -> bool {
    matches!(c as u32,
        0..=0x1f | 0x7f..=0x9f | 0x61c | 0x200b..=0x200f | 0x2028..=0x202e | 0x2060..=0x2069 | 0xfeff)
}

/// `s` with every [`needs_escape`] character written as `\u{...}` (unchanged, and not
/// copied, in the usual case).
pub fn escape(s: &str) -> String {
    if !s.chars().any(needs_escape) {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if needs_escape(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

impl core::fmt::Display for LoadError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// What happens when a server asks for a wait above `retry-after.cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverCap {
    /// Give up (reason `retry-after-too-long`).
    Fail,
    /// Wait `cap` instead.
    Clamp,
}

/// Retry-After and gRPC pushback handling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryAfterCfg {
    /// Honour server-directed delays (default true).
    pub honor: bool,
    /// Longest server-directed delay accepted (default 300s, Envoy's `max_interval`).
    pub cap: u64,
    /// What to do above the cap (default `fail`).
    pub over_cap: OverCap,
}

/// A fallback of the chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallbackCfg {
    /// The name the host registered the fallback under.
    pub name: String,
    /// The reasons that trigger it (default: every failure reason).
    pub on: Vec<Reason>,
}

/// Reasons a fallback may be triggered by (`any` is all of them).
pub const FALLBACK_TRIGGERS: &[Reason] = &[
    Reason::Deadline,
    Reason::RetriesExhausted,
    Reason::NonRetryable,
    Reason::Budget,
    Reason::BreakerOpen,
    Reason::RateLimited,
    Reason::BulkheadFull,
    Reason::NonIdempotent,
    Reason::RetryAfterTooLong,
    Reason::Pushback,
];

/// A validated policy with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// The policy's name.
    pub name: String,
    /// Attempts, counting the first (default 3, at least 1).
    pub attempts: u32,
    /// Per-attempt timeout (default none).
    pub attempt_timeout: Option<u64>,
    /// Total deadline from the call's start (default none).
    pub deadline: Option<u64>,
    /// Backoff between attempts.
    pub backoff: Backoff,
    /// Retryable failures.
    pub retry_on: Rules,
    /// Failures never retried (wins over `retry_on`).
    pub never_retry: Rules,
    /// Bit `i` set: HTTP method number `i` is idempotent.
    pub idempotent_methods: u16,
    /// Server-directed delays.
    pub retry_after: RetryAfterCfg,
    /// Retry budget (default none).
    pub budget: Option<BudgetCfg>,
    /// Circuit breaker (default none).
    pub breaker: Option<BreakerCfg>,
    /// Rate limit (default none).
    pub rate_limit: Option<RateCfg>,
    /// Concurrency limit (default none).
    pub bulkhead: Option<BulkheadCfg>,
    /// Fallback chain (default empty).
    pub fallbacks: Vec<FallbackCfg>,
    /// Most keys with state at once (default 1024).
    pub max_keys: u32,
    /// How the document's `attempts` was counted (`attempts` above is always normalised to
    /// count the first call).
    pub attempts_preset: AttemptsPreset,
    /// Durable calls under this policy.
    pub durable: DurableCfg,
    /// State shared across processes (default none: local only). See [`crate::fleet`].
    pub fleet: Option<crate::fleet::FleetCfg>,
}

/// How a policy's `attempts` is counted: the anchors disagree, and a policy moved from one of
/// them keeps its meaning under the preset of the same name.
///
/// | preset | `attempts: n` means | `attempts: 0` |
/// |---|---|---|
/// | `levee` (default), `durable-task` | n attempts, counting the first call | an error |
/// | `temporal` | n attempts, counting the first call (`maximumAttempts`) | unlimited |
/// | `step-functions` (`MaxAttempts`), `celery` (`max_retries`), `sidekiq` (`retry`) | n retries after the first call | no retry |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptsPreset {
    /// Count the first call; 0 is an error.
    Levee,
    /// Temporal's `maximumAttempts`: counts the first call; 0 is unlimited.
    Temporal,
    /// Azure Durable Task's `maxNumberOfAttempts`: counts the first call.
    DurableTask,
    /// Step Functions' `MaxAttempts`: counts retries; 0 never retries.
    StepFunctions,
    /// Celery's `max_retries`: counts retries.
    Celery,
    /// Sidekiq's `retry`: counts retries.
    Sidekiq,
}

impl AttemptsPreset {
    /// Every preset with its document name.
    pub const ALL: [(&'static str, AttemptsPreset); 6] = [
        ("levee", AttemptsPreset::Levee),
        ("temporal", AttemptsPreset::Temporal),
        ("durable-task", AttemptsPreset::DurableTask),
        ("step-functions", AttemptsPreset::StepFunctions),
        ("celery", AttemptsPreset::Celery),
        ("sidekiq", AttemptsPreset::Sidekiq),
    ];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, p)| *p == self).map(|(n, _)| *n).unwrap_or("levee")
    }

    /// Whether `attempts` counts retries (not the first call).
    pub fn counts_retries(self) -> bool {
        matches!(self, AttemptsPreset::StepFunctions | AttemptsPreset::Celery | AttemptsPreset::Sidekiq)
    }

    /// The document's number for a normalised total of attempts (the inverse of parsing).
    pub fn written(self, total: u32) -> u32 {
        match self {
            AttemptsPreset::Temporal if total == u32::MAX => 0,
            p if p.counts_retries() => total.saturating_sub(1),
            _ => total,
        }
    }
}

/// Durable calls (records that survive a restart; see `crate::durable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurableCfg {
    /// How long a process holds a call's lease for an attempt before another may take it
    /// over (default 30s; the executor renews it while the attempt runs).
    pub lease: u64,
    /// Attempts cut off by a process death after which the call is given up as a poison
    /// call (default 3).
    pub max_crashes: u32,
}

impl Default for DurableCfg {
    fn default() -> Self {
        DurableCfg { lease: 30 * SECOND, max_crashes: 3 }
    }
}

const POLICY_FIELDS: &[&str] = &[
    "attempts",
    "attempt-timeout",
    "deadline",
    "backoff",
    "retry-on",
    "never-retry",
    "idempotent-methods",
    "retry-after",
    "budget",
    "breaker",
    "rate-limit",
    "bulkhead",
    "fallbacks",
    "keys",
    "attempts-preset",
    "durable",
    "fleet",
];

/// Parse a whole document into its policies (in document order).
pub fn parse_document(text: &str) -> Result<Vec<Policy>, Vec<LoadError>> {
    let root = doc::parse(text).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let Some(mut top) = Fields::new("", &root, &mut errors) else {
        return Err(errors);
    };
    if let Some(v) = top.take("version") {
        if !matches!(v, Value::Int(1)) {
            errors.push(LoadError::new("version", "the only document version is 1"));
        }
    }
    let mut policies = Vec::new();
    match top.take("policies") {
        None => errors.push(LoadError::new("policies", "is required: a mapping from policy names to policies")),
        Some(value) => {
            if let Some(mut map) = Fields::new("policies", value, &mut errors) {
                let entries = map.entries();
                if entries.is_empty() {
                    errors.push(LoadError::new("policies", "names no policy"));
                }
                if entries.len() > 4096 {
                    errors.push(LoadError::new("policies", "holds more than 4096 policies"));
                }
                for (name, body) in entries.iter().take(4096) {
                    let path = doc::join("policies", name);
                    if name.is_empty()
                        || name.len() > 128
                        || !name.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
                    {
                        errors.push(LoadError::new(&path, "policy names are 1 to 128 characters of letters, digits, `-`, `_` and `.`"));
                        continue;
                    }
                    if let Some(p) = parse_policy(name, &path, body, &mut errors) {
                        policies.push(p);
                    }
                }
            }
        }
    }
    top.finish(&["version", "policies"], &mut errors);
    if errors.is_empty() {
        Ok(policies)
    } else {
        Err(errors)
    }
}

fn parse_policy(name: &str, path: &str, body: &Value, errors: &mut Vec<LoadError>) -> Option<Policy> {
    let before = errors.len();
    let mut f = Fields::new(path, body, errors)?;
    let attempts_preset = match f.take("attempts-preset") {
        None => AttemptsPreset::Levee,
        Some(v) => choose(&f.path_of("attempts-preset"), v, &AttemptsPreset::ALL, errors).unwrap_or(AttemptsPreset::Levee),
    };
    let attempts = match f.take("attempts") {
        None if attempts_preset.counts_retries() => {
            // The anchors' own defaults: Step Functions 3 retries, Celery 3, Sidekiq 25.
            if attempts_preset == AttemptsPreset::Sidekiq {
                26
            } else {
                4
            }
        }
        None => 3,
        Some(v) => match int(v) {
            Some(0) if attempts_preset == AttemptsPreset::Temporal => u32::MAX,
            Some(n) if attempts_preset.counts_retries() && (0..i64::from(u32::MAX)).contains(&n) => n as u32 + 1,
            Some(0) => {
                errors.push(LoadError::new(&f.path_of("attempts"), "must be at least 1 (attempts count the first call; 1 means no retry)"));
                1
            }
            Some(n) if !attempts_preset.counts_retries() && (1..=i64::from(u32::MAX)).contains(&n) => n as u32,
            _ => {
                let lo = u32::from(!attempts_preset.counts_retries() && attempts_preset != AttemptsPreset::Temporal);
                let hi = if attempts_preset.counts_retries() { u32::MAX - 1 } else { u32::MAX };
                errors.push(LoadError::new(
                    &f.path_of("attempts"),
                    format!("must be a whole number from {lo} to {hi}, found {}", describe(v)),
                ));
                1
            }
        },
    };
    let attempt_timeout = opt_duration(&mut f, "attempt-timeout", errors, true);
    let deadline = opt_duration(&mut f, "deadline", errors, true);
    let backoff = parse_backoff(&mut f, errors);
    let retry_on = rules(&mut f, "retry-on", classify::DEFAULT_RETRY_ON, errors);
    let never_retry = rules(&mut f, "never-retry", classify::DEFAULT_NEVER_RETRY, errors);
    let idempotent_methods = methods(&mut f, errors);
    let retry_after = parse_retry_after(&mut f, errors);
    let budget = f.take("budget").and_then(|v| parse_budget(&f.path_of("budget"), v, errors));
    let breaker = f.take("breaker").and_then(|v| parse_breaker(&f.path_of("breaker"), v, errors));
    let rate_limit = f.take("rate-limit").and_then(|v| parse_rate(&f.path_of("rate-limit"), v, errors));
    let bulkhead = f.take("bulkhead").and_then(|v| {
        let path = f.path_of("bulkhead");
        let mut b = Fields::new(&path, v, errors)?;
        let max_concurrent = uint(&mut b, "max-concurrent", 25, 1, 1_000_000, errors);
        b.finish(&["max-concurrent"], errors);
        Some(BulkheadCfg { max_concurrent })
    });
    let fallbacks = f.take("fallbacks").map(|v| parse_fallbacks(&f.path_of("fallbacks"), v, errors)).unwrap_or_default();
    let max_keys = match f.take("keys") {
        None => 1024,
        Some(v) => {
            let path = f.path_of("keys");
            match Fields::new(&path, v, errors) {
                Some(mut k) => {
                    let n = uint(&mut k, "max", 1024, 1, 1_000_000, errors);
                    k.finish(&["max"], errors);
                    n
                }
                None => 1024,
            }
        }
    };
    let durable = match f.take("durable") {
        None => DurableCfg::default(),
        Some(v) => {
            let path = f.path_of("durable");
            match Fields::new(&path, v, errors) {
                Some(mut d) => {
                    let lease = opt_duration(&mut d, "lease", errors, true).unwrap_or(30 * SECOND);
                    let max_crashes = uint(&mut d, "max-crashes", 3, 1, 1_000_000, errors);
                    d.finish(&["lease", "max-crashes"], errors);
                    DurableCfg { lease, max_crashes }
                }
                None => DurableCfg::default(),
            }
        }
    };
    let fleet = f.take("fleet").and_then(|v| crate::fleet::parse(&f.path_of("fleet"), v, &breaker, &budget, errors));
    f.finish(POLICY_FIELDS, errors);
    if errors.len() > before {
        return None;
    }
    Some(Policy {
        name: name.to_string(),
        attempts,
        attempt_timeout,
        deadline,
        backoff,
        retry_on,
        never_retry,
        idempotent_methods,
        retry_after,
        budget,
        breaker,
        rate_limit,
        bulkhead,
        fallbacks,
        max_keys,
        attempts_preset,
        durable,
        fleet,
    })
}

fn parse_backoff(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> Backoff {
    let mut out = Backoff::default();
    let Some(v) = f.take("backoff") else {
        return out;
    };
    let path = f.path_of("backoff");
    let Some(mut b) = Fields::new(&path, v, errors) else {
        return out;
    };
    if let Some(k) = b.take("kind") {
        if let Some(kind) = choose(&b.path_of("kind"), k, &Kind::ALL.map(|k| (k.name(), k)), errors) {
            out.kind = kind;
        }
    }
    if out.kind == Kind::Decorrelated {
        out.jitter = Jitter::Decorrelated;
    }
    if let Some(base) = opt_duration(&mut b, "base", errors, false) {
        out.base = base;
    }
    if let Some(m) = b.take("multiplier") {
        match number(m) {
            Some(x) if x.is_finite() && (1.0..=1000.0).contains(&x) => out.multiplier = x,
            _ => errors.push(LoadError::new(&b.path_of("multiplier"), format!("must be a number from 1 to 1000, found {}", describe(m)))),
        }
    }
    if let Some(cap) = opt_duration(&mut b, "cap", errors, false) {
        out.cap = cap;
    }
    if let Some(j) = b.take("jitter") {
        let jp = b.path_of("jitter");
        if let Some(jitter) = choose(&jp, j, &Jitter::ALL.map(|j| (j.name(), j)), errors) {
            if jitter == Jitter::Decorrelated && out.kind != Kind::Decorrelated {
                errors.push(LoadError::new(
                    &jp,
                    "decorrelated jitter is the `decorrelated` backoff kind's own and goes only with it (use kind: decorrelated)",
                ));
            } else if jitter != Jitter::Decorrelated && out.kind == Kind::Decorrelated {
                errors.push(LoadError::new(
                    &jp,
                    format!(
                        "the `decorrelated` kind has its own jitter (each delay is drawn from base to 3 times the previous one), so `{}` cannot apply; leave `jitter` out (or write jitter: decorrelated), or choose another kind for {} jitter",
                        jitter.name(),
                        jitter.name()
                    ),
                ));
            } else {
                out.jitter = jitter;
            }
        }
    }
    if let Some(r) = b.take("jitter-ratio") {
        match number(r) {
            Some(x) if x > 0.0 && x <= 1.0 => out.jitter_ratio = x,
            _ => errors
                .push(LoadError::new(&b.path_of("jitter-ratio"), format!("must be a number above 0 and at most 1, found {}", describe(r)))),
        }
    }
    if out.cap < out.base {
        errors.push(LoadError::new(
            &b.path_of("cap"),
            format!("({}) must not be below base ({})", crate::time::format_duration(out.cap), crate::time::format_duration(out.base)),
        ));
    }
    b.finish(&["kind", "base", "multiplier", "cap", "jitter", "jitter-ratio"], errors);
    out
}

fn parse_retry_after(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> RetryAfterCfg {
    let mut out = RetryAfterCfg { honor: true, cap: 300 * SECOND, over_cap: OverCap::Fail };
    let Some(v) = f.take("retry-after") else {
        return out;
    };
    let path = f.path_of("retry-after");
    let Some(mut r) = Fields::new(&path, v, errors) else {
        return out;
    };
    if let Some(h) = r.take("honor") {
        match h {
            Value::Bool(b) => out.honor = *b,
            other => errors.push(LoadError::new(&r.path_of("honor"), format!("must be true or false, found {}", describe(other)))),
        }
    }
    if let Some(cap) = opt_duration(&mut r, "cap", errors, false) {
        out.cap = cap;
    }
    if let Some(o) = r.take("over-cap") {
        if let Some(x) = choose(&r.path_of("over-cap"), o, &[("fail", OverCap::Fail), ("clamp", OverCap::Clamp)], errors) {
            out.over_cap = x;
        }
    }
    r.finish(&["honor", "cap", "over-cap"], errors);
    out
}

fn parse_budget(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BudgetCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let kind = match b.take("kind") {
        None => {
            errors.push(LoadError::new(
                &b.path_of("kind"),
                "is required: `token` (gRPC retry throttling) or `ratio` (Finagle/tower retry budget)",
            ));
            None
        }
        Some(k) => choose(&b.path_of("kind"), k, &[("token", 0u8), ("ratio", 1u8)], errors),
    };
    match kind {
        Some(0) => {
            let max = fraction(&mut b, "max-tokens", 10.0, 0.001, 1000.0, errors);
            let ratio = fraction(&mut b, "token-ratio", 0.1, 0.001, 1000.0, errors);
            b.finish(&["kind", "max-tokens", "token-ratio"], errors);
            Some(BudgetCfg::Token { max_milli: (max * 1000.0).round() as i64, ratio_milli: (ratio * 1000.0).round() as i64 })
        }
        Some(_) => {
            let percent = fraction(&mut b, "percent", 20.0, 0.001, 1000.0, errors);
            let min_per_second = uint(&mut b, "min-per-second", 10, 0, 1_000_000, errors);
            let ttl = opt_duration(&mut b, "ttl", errors, false).unwrap_or(10 * SECOND);
            if !(SECOND..=60 * SECOND).contains(&ttl) {
                errors.push(LoadError::new(&b.path_of("ttl"), "must be from 1s to 60s (tower's bounds)"));
            }
            b.finish(&["kind", "percent", "min-per-second", "ttl"], errors);
            Some(BudgetCfg::Ratio { percent, min_per_second, ttl })
        }
        None => None,
    }
}

fn parse_breaker(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BreakerCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let window = match b.take("window") {
        None => Window::Count(100),
        Some(w) => {
            let wp = b.path_of("window");
            let mut wf = Fields::new(&wp, w, errors)?;
            let kind = match wf.take("kind") {
                None => Some(0u8),
                Some(k) => choose(&wf.path_of("kind"), k, &[("count", 0u8), ("time", 1u8)], errors),
            };
            let out = match kind {
                Some(1) => {
                    let size = opt_duration(&mut wf, "size", errors, false).unwrap_or(60 * SECOND);
                    let bucket = opt_duration(&mut wf, "bucket", errors, false).unwrap_or(SECOND);
                    if bucket == 0 || size < bucket || size / bucket.max(1) > 3600 {
                        errors.push(LoadError::new(&wp, "a time window needs 0 < bucket <= size and at most 3600 buckets"));
                    }
                    Window::Time { size, bucket }
                }
                _ => match wf.take("size") {
                    None => Window::Count(100),
                    Some(s) => match int(s) {
                        Some(n) if (1..=100_000).contains(&n) => Window::Count(n as u32),
                        _ => {
                            errors.push(LoadError::new(
                                &wf.path_of("size"),
                                format!("a count window's size is a number of calls from 1 to 100000, found {}", describe(s)),
                            ));
                            Window::Count(100)
                        }
                    },
                },
            };
            wf.finish(&["kind", "size", "bucket"], errors);
            out
        }
    };
    let failure_rate = fraction(&mut b, "failure-rate", 50.0, 0.001, 100.0, errors);
    let slow_call_rate = fraction(&mut b, "slow-call-rate", 100.0, 0.001, 100.0, errors);
    let slow_call_duration = opt_duration(&mut b, "slow-call-duration", errors, false).unwrap_or(60 * SECOND);
    let minimum_calls = uint(&mut b, "minimum-calls", 100, 1, 1_000_000, errors);
    let open_duration = opt_duration(&mut b, "open-duration", errors, false).unwrap_or(60 * SECOND);
    let open_duration_max = opt_duration(&mut b, "open-duration-max", errors, false).unwrap_or(open_duration);
    if open_duration_max < open_duration {
        errors.push(LoadError::new(&b.path_of("open-duration-max"), "must not be below open-duration"));
    }
    let open_duration_multiplier = fraction(&mut b, "open-duration-multiplier", 2.0, 1.0, 1000.0, errors);
    let half_open_permits = uint(&mut b, "half-open-permits", 10, 1, 10_000, errors);
    let half_open_permit_timeout = opt_duration(&mut b, "half-open-permit-timeout", errors, false).unwrap_or(60 * SECOND);
    if half_open_permit_timeout == 0 {
        errors.push(LoadError::new(&b.path_of("half-open-permit-timeout"), "must be above 0"));
    }
    let failure_on = rules(&mut b, "failure-on", classify::DEFAULT_BREAKER_FAILURE_ON, errors);
    b.finish(
        &[
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
        ],
        errors,
    );
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

pub(crate) fn parse_rate(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<RateCfg> {
    let mut r = Fields::new(path, v, errors)?;
    let rate = match r.take("rate") {
        None => {
            errors.push(LoadError::new(&r.path_of("rate"), "is required: requests allowed per `per` (default per: 1s)"));
            1
        }
        Some(x) => match int(x) {
            Some(n) if (1..=1_000_000_000).contains(&n) => n as u32,
            _ => {
                errors.push(LoadError::new(
                    &r.path_of("rate"),
                    format!("must be a whole number from 1 to 1000000000, found {}", describe(x)),
                ));
                1
            }
        },
    };
    let per = opt_duration(&mut r, "per", errors, false).unwrap_or(SECOND);
    if per == 0 {
        errors.push(LoadError::new(&r.path_of("per"), "must be above 0"));
    }
    let burst = uint(&mut r, "burst", rate, 1, 1_000_000_000, errors);
    let max_wait = opt_duration(&mut r, "max-wait", errors, false).unwrap_or(0);
    r.finish(&["rate", "per", "burst", "max-wait"], errors);
    Some(RateCfg { rate, per, burst, max_wait })
}

fn parse_fallbacks(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Vec<FallbackCfg> {
    let Value::List(items) = v else {
        errors.push(LoadError::new(path, format!("must be a list of fallbacks (names, or {{name, on}}), found {}", v.type_name())));
        return Vec::new();
    };
    if items.len() > 255 {
        errors.push(LoadError::new(path, "holds more than 255 fallbacks"));
        return Vec::new();
    }
    let mut out: Vec<FallbackCfg> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let ip = format!("{path}[{i}]");
        let fb = match item {
            Value::Str(name) => Some(FallbackCfg { name: name.clone(), on: FALLBACK_TRIGGERS.to_vec() }),
            other => Fields::new(&ip, other, errors).and_then(|mut f| {
                let name = match f.take("name") {
                    Some(Value::Str(s)) => Some(s.clone()),
                    Some(other) => {
                        errors.push(LoadError::new(&f.path_of("name"), format!("must be a string, found {}", describe(other))));
                        None
                    }
                    None => {
                        errors.push(LoadError::new(&f.path_of("name"), "is required"));
                        None
                    }
                };
                let on = match f.take("on") {
                    None => FALLBACK_TRIGGERS.to_vec(),
                    Some(v) => triggers(&f.path_of("on"), v, errors),
                };
                f.finish(&["name", "on"], errors);
                name.map(|name| FallbackCfg { name, on })
            }),
        };
        if let Some(fb) = fb {
            if fb.name.is_empty() || fb.name.len() > 128 {
                errors.push(LoadError::new(&ip, "a fallback name is 1 to 128 characters"));
            } else if out.iter().any(|o| o.name == fb.name) {
                errors.push(LoadError::new(&ip, format!("fallback `{}` is listed twice", fb.name)));
            } else {
                out.push(fb);
            }
        }
    }
    out
}

fn triggers(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Vec<Reason> {
    let Value::List(items) = v else {
        errors.push(LoadError::new(path, format!("must be a list of reasons, found {}", v.type_name())));
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match item {
            Value::Str(s) if s == "any" => out.extend_from_slice(FALLBACK_TRIGGERS),
            Value::Str(s) => match Reason::from_name(s).filter(|r| FALLBACK_TRIGGERS.contains(r)) {
                Some(r) => out.push(r),
                None => {
                    let names: Vec<&str> = FALLBACK_TRIGGERS.iter().map(|r| r.name()).collect();
                    let hint = doc::closest(s, &names).map(|n| format!("; did you mean `{n}`?")).unwrap_or_default();
                    errors.push(LoadError::new(
                        &format!("{path}[{i}]"),
                        format!("`{s}` is not a fallback trigger{hint} (use any, {})", doc::list(&names)),
                    ));
                }
            },
            other => errors.push(LoadError::new(&format!("{path}[{i}]"), format!("must be a reason name, found {}", describe(other)))),
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn rules(f: &mut Fields<'_>, field: &str, default: &[&str], errors: &mut Vec<LoadError>) -> Rules {
    let Some(v) = f.take(field) else {
        return Rules::parse_all(default).unwrap_or_default();
    };
    let path = f.path_of(field);
    let Value::List(items) = v else {
        errors.push(LoadError::new(&path, format!("must be a list of rules such as [timeout, \"http:503\"], found {}", v.type_name())));
        return Rules::default();
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let text = match item {
            Value::Str(s) => s.clone(),
            Value::Int(n) => format!("http:{n}"),
            other => {
                errors.push(LoadError::new(&format!("{path}[{i}]"), format!("must be a rule string, found {}", describe(other))));
                continue;
            }
        };
        match classify::Rule::parse(&text) {
            Ok(r) => out.push(r),
            Err(e) => errors.push(LoadError::new(&format!("{path}[{i}]"), e)),
        }
    }
    Rules(out)
}

fn methods(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> u16 {
    let names: Vec<String> = match f.take("idempotent-methods") {
        None => classify::DEFAULT_IDEMPOTENT_METHODS.iter().map(|s| s.to_string()).collect(),
        Some(Value::List(items)) => items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| match item {
                Value::Str(s) => Some(s.to_ascii_uppercase()),
                other => {
                    errors.push(LoadError::new(
                        &format!("{}[{i}]", f.path_of("idempotent-methods")),
                        format!("must be a method name, found {}", describe(other)),
                    ));
                    None
                }
            })
            .collect(),
        Some(other) => {
            errors.push(LoadError::new(
                &f.path_of("idempotent-methods"),
                format!("must be a list of HTTP methods, found {}", other.type_name()),
            ));
            Vec::new()
        }
    };
    let mut bits = 0u16;
    for (i, name) in names.iter().enumerate() {
        match HTTP_METHODS.iter().skip(1).position(|m| m == name) {
            Some(p) => bits |= 1 << (p + 1),
            None => errors.push(LoadError::new(
                &format!("{}[{i}]", f.path_of("idempotent-methods")),
                format!("`{name}` is not one of {}", doc::list(HTTP_METHODS.get(1..).unwrap_or_default())),
            )),
        }
    }
    bits
}

// ---- scalar readers -------------------------------------------------------------------

pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Int(i) => format!("{i}"),
        Value::Float(x) if x.is_nan() => ".nan (not a number)".to_string(),
        Value::Float(x) if x.is_infinite() => format!("{}.inf (infinity)", if *x < 0.0 { "-" } else { "" }),
        Value::Float(x) => doc::format_number(*x),
        Value::Str(s) => format!("\"{s}\""),
        Value::Bool(b) => format!("{b}"),
        other => other.type_name().to_string(),
    }
}

pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => i64::try_from(*i).ok(),
        Value::Float(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Some(*x as i64),
        _ => None,
    }
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Float(x) => Some(*x),
        _ => None,
    }
}

pub(crate) fn uint(f: &mut Fields<'_>, field: &str, default: u32, lo: u32, hi: u32, errors: &mut Vec<LoadError>) -> u32 {
    match f.take(field) {
        None => default,
        Some(v) => match int(v) {
            Some(n) if (i64::from(lo)..=i64::from(hi)).contains(&n) => n as u32,
            _ => {
                errors.push(LoadError::new(&f.path_of(field), format!("must be a whole number from {lo} to {hi}, found {}", describe(v))));
                default
            }
        },
    }
}

fn fraction(f: &mut Fields<'_>, field: &str, default: f64, lo: f64, hi: f64, errors: &mut Vec<LoadError>) -> f64 {
    match f.take(field) {
        None => default,
        Some(v) => match number(v) {
            Some(x) if x.is_finite() && x >= lo && x <= hi => x,
            _ => {
                errors.push(LoadError::new(
                    &f.path_of(field),
                    format!("must be a number from {} to {}, found {}", doc::format_number(lo), doc::format_number(hi), describe(v)),
                ));
                default
            }
        },
    }
}

pub(crate) fn opt_duration(f: &mut Fields<'_>, field: &str, errors: &mut Vec<LoadError>, positive: bool) -> Option<u64> {
    let v = f.take(field)?;
    let path = f.path_of(field);
    let parsed = match v {
        Value::Str(s) => parse_duration(s),
        Value::Int(0) => Ok(0),
        Value::Int(n) => Err(format!("`{n}` needs a unit: ns, us, ms, s, m or h (such as \"{n}ms\")")),
        other => Err(format!("must be a duration such as \"250ms\" or \"2s\", found {}", describe(other))),
    };
    match parsed {
        Ok(0) if positive => {
            errors.push(LoadError::new(&path, "must be above 0 (leave it out for none)"));
            None
        }
        Ok(d) => Some(d),
        Err(e) => {
            errors.push(LoadError::new(&path, e));
            None
        }
    }
}

pub(crate) fn choose<T: Copy>(path: &str, v: &Value, options: &[(&str, T)], errors: &mut Vec<LoadError>) -> Option<T> {
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    match v {
        Value::Str(s) => match options.iter().find(|(n, _)| n == s) {
            Some((_, t)) => Some(*t),
            None => {
                let hint = doc::closest(s, &names).map(|n| format!("; did you mean `{n}`?")).unwrap_or_default();
                errors.push(LoadError::new(path, format!("`{s}` is not one of {}{hint}", doc::list(&names))));
                None
            }
        },
        other => {
            errors.push(LoadError::new(path, format!("must be one of {}, found {}", doc::list(&names), describe(other))));
            None
        }
    }
}

/// Whether an HTTP method (by its `start` flags number) is idempotent under this policy.
/// 0 (not an HTTP call) is; 15 (another method) is not.
pub fn method_idempotent(policy: &Policy, method: u32) -> bool {
    match method {
        0 => true,
        1..=9 => policy.idempotent_methods & (1 << method) != 0,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(doc: &str) -> Vec<LoadError> {
        parse_document(doc).err().unwrap_or_default()
    }

    #[test]
    fn an_empty_value_is_an_error_in_every_field() {
        // Issue 14, item 15: `deadline:` with nothing after it was no deadline at all.
        let e = errors("policies:\n  p:\n    attempts:\n    deadline:\n");
        assert_eq!(
            e,
            vec![LoadError::new("policies.p.attempts", doc::EMPTY_VALUE), LoadError::new("policies.p.deadline", doc::EMPTY_VALUE),]
        );
        // Every field of every mapping, in block and flow syntax.
        let mut cases: Vec<(String, String)> = Vec::new();
        for f in POLICY_FIELDS {
            cases.push((format!("    {f}:\n"), (*f).to_string()));
            cases.push((format!("    {f}: ~\n"), (*f).to_string()));
        }
        let nested: &[(&str, &str, &[&str])] = &[
            ("backoff", "", &["kind", "base", "multiplier", "cap", "jitter", "jitter-ratio"]),
            ("retry-after", "", &["honor", "cap", "over-cap"]),
            ("budget", "kind: token, ", &["max-tokens", "token-ratio"]),
            ("budget", "kind: ratio, ", &["percent", "min-per-second", "ttl"]),
            ("budget", "", &["kind"]),
            (
                "breaker",
                "",
                &[
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
                ],
            ),
            ("rate-limit", "rate: 5, ", &["per", "burst", "max-wait"]),
            ("rate-limit", "", &["rate"]),
            ("bulkhead", "", &["max-concurrent"]),
            ("keys", "", &["max"]),
        ];
        for (field, others, inner) in nested {
            for i in *inner {
                cases.push((format!("    {field}: {{ {others}{i}: }}\n"), format!("{field}.{i}")));
            }
        }
        for (kind, inner) in [("count", ["kind", "size"]), ("time", ["size", "bucket"])] {
            for i in inner {
                let head = if i == "kind" { String::new() } else { format!("kind: {kind}, ") };
                cases.push((format!("    breaker: {{ window: {{ {head}{i}: }} }}\n"), format!("breaker.window.{i}")));
            }
        }
        cases.push(("    fallbacks: [{ name: a, on: }]\n".to_string(), "fallbacks[0].on".to_string()));
        cases.push(("    fallbacks: [{ name: }]\n".to_string(), "fallbacks[0].name".to_string()));
        for (body, path) in cases {
            let doc = format!("policies:\n  p:\n{body}");
            let e = errors(&doc);
            let want = format!("policies.p.{path}");
            assert!(e.iter().any(|e| e.path == want && e.message == doc::EMPTY_VALUE), "{doc}: {e:?}");
        }
        // A policy, the policies, the version: the same.
        assert_eq!(errors("policies:\n  p:\n"), vec![LoadError::new("policies.p", doc::EMPTY_VALUE)]);
        assert_eq!(errors("version:\npolicies: { p: {} }\n"), vec![LoadError::new("version", doc::EMPTY_VALUE)]);
        assert!(errors("policies:\n").iter().any(|e| e.path == "policies"));
        // `{}` is the way to ask for every default.
        assert!(parse_document("policies:\n  p: {}\n").is_ok());
        assert!(parse_document("policies:\n  p: { breaker: {} }\n").is_ok_and(|p| p.first().is_some_and(|p| p.breaker.is_some())));
    }

    #[test]
    fn nan_and_infinity_are_named() {
        let e = errors("policies:\n  p: { attempts: .nan, breaker: { failure-rate: .inf }, backoff: { multiplier: -.inf } }\n");
        let messages: Vec<&str> = e.iter().map(|e| e.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "must be a whole number from 1 to 4294967295, found .nan (not a number)",
                "must be a number from 1 to 1000, found -.inf (infinity)",
                "must be a number from 0.001 to 100, found .inf (infinity)",
            ]
        );
        assert!(e.iter().all(|e| !e.message.contains("null")));
    }

    #[test]
    fn control_and_bidi_characters_are_escaped_in_errors() {
        let e = errors("policies:\n  \"evil\\u202egnp.exe\": {}\n  ok: { \"att\\u0000empts\": 3, retry-on: [\"http:50\\u20663\"] }\n");
        assert!(!e.is_empty());
        for err in &e {
            let text = err.to_string();
            assert!(!text.chars().any(needs_escape), "{text:?}");
        }
        assert_eq!(e.first().map(|e| e.path.as_str()), Some("policies.evil\\u{202e}gnp.exe"));
        assert!(e.iter().any(|e| e.path == "policies.ok.att\\u{0}empts"), "{e:?}");
        assert!(e.iter().any(|e| e.message.contains("http:50\\u{2066}3")), "{e:?}");
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape("a\u{1b}[31mb"), "a\\u{1b}[31mb");
    }

    #[test]
    fn decorrelated_jitter_messages_say_what_is_wrong() {
        // Issue 14, item 14: `kind: decorrelated` with `jitter: full` said "use kind: decorrelated".
        let e = errors("policies:\n  p: { backoff: { kind: decorrelated, jitter: full } }\n");
        assert_eq!(e.len(), 1);
        let m = &e[0].message;
        assert!(!m.contains("use kind: decorrelated"), "{m}");
        assert!(m.contains("has its own jitter") && m.contains("`full`"), "{m}");
        let e = errors("policies:\n  p: { backoff: { kind: exponential, jitter: decorrelated } }\n");
        assert!(e.len() == 1 && e[0].message.contains("(use kind: decorrelated)"), "{e:?}");
        assert!(parse_document("policies:\n  p: { backoff: { kind: decorrelated, jitter: decorrelated } }\n").is_ok());
    }
}
