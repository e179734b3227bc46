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
//! new bounds). Everything is validated before anything changes: garbage or a foreign version
//! is an error and leaves the engine as it was.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::backoff::Kind;
use crate::breaker::{Breaker, Window, WindowState};
use crate::budget::{BudgetCfg, BudgetState};
use crate::engine::{Engine, KeyState};
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
                let keys: Vec<Value> = keys.iter().map(|(k, s)| key_to_json(p, k, s)).collect();
                json!({ "name": p.name, "fingerprint": fingerprint(p), "keys": keys })
            })
            .collect();
        let doc = json!({
            "format": FORMAT,
            "version": VERSION,
            "rng": self.rng.state().to_vec(),
            "tick": self.tick,
            "policies": policies,
        });
        doc.to_string().into_bytes()
    }

    /// Restore exported state; see the module documentation. On error nothing changes.
    pub fn import_state(&mut self, bytes: &[u8]) -> Result<(), LoadError> {
        let doc: Value = serde_json::from_slice(bytes).map_err(|e| LoadError::new("", format!("not Levee state: {e}")))?;
        let obj = doc.as_object().ok_or_else(|| LoadError::new("", "not Levee state: expected a JSON object"))?;
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
        let rng_words = obj.get("rng").and_then(Value::as_array).ok_or_else(|| LoadError::new("rng", "is missing"))?;
        let mut words = [0u64; 4];
        if rng_words.len() != 4 {
            return Err(LoadError::new("rng", "must hold 4 words"));
        }
        for (w, v) in words.iter_mut().zip(rng_words) {
            *w = v.as_u64().ok_or_else(|| LoadError::new("rng", "words must be unsigned 64-bit integers"))?;
        }
        let tick = obj.get("tick").and_then(Value::as_u64).ok_or_else(|| LoadError::new("tick", "is missing"))?;
        let policies = obj.get("policies").and_then(Value::as_array).ok_or_else(|| LoadError::new("policies", "is missing"))?;

        let mut new_keys: Vec<BTreeMap<String, KeyState>> = self.policies.iter().map(|_| BTreeMap::new()).collect();
        for (i, entry) in policies.iter().enumerate() {
            let path = format!("policies[{i}]");
            let name = entry.get("name").and_then(Value::as_str).ok_or_else(|| LoadError::new(&path, "has no name"))?;
            let old_fingerprint = entry.get("fingerprint").cloned().unwrap_or(Value::Null);
            let keys = entry.get("keys").and_then(Value::as_array).ok_or_else(|| LoadError::new(&path, "has no keys"))?;
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
            // Keep the most recently used keys within the bound.
            parsed.sort_by_key(|(_, s)| std::cmp::Reverse(s.last_used));
            parsed.truncate(p.max_keys as usize);
            target.extend(parsed);
        }
        self.keys = new_keys;
        self.rng = Rng::from_state(words);
        self.tick = self.tick.max(tick);
        Ok(())
    }
}

fn fingerprint(p: &Policy) -> Value {
    json!({
        "window": p.breaker.as_ref().map(|b| match b.window {
            Window::Count(n) => json!({"kind": "count", "size": n}),
            Window::Time { size, bucket } => json!({"kind": "time", "size": size, "bucket": bucket}),
        }),
    })
}

fn key_to_json(_p: &Policy, key: &str, s: &KeyState) -> Value {
    let breaker = s.breaker.as_ref().map(|b| {
        let window = match &b.window {
            WindowState::Count { ring, pos, failures, slow } => {
                json!({"count": {"ring": ring, "pos": pos, "failures": failures, "slow": slow}})
            }
            WindowState::Time { buckets } => json!({"time": buckets.iter().map(|(i, c, f, s)| json!([i, c, f, s])).collect::<Vec<_>>()}),
        };
        json!({
            "state": b.state.name(),
            "open_until": b.open_until,
            "trips": b.trips,
            "epoch": b.epoch,
            "permits": b.permits.iter().map(|(c, at)| json!([c, at])).collect::<Vec<_>>(),
            "issued": b.issued,
            "trial": [b.trial.0, b.trial.1, b.trial.2],
            "last_now": b.last_now,
            "window": window,
        })
    });
    let limiter = s.limiter.as_ref().map(|g| json!({"tat": g.tat, "last_now": g.last_now}));
    let budget = s.budget.as_ref().map(|b| match b {
        BudgetState::Token { tokens } => json!({"token": tokens}),
        BudgetState::Ratio { slots } => json!({"ratio": slots.iter().map(|(s, v)| json!([s, v])).collect::<Vec<_>>()}),
    });
    json!({ "key": key, "last_used": s.last_used, "breaker": breaker, "limiter": limiter, "budget": budget })
}

fn u64_at(v: &Value, field: &str, path: &str) -> Result<u64, LoadError> {
    v.get(field).and_then(Value::as_u64).ok_or_else(|| LoadError::new(&format!("{path}.{field}"), "must be an unsigned integer"))
}

fn u32_at(v: &Value, field: &str, path: &str) -> Result<u32, LoadError> {
    u64_at(v, field, path).and_then(|n| u32::try_from(n).map_err(|_| LoadError::new(&format!("{path}.{field}"), "is out of range")))
}

