//! Engine state as versioned bytes, and policies as JSON.
//!
//! The state is UTF-8 JSON: `{"format": "levee-state", "version": 1, "rng": [4 words],
//! "tick": n, "policies": [{"name", "keys": [{"key", "last_used", "breaker", "limiter",
//! "budget"}]}]}`. Live calls are not state: they belong to the process that runs them.
//!
//! Import keeps what still applies to the current policies, matched by name: a breaker's
//! state and trip count if the policy still has a breaker (its window only if the window
//! is configured the same), a limiter's arrival time if it still has a limiter (clamped to
//! one full burst ahead), a budget's level if the budget is of the same kind (clamped to the
//! new bounds; `Engine::reload`, which knows the old bounds, rescales a token budget instead).
//! Keys are exported sorted by name, so the bytes never depend on the key table's layout. Everything is validated before anything changes: garbage or a foreign version
//! is an error and leaves the engine as it was.

use crate::doc::{self, obj, Value};

use crate::backoff::Kind;
use crate::breaker::{Breaker, Window, WindowState};
use crate::budget::{BudgetCfg, BudgetState};
use crate::engine::{Engine, KeyState, Keys, IDLE};
use crate::limiter::Gcra;
use crate::policy::{LoadError, OverCap, Policy};
use crate::rng::Rng;
use crate::time::format_duration;
use crate::types::BreakerState;

const FORMAT: &str = "levee-state";
const VERSION: u64 = 1;

impl Engine {
    /// The whole engine state as versioned bytes.
    pub fn export_state(&self) -> Vec<u8> {
        let policies: Vec<Value> = self
            .policies
            .iter()
            .zip(self.keys.iter())
            .map(|(p, keys)| {
                // By name: the bytes never depend on the table's layout.
                let mut sorted: Vec<(&std::sync::Arc<str>, &KeyState)> = keys.iter().map(|(_, k, s)| (k, s)).collect();
                sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
                let keys: Vec<Value> = sorted.into_iter().map(|(k, s)| key_to_json(p, k, s)).collect();
                obj([("name", p.name.as_str().into()), ("fingerprint", fingerprint(p)), ("keys", Value::List(keys))])
            })
            .collect();
        let doc = obj([
            ("format", FORMAT.into()),
            ("version", VERSION.into()),
            ("rng", self.rng.state().to_vec().into()),
            ("tick", self.tick.into()),
            ("policies", Value::List(policies)),
        ]);
        doc::to_json(&doc).into_bytes()
    }

