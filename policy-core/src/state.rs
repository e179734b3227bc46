//! Engine state as versioned bytes. Each strategy writes and reads its own state
//! (`Breaker::to_json`, `BreakerCfg::import`, ...); this module frames them.
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

use crate::breaker::Breaker;
use crate::budget::BudgetState;
use crate::doc::{self, obj, Value};
use crate::engine::{holds_protection, refile, Engine, KeyState, Keys, BUSY, GUARD, OVERFLOW, OVERFLOW_KEY, REST, SHARED};
use crate::error::LoadError;
use crate::policy::Policy;
use crate::rate::Gcra;
use crate::read::u64_at;
use crate::rng::Rng;

const FORMAT: &str = "levee-state";

/// Largest state `import-state` reads (bytes): what `export-state` gives for 200,000 keys with
/// a small breaker window, and far more keys holding protection than a recovery snapshot
/// (`export-snapshot`) carries in practice. It stays well inside the guest's 512 MiB with the
/// parsed tree beside it.
pub const MAX_STATE_BYTES: usize = 64 << 20;
const VERSION: u64 = 1;

impl Engine {
    /// The whole engine state as versioned bytes.
    pub fn export_state(&self) -> Vec<u8> {
        self.export_keys(|_, keys| keys.iter().map(|(_, k, s)| (k, s)).collect())
    }

    /// What a fresh engine would not reproduce, in the format of [`export_state`](Self::export_state):
    /// the keys holding protection (`engine::holds_protection`, judged at each key's own latest
    /// time, so a protection that may have ended since is kept), with the RNG and the tick.
    /// It reads the guarded list, the busy one and the overflow entry, never the keys at rest:
    /// its cost follows the keys holding protection or attempts, not the table's size.
    pub fn export_snapshot(&self) -> Vec<u8> {
        self.export_keys(|p, keys| {
            let mut out = Vec::new();
            for list in [GUARD, BUSY, OVERFLOW, SHARED] {
                let mut at = keys.front(list);
                while let Some(i) = at {
                    at = keys.next(i);
                    if let Some((k, s)) = keys.get(i) {
                        if list == GUARD || holds_protection(p, s, 0) {
                            out.push((k, s));
                        }
                    }
                }
            }
            out
        })
    }

    fn export_keys<'a>(&'a self, select: impl Fn(&'a Policy, &'a Keys) -> Vec<(&'a std::sync::Arc<str>, &'a KeyState)>) -> Vec<u8> {
        let policies: Vec<Value> = self
            .policies
            .iter()
            .zip(self.keys.iter())
            .map(|(p, keys)| {
                // By name: the bytes never depend on the table's layout.
                let mut sorted = select(p, keys);
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
            doc::parse_json_limited(text, MAX_STATE_BYTES).map_err(|e| LoadError::new("", format!("not Levee state: {}", e.message)))?;
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
            // Keep the overflow entry, then the keys holding protection, then the most recently
            // used keys within the bound (ties by name, the order they were exported in), and
            // file them least recently used first, each on its list. A name given twice keeps
            // its most recent entry.
            let mut overflow = None;
            let mut shared = None;
            let mut ranked: Vec<(bool, String, KeyState)> = Vec::with_capacity(parsed.len());
            for (k, st) in parsed {
                if k == OVERFLOW_KEY {
                    if overflow.as_ref().is_none_or(|o: &KeyState| st.last_used > o.last_used) {
                        overflow = Some(st);
                    }
                } else if k.is_empty() && p.scopes.any() {
                    // The policy's shared entry (`scope: policy`): kept, on its own list.
                    if shared.as_ref().is_none_or(|o: &KeyState| st.last_used > o.last_used) {
                        shared = Some(st);
                    }
                } else {
                    ranked.push((holds_protection(p, &st, 0), k, st));
                }
            }
            ranked.sort_unstable_by(|(_, a, sa), (_, b, sb)| sb.last_used.cmp(&sa.last_used).then_with(|| a.cmp(b)));
            let mut seen = std::collections::BTreeSet::new();
            ranked.retain(|(_, k, _)| seen.insert(k.clone()));
            // Stable: protection first, recency within each group.
            ranked.sort_by_key(|(guarded, _, _)| !*guarded);
            ranked.truncate(p.max_keys as usize);
            ranked.sort_by(|(_, a, sa), (_, b, sb)| sa.last_used.cmp(&sb.last_used).then_with(|| b.cmp(a)));
            for (_, k, st) in ranked {
                if target.find(k.as_str()).is_none() {
                    let at = target.insert(std::sync::Arc::from(k), st, REST);
                    refile(target, p, at, 0);
                }
            }
            if let Some(st) = overflow {
                target.insert(std::sync::Arc::from(OVERFLOW_KEY), st, OVERFLOW);
            }
            if let Some(st) = shared {
                target.insert(std::sync::Arc::from(""), st, SHARED);
            }
        }
        self.keys = new_keys;
        self.rng = Rng::from_state(words);
        self.tick = self.tick.max(tick);
        Ok(())
    }
}

fn fingerprint(p: &Policy) -> Value {
    obj([("window", p.breaker.as_ref().map(|b| b.window.fingerprint()).unwrap_or(Value::Null))])
}

fn key_to_json(p: &Policy, key: &str, s: &KeyState) -> Value {
    let or_null = |v: Option<Value>| v.unwrap_or(Value::Null);
    let mut out = obj([
        ("key", key.into()),
        ("last_used", s.last_used.into()),
        ("breaker", or_null(s.breaker.as_ref().map(Breaker::to_json))),
        ("limiter", or_null(s.limiter.as_ref().map(Gcra::to_json))),
        ("budget", or_null(s.budget.as_ref().map(BudgetState::to_json))),
    ]);
    // Added after version 1's first release: present only when the policy has it.
    if let (Value::Map(entries), Some(cfg), Some(l)) = (&mut out, &p.concurrency, &s.adaptive) {
        entries.push(("concurrency".to_string(), l.to_json(cfg)));
    }
    out
}

fn key_from_json(p: &Policy, v: &Value, path: &str, same_window: bool) -> Result<(String, KeyState), LoadError> {
    let key = v.get("key").and_then(Value::as_str).ok_or_else(|| LoadError::new(&format!("{path}.key"), "must be a string"))?.to_string();
    let mut s = KeyState::fresh(p, u64_at(v, "last_used", path)?);
    if let (Some(cfg), Some(b)) = (&p.breaker, v.get("breaker").filter(|b| !b.is_null())) {
        s.breaker = Some(cfg.import(b, &format!("{path}.breaker"), same_window)?);
    }
    if let (Some(cfg), Some(g)) = (&p.rate_limit, v.get("limiter").filter(|g| !g.is_null())) {
        s.limiter = Some(cfg.import(g, &format!("{path}.limiter"))?);
    }
    if let (Some(cfg), Some(b)) = (&p.budget, v.get("budget").filter(|b| !b.is_null())) {
        s.budget = Some(cfg.import(b, &format!("{path}.budget"))?);
    }
    if let (Some(cfg), Some(c)) = (&p.concurrency, v.get("concurrency").filter(|c| !c.is_null())) {
        s.adaptive = Some(Box::new(cfg.import(c, &format!("{path}.concurrency"))?));
    }
    Ok((key, s))
}