fn pairs(v: Option<&Value>, path: &str, width: usize) -> Result<Vec<Vec<i64>>, LoadError> {
    let items = v.and_then(Value::as_array).ok_or_else(|| LoadError::new(path, "must be a list"))?;
    items
        .iter()
        .map(|item| {
            let row = item
                .as_array()
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
        let trial = pairs(Some(&json!([b.get("trial").cloned().unwrap_or(Value::Null)])), &format!("{bp}.trial"), 3)?;
        let trial = trial.first().cloned().unwrap_or_default();
        let t = |i: usize| trial.get(i).copied().unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32;
        let window_v = b.get("window").ok_or_else(|| LoadError::new(&format!("{bp}.window"), "is missing"))?;
        let window = if let Some(c) = window_v.get("count") {
            let wp = format!("{bp}.window.count");
            let ring: Vec<u8> = c
                .get("ring")
                .and_then(Value::as_array)
                .ok_or_else(|| LoadError::new(&wp, "ring must be a list"))?
                .iter()
                .map(|x| x.as_u64().filter(|b| *b < 4).map(|b| b as u8).ok_or_else(|| LoadError::new(&wp, "ring entries are 0 to 3")))
                .collect::<Result<_, _>>()?;
            let failures = ring.iter().filter(|b| *b & 1 != 0).count() as u32;
            let slow = ring.iter().filter(|b| *b & 2 != 0).count() as u32;
            let pos = u32_at(c, "pos", &wp)?;
            WindowState::Count { pos: if ring.is_empty() { 0 } else { pos % ring.len() as u32 }, ring, failures, slow }
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

/// A policy with every default filled in, as JSON (durations in their text form).
pub fn policy_to_json(p: &Policy) -> Value {
    let d = |ns: Option<u64>| ns.map(format_duration);
    let mut m = Map::new();
    m.insert("name".into(), json!(p.name));
    m.insert("attempts".into(), json!(p.attempts));
    m.insert("attempt-timeout".into(), json!(d(p.attempt_timeout)));
    m.insert("deadline".into(), json!(d(p.deadline)));
    m.insert(
        "backoff".into(),
        json!({
            "kind": p.backoff.kind.name(),
            "base": format_duration(p.backoff.base),
            "multiplier": if p.backoff.kind == Kind::Exponential { json!(p.backoff.multiplier) } else { Value::Null },
            "cap": format_duration(p.backoff.cap),
            "jitter": p.backoff.jitter.name(),
            "jitter-ratio": if p.backoff.jitter == crate::backoff::Jitter::Proportional { json!(p.backoff.jitter_ratio) } else { Value::Null },
        }),
    );
    m.insert("retry-on".into(), json!(p.retry_on.texts()));
    m.insert("never-retry".into(), json!(p.never_retry.texts()));
    let methods: Vec<&str> = crate::classify::HTTP_METHODS
        .iter()
        .enumerate()
        .filter(|(i, _)| *i > 0 && p.idempotent_methods & (1 << i) != 0)
        .map(|(_, m)| *m)
        .collect();
    m.insert("idempotent-methods".into(), json!(methods));
    m.insert(
        "retry-after".into(),
        json!({"honor": p.retry_after.honor, "cap": format_duration(p.retry_after.cap), "over-cap": match p.retry_after.over_cap { OverCap::Fail => "fail", OverCap::Clamp => "clamp" }}),
    );
    m.insert(
        "budget".into(),
        match &p.budget {
            None => Value::Null,
            Some(BudgetCfg::Token { max_milli, ratio_milli }) => {
                json!({"kind": "token", "max-tokens": *max_milli as f64 / 1000.0, "token-ratio": *ratio_milli as f64 / 1000.0})
            }
            Some(BudgetCfg::Ratio { percent, min_per_second, ttl }) => {
                json!({"kind": "ratio", "percent": percent, "min-per-second": min_per_second, "ttl": format_duration(*ttl)})
            }
        },
    );
    m.insert(
        "breaker".into(),
        match &p.breaker {
            None => Value::Null,
            Some(b) => json!({
                "window": match b.window {
                    Window::Count(n) => json!({"kind": "count", "size": n}),
                    Window::Time { size, bucket } => json!({"kind": "time", "size": format_duration(size), "bucket": format_duration(bucket)}),
                },
                "failure-rate": b.failure_rate,
                "slow-call-rate": b.slow_call_rate,
                "slow-call-duration": format_duration(b.slow_call_duration),
                "minimum-calls": b.minimum_calls,
                "open-duration": format_duration(b.open_duration),
                "open-duration-max": format_duration(b.open_duration_max),
                "open-duration-multiplier": b.open_duration_multiplier,
                "half-open-permits": b.half_open_permits,
                "half-open-permit-timeout": format_duration(b.half_open_permit_timeout),
                "failure-on": b.failure_on.texts(),
            }),
        },
    );
    m.insert(
        "rate-limit".into(),
        match &p.rate_limit {
            None => Value::Null,
            Some(r) => json!({"rate": r.rate, "per": format_duration(r.per), "burst": r.burst, "max-wait": format_duration(r.max_wait)}),
        },
    );
    m.insert(
        "bulkhead".into(),
        match &p.bulkhead {
            None => Value::Null,
            Some(b) => json!({"max-concurrent": b.max_concurrent}),
        },
    );
    m.insert(
        "fallbacks".into(),
        json!(p
            .fallbacks
            .iter()
            .map(|f| json!({"name": f.name, "on": f.on.iter().map(|r| r.name()).collect::<Vec<_>>()}))
            .collect::<Vec<_>>()),
    );
    m.insert("keys".into(), json!({"max": p.max_keys}));
    Value::Object(m)
}