    /// Restore exported state; see the module documentation. On error nothing changes.
    pub fn import_state(&mut self, bytes: &[u8]) -> Result<(), LoadError> {
        let text = std::str::from_utf8(bytes).map_err(|_| LoadError::new("", "not Levee state: not UTF-8"))?;
        let trimmed = text.trim_start();
        if !trimmed.starts_with('{') {
            return Err(LoadError::new("", "not Levee state: expected a JSON object"));
        }
        let doc =
            doc::parse_limited(text, doc::MAX_STATE_BYTES).map_err(|e| LoadError::new("", format!("not Levee state: {}", e.message)))?;
        let obj = &doc;
        if obj.get("format").and_then(Value::as_str) != Some(FORMAT) {
            return Err(LoadError::new("format", "not Levee state (format is not \"levee-state\")"));
        }
        match obj.get("version").and_then(Value::as_u64) {
            Some(VERSION) => {}
            Some(v) => {
                return Err(LoadError::new("version", format!("state version {v} is not supported (this engine reads version {VERSION})")))
            }
            None => return Err(LoadError::new("version", "is missing")),
        }
        let rng_words = obj.get("rng").and_then(Value::as_list).ok_or_else(|| LoadError::new("rng", "is missing"))?;
        let mut words = [0u64; 4];
        if rng_words.len() != 4 {
            return Err(LoadError::new("rng", "must hold 4 words"));
        }
        for (w, v) in words.iter_mut().zip(rng_words) {
            *w = v.as_u64().ok_or_else(|| LoadError::new("rng", "words must be unsigned 64-bit integers"))?;
        }
        let tick = obj.get("tick").and_then(Value::as_u64).ok_or_else(|| LoadError::new("tick", "is missing"))?;
        let policies = obj.get("policies").and_then(Value::as_list).ok_or_else(|| LoadError::new("policies", "is missing"))?;

        let mut new_keys: Vec<Keys> = self.empty_keys();
        for (i, entry) in policies.iter().enumerate() {
            let path = format!("policies[{i}]");
            let name = entry.get("name").and_then(Value::as_str).ok_or_else(|| LoadError::new(&path, "has no name"))?;
            let old_fingerprint = entry.get("fingerprint").cloned().unwrap_or(Value::Null);
            let keys = entry.get("keys").and_then(Value::as_list).ok_or_else(|| LoadError::new(&path, "has no keys"))?;
            let Some(pi) = self.policies.iter().position(|p| p.name == name) else {
                continue; // the policy is gone: nothing of it applies
            };
            let (Some(p), Some(target)) = (self.policies.get(pi), new_keys.get_mut(pi)) else { continue };
            let same_window = old_fingerprint.get("window") == fingerprint(p).get("window");
            let mut parsed: Vec<(String, KeyState)> = Vec::with_capacity(keys.len());
            for (j, k) in keys.iter().enumerate() {
                let kp = format!("{path}.keys[{j}]");
                parsed.push(key_from_json(p, k, &kp, same_window)?);
            }
            // Keep the most recently used keys within the bound (ties by name, the order they
            // were exported in), and file them least recently used first. A name given twice
            // keeps its most recent entry.
            parsed.sort_unstable_by(|(a, sa), (b, sb)| sb.last_used.cmp(&sa.last_used).then_with(|| a.cmp(b)));
            parsed.dedup_by(|(a, _), (b, _)| a == b);
            let mut seen = std::collections::BTreeSet::new();
            parsed.retain(|(k, _)| seen.insert(k.clone()));
            parsed.truncate(p.max_keys as usize);
            for (k, st) in parsed.into_iter().rev() {
                if target.find(k.as_str()).is_none() {
                    target.insert(std::sync::Arc::from(k), st, IDLE);
                }
            }
        }
        self.keys = new_keys;
        self.rng = Rng::from_state(words);
        self.tick = self.tick.max(tick);
        Ok(())
    }
}

fn fingerprint(p: &Policy) -> Value {
    let window = p.breaker.as_ref().map(|b| match b.window {
        Window::Count(n) => obj([("kind", "count".into()), ("size", n.into())]),
        Window::Time { size, bucket } => obj([("kind", "time".into()), ("size", size.into()), ("bucket", bucket.into())]),
    });
    obj([("window", window.unwrap_or(Value::Null))])
}

fn rows<T, const N: usize>(items: impl Iterator<Item = [T; N]>) -> Value
where
    T: Into<Value>,
{
    Value::List(items.map(|row| Value::List(row.into_iter().map(Into::into).collect())).collect())
}

fn key_to_json(_p: &Policy, key: &str, s: &KeyState) -> Value {
    let breaker = s.breaker.as_ref().map(|b| {
        let window = match &b.window {
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
        obj([
            ("state", b.state.name().into()),
            ("open_until", b.open_until.into()),
            ("trips", b.trips.into()),
            ("epoch", b.epoch.into()),
            ("permits", rows(b.permits.iter().map(|(c, at)| [*c, *at]))),
            ("issued", b.issued.into()),
            ("trial", Value::List(vec![b.trial.0.into(), b.trial.1.into(), b.trial.2.into()])),
            ("last_now", b.last_now.into()),
            ("window", window),
        ])
    });
    let limiter = s.limiter.as_ref().map(|g| obj([("tat", g.tat.into()), ("last_now", g.last_now.into())]));
    let budget = s.budget.as_ref().map(|b| match b {
        BudgetState::Token { tokens } => obj([("token", (*tokens).into())]),
        BudgetState::Ratio { slots } => obj([("ratio", rows(slots.iter().map(|(s, v)| [Value::from(*s), Value::from(*v)])))]),
    });
    obj([
        ("key", key.into()),
        ("last_used", s.last_used.into()),
        ("breaker", breaker.unwrap_or(Value::Null)),
        ("limiter", limiter.unwrap_or(Value::Null)),
        ("budget", budget.unwrap_or(Value::Null)),
    ])
}

fn u64_at(v: &Value, field: &str, path: &str) -> Result<u64, LoadError> {
    v.get(field).and_then(Value::as_u64).ok_or_else(|| LoadError::new(&format!("{path}.{field}"), "must be an unsigned integer"))
}

fn u32_at(v: &Value, field: &str, path: &str) -> Result<u32, LoadError> {
    u64_at(v, field, path).and_then(|n| u32::try_from(n).map_err(|_| LoadError::new(&format!("{path}.{field}"), "is out of range")))
}

fn pairs(v: Option<&Value>, path: &str, width: usize) -> Result<Vec<Vec<i64>>, LoadError> {
    let items = v.and_then(Value::as_list).ok_or_else(|| LoadError::new(path, "must be a list"))?;
    items
        .iter()
        .map(|item| {
            let row = item
                .as_list()
                .filter(|r| r.len() == width)
                .ok_or_else(|| LoadError::new(path, format!("entries must be lists of {width} integers")))?;
            row.iter().map(|x| x.as_i64().ok_or_else(|| LoadError::new(path, "entries must be integers"))).collect()
        })
        .collect()
}

fn key_from_json(p: &Policy, v: &Value, path: &str, same_window: bool) -> Result<(String, KeyState), LoadError> {
    let key = v.get("key").and_then(Value::as_str).ok_or_else(|| LoadError::new(&format!("{path}.key"), "must be a string"))?.to_string();
    let mut s = KeyState::fresh(p, u64_at(v, "last_used", path)?);
    if let (Some(cfg), Some(b)) = (&p.breaker, v.get("breaker").filter(|b| !b.is_null())) {
        let bp = format!("{path}.breaker");
        let state = b
            .get("state")
            .and_then(Value::as_str)
            .and_then(BreakerState::from_name)
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
            let size = match cfg.window {
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
            open_until: u64_at(b, "open_until", &bp)?,
            trips: u32_at(b, "trips", &bp)?,
            window,
            epoch: u64_at(b, "epoch", &bp)?,
            permits,
            issued: u32_at(b, "issued", &bp)?,
            trial: (t(0), t(1), t(2)),
            last_now: u64_at(b, "last_now", &bp)?,
        };
        s.breaker = Some(cfg.adopt(imported, same_window));
    }
    if let (Some(cfg), Some(g)) = (&p.rate_limit, v.get("limiter").filter(|g| !g.is_null())) {
        let gp = format!("{path}.limiter");
        let last_now = u64_at(g, "last_now", &gp)?;
        let ahead = cfg.interval().saturating_mul(u64::from(cfg.burst));
        let tat = u64_at(g, "tat", &gp)?.min(last_now.saturating_add(ahead));
        s.limiter = Some(Gcra { tat, last_now });
    }
    if let (Some(cfg), Some(b)) = (&p.budget, v.get("budget").filter(|b| !b.is_null())) {
        let bp = format!("{path}.budget");
        let state = if let Some(t) = b.get("token") {
            BudgetState::Token { tokens: t.as_i64().ok_or_else(|| LoadError::new(&bp, "token must be an integer"))? }
        } else if let Some(r) = b.get("ratio") {
            BudgetState::Ratio {
                slots: pairs(Some(r), &bp, 2)?
                    .iter()
                    .map(|r| (r.first().copied().unwrap_or(0).max(0) as u64, r.get(1).copied().unwrap_or(0)))
                    .collect(),
            }
        } else {
            return Err(LoadError::new(&bp, "must be {\"token\": n} or {\"ratio\": [...]}"));
        };
        let old_kind = if matches!(state, BudgetState::Token { .. }) { "token" } else { "ratio" };
        let same = matches!((cfg, old_kind), (BudgetCfg::Token { .. }, "token") | (BudgetCfg::Ratio { .. }, "ratio"));
        s.budget = Some(if same { cfg.clamp(state) } else { cfg.fresh() });
    }
    Ok((key, s))
}

/// A policy with every default filled in, as a JSON tree (durations in their text form).
pub fn policy_to_json(p: &Policy) -> Value {
    let d = |ns: Option<u64>| Value::from(ns.map(format_duration));
    let texts = |r: &crate::classify::Rules| Value::from(r.texts());
    let methods: Vec<&str> = crate::classify::HTTP_METHODS
        .iter()
        .enumerate()
        .filter(|(i, _)| *i > 0 && p.idempotent_methods & (1 << i) != 0)
        .map(|(_, m)| *m)
        .collect();
    let backoff = obj([
        ("kind", p.backoff.kind.name().into()),
        ("base", format_duration(p.backoff.base).into()),
        ("multiplier", if p.backoff.kind == Kind::Exponential { p.backoff.multiplier.into() } else { Value::Null }),
        ("cap", format_duration(p.backoff.cap).into()),
        ("jitter", p.backoff.jitter.name().into()),
        (
            "jitter-ratio",
            if p.backoff.jitter == crate::backoff::Jitter::Proportional { p.backoff.jitter_ratio.into() } else { Value::Null },
        ),
    ]);
    let retry_after = obj([
        ("honor", p.retry_after.honor.into()),
        ("cap", format_duration(p.retry_after.cap).into()),
        (
            "over-cap",
            match p.retry_after.over_cap {
                OverCap::Fail => "fail",
                OverCap::Clamp => "clamp",
            }
            .into(),
        ),
    ]);
    let budget = match &p.budget {
        None => Value::Null,
        Some(BudgetCfg::Token { max_milli, ratio_milli }) => obj([
            ("kind", "token".into()),
            ("max-tokens", (*max_milli as f64 / 1000.0).into()),
            ("token-ratio", (*ratio_milli as f64 / 1000.0).into()),
        ]),
        Some(BudgetCfg::Ratio { percent, min_per_second, ttl }) => obj([
            ("kind", "ratio".into()),
            ("percent", (*percent).into()),
            ("min-per-second", (*min_per_second).into()),
            ("ttl", format_duration(*ttl).into()),
        ]),
    };
    let breaker = match &p.breaker {
        None => Value::Null,
        Some(b) => obj([
            (
                "window",
                match b.window {
                    Window::Count(n) => obj([("kind", "count".into()), ("size", n.into())]),
                    Window::Time { size, bucket } => {
                        obj([("kind", "time".into()), ("size", format_duration(size).into()), ("bucket", format_duration(bucket).into())])
                    }
                },
            ),
            ("failure-rate", b.failure_rate.into()),
            ("slow-call-rate", b.slow_call_rate.into()),
            ("slow-call-duration", format_duration(b.slow_call_duration).into()),
            ("minimum-calls", b.minimum_calls.into()),
            ("open-duration", format_duration(b.open_duration).into()),
            ("open-duration-max", format_duration(b.open_duration_max).into()),
            ("open-duration-multiplier", b.open_duration_multiplier.into()),
            ("half-open-permits", b.half_open_permits.into()),
            ("half-open-permit-timeout", format_duration(b.half_open_permit_timeout).into()),
            ("failure-on", texts(&b.failure_on)),
        ]),
    };
    let rate_limit = match &p.rate_limit {
        None => Value::Null,
        Some(r) => obj([
            ("rate", r.rate.into()),
            ("per", format_duration(r.per).into()),
            ("burst", r.burst.into()),
            ("max-wait", format_duration(r.max_wait).into()),
        ]),
    };
    let bulkhead = match &p.bulkhead {
        None => Value::Null,
        Some(b) => obj([("max-concurrent", b.max_concurrent.into())]),
    };
    let fallbacks = Value::List(
        p.fallbacks
            .iter()
            .map(|f| obj([("name", f.name.as_str().into()), ("on", Value::from(f.on.iter().map(|r| r.name()).collect::<Vec<_>>()))]))
            .collect(),
    );
    obj([
        ("name", p.name.as_str().into()),
        ("attempts", p.attempts_preset.written(p.attempts).into()),
        ("attempts-preset", p.attempts_preset.name().into()),
        ("attempt-timeout", d(p.attempt_timeout)),
        ("deadline", d(p.deadline)),
        ("backoff", backoff),
        ("retry-on", texts(&p.retry_on)),
        ("never-retry", texts(&p.never_retry)),
        ("idempotent-methods", methods.into()),
        ("retry-after", retry_after),
        ("budget", budget),
        ("breaker", breaker),
        ("rate-limit", rate_limit),
        ("bulkhead", bulkhead),
        ("fallbacks", fallbacks),
        ("keys", obj([("max", p.max_keys.into())])),
        ("durable", obj([("lease", format_duration(p.durable.lease).into()), ("max-crashes", p.durable.max_crashes.into())])),
    ])
}
