//! Fleet-wide state: one policy's breaker evidence, retry budget and rate limit shared by many
//! processes through a store (Redis), without one process poisoning the others.
//!
//! The core decides and the host carries bytes. A host that runs the `fleet` option keeps,
//! per policy and key, one blob of shared state in the store (this module's wire format,
//! [`wire`]) under a version number, and periodically (or after every outcome, `publish:
//! strict`):
//!
//! 1. reads the blob, its version and the store's clock (`TIME`, wall milliseconds);
//! 2. asks [`Engine::fleet_merge`] for the blob with this engine's evidence merged in;
//! 3. writes it back with a compare-and-set on the version (a Lua script: no lock); on a
//!    conflict it goes back to 2 with the blob the script returned, so no update is lost;
//! 4. hands the accepted blob to [`Engine::fleet_apply`], which applies the fleet's decisions
//!    to the local engine: the quorum rule, the coordination of half-open probes, the merged
//!    retry budget.
//!
//! The rate limit is GCRA evaluated in a Lua script on the store's clock (`fleet/lua/gcra.lua`),
//! with the core's semantics ([`gcra`]); [`Engine::fleet_plan`] gives the host its parameters.
//!
//! **The quorum rule.** Every process trips on its own window. A process whose breaker is
//! closed opens it (the legal closed -> open edge, an event named `fleet-quorum`) when at
//! least `quorum` processes published an open (or half-open) breaker that opened within the
//! last `within` and after the fleet's last successful probe. One bad process therefore only
//! lowers its own traffic while `quorum` is 2 or more. Forced states are an operator's and
//! neither count nor are overridden.
//!
//! **Probes.** An open breaker about to go half-open takes the fleet's probe lease (one
//! holder at a time, `probe-lease` long). While another process holds it, the others stay
//! open until it ends; when the holder closes, the lease is released and the probe's time is
//! recorded, which lifts the open evidence that came before it: the other processes go
//! half-open at once and run their own trials. While the dependency is down the fleet sends
//! one process's `half-open-permits` trials per lease, not one set per process.
//!
//! **The budget** (token kind): each engine adds what its own calls changed since its last
//! publication to the fleet's level (clamped to `[0, max-tokens]`), then adopts the fleet's
//! level, keeping what changed locally in between.
pub mod gcra;
mod rule;
pub mod wire;

use crate::breaker::BreakerCfg;
use crate::budget::BudgetCfg;
use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::rate::parse as parse_rate;
use crate::rate::RateCfg;
use crate::read::{opt_duration, uint};
use crate::time::{MILLISECOND, SECOND};

pub use rule::Marks;

/// When a process publishes its evidence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publish {
    /// In the background, every `publish-every`; the rate limit from leases of `lease` tokens.
    Async,
    /// After every outcome that changed the breaker or budget, before the call returns; every
    /// call takes its own token from the store.
    Strict,
}

/// A policy's `fleet` section, validated, with defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetCfg {
    /// Processes with an open breaker that open the others (default 2).
    pub quorum: u32,
    /// How recent an opening must be to count (default 60s).
    pub within: u64,
    /// Lifetime of a process's published record (default 10s).
    pub ttl: u64,
    /// Publication mode (default async).
    pub publish: Publish,
    /// Interval of asynchronous publication (default 250ms).
    pub publish_every: u64,
    /// Longest wait for one store operation before the host goes local-only (default 5ms).
    pub timeout: u64,
    /// How often a host that went local-only tries the store again (default 1s).
    pub retry_every: u64,
    /// How long one process may hold the fleet's probe (default: the breaker's open-duration).
    pub probe_lease: u64,
    /// Fleet-wide rate limit (GCRA on the store's clock), if any.
    pub rate_limit: Option<RateCfg>,
    /// Tokens a process takes from the fleet's bucket at once in async mode (default 1, at
    /// most the burst).
    pub lease: u32,
    /// Whether the token budget is shared (default: yes when the policy has a token budget).
    pub budget: bool,
    /// Store key prefix (default `levee`).
    pub prefix: String,
}

/// Fields of a `fleet` section.
pub const FIELDS: &[&str] = &[
    "quorum",
    "within",
    "ttl",
    "publish",
    "publish-every",
    "timeout",
    "retry-every",
    "probe-lease",
    "rate-limit",
    "lease",
    "budget",
    "prefix",
];

/// Parse a policy's `fleet` section (at `path`), given the policy's breaker and budget.
pub fn parse(
    path: &str,
    v: &Value,
    breaker: &Option<BreakerCfg>,
    budget: &Option<BudgetCfg>,
    errors: &mut Vec<LoadError>,
) -> Option<FleetCfg> {
    let before = errors.len();
    let mut f = Fields::new(path, v, errors)?;
    let quorum = uint(&mut f, "quorum", 2, 1, 10_000, errors);
    let within = opt_duration(&mut f, "within", errors, true).unwrap_or(60 * SECOND);
    let ttl = opt_duration(&mut f, "ttl", errors, true).unwrap_or(10 * SECOND);
    let publish = match f.take("publish") {
        None => Publish::Async,
        Some(v) => crate::read::choose(&f.path_of("publish"), v, &[("async", Publish::Async), ("strict", Publish::Strict)], errors)
            .unwrap_or(Publish::Async),
    };
    let publish_every = opt_duration(&mut f, "publish-every", errors, true).unwrap_or(250 * MILLISECOND);
    let timeout = opt_duration(&mut f, "timeout", errors, true).unwrap_or(5 * MILLISECOND);
    let retry_every = opt_duration(&mut f, "retry-every", errors, true).unwrap_or(SECOND);
    let probe_lease =
        opt_duration(&mut f, "probe-lease", errors, true).unwrap_or(breaker.as_ref().map(|b| b.open_duration).unwrap_or(60 * SECOND));
    let rate_limit = f.take("rate-limit").and_then(|v| parse_rate(&f.path_of("rate-limit"), v, errors));
    let lease = uint(&mut f, "lease", 1, 1, 1_000_000, errors);
    let shareable = matches!(budget, Some(BudgetCfg::Token { .. } | BudgetCfg::Ratio { .. }));
    let budget = match f.take("budget") {
        None => shareable,
        Some(v) => {
            let shared = crate::read::choose(&f.path_of("budget"), v, &[("shared", true), ("local", false)], errors).unwrap_or(false);
            if shared && !shareable {
                errors.push(LoadError::new(
                    &f.path_of("budget"),
                    "`shared` needs the policy's budget to be of kind `token` or `ratio` (an `aws-adaptive` client rate is measured by each process)",
                ));
            }
            shared
        }
    };
    let prefix = match f.take("prefix") {
        None => "levee".to_string(),
        Some(Value::Str(s))
            if !s.is_empty() && s.len() <= 64 && s.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':')) =>
        {
            s.clone()
        }
        Some(other) => {
            errors.push(LoadError::new(
                &f.path_of("prefix"),
                format!("must be 1 to 64 characters of letters, digits, `-`, `_`, `.` and `:`, found {}", crate::read::describe(other)),
            ));
            "levee".to_string()
        }
    };
    if ttl < publish_every.saturating_mul(2) {
        errors.push(LoadError::new(
            &f.path_of("ttl"),
            "must be at least twice `publish-every`, or a live process's record expires between its publications",
        ));
    }
    if timeout > SECOND {
        errors.push(LoadError::new(&f.path_of("timeout"), "must be at most 1s: the store is consulted on the data path"));
    }
    if let Some(r) = &rate_limit {
        if lease > r.burst {
            errors.push(LoadError::new(
                &f.path_of("lease"),
                format!("must be at most the fleet rate limit's burst ({}): a lease is taken from the bucket at once", r.burst),
            ));
        }
        if r.interval().saturating_mul(u64::from(r.burst)) > 1_000 * 3_600 * SECOND {
            errors.push(LoadError::new(
                &f.path_of("rate-limit"),
                "holds more than 1000 hours of tokens (per / rate * burst): the store's script counts in exact nanoseconds up to that",
            ));
        }
    }
    if breaker.is_none() && rate_limit.is_none() && !budget {
        errors.push(LoadError::new(path, "shares nothing: give the policy a `breaker`, a `token` budget, or a `fleet.rate-limit`"));
    }
    f.finish(FIELDS, errors);
    if errors.len() > before {
        return None;
    }
    Some(FleetCfg { quorum, within, ttl, publish, publish_every, timeout, retry_every, probe_lease, rate_limit, lease, budget, prefix })
}

impl FleetCfg {
    /// What a host needs to run the fleet option for `policy`, as a JSON value (durations in
    /// nanoseconds). `key-prefix` followed by a key and `}` names the key's store entries
    /// (`:s` state, `:r` rate), hashed by policy and key on a Redis Cluster. The rate limit's
    /// `max-wait` is already capped by the policy's `deadline`: a wait that cannot fit it is a
    /// reject, as in the engine's own limiter.
    pub fn plan(&self, policy: &str, has_breaker: bool, deadline: Option<u64>) -> Value {
        let rate = match &self.rate_limit {
            None => Value::Null,
            Some(r) => obj([
                ("interval", r.interval().into()),
                ("burst", r.burst.into()),
                ("max-wait", r.max_wait.min(deadline.unwrap_or(u64::MAX)).into()),
                ("lease", if self.publish == Publish::Strict { 1u32.into() } else { self.lease.into() }),
            ]),
        };
        obj([
            ("policy", policy.into()),
            ("key-prefix", format!("{}:{{{}/", self.prefix, policy).into()),
            ("publish", if self.publish == Publish::Strict { "strict" } else { "async" }.into()),
            ("publish-every", self.publish_every.into()),
            ("timeout", self.timeout.into()),
            ("retry-every", self.retry_every.into()),
            ("ttl", self.ttl.into()),
            ("breaker", has_breaker.into()),
            ("budget", self.budget.into()),
            ("rate-limit", rate),
        ])
    }
}

impl crate::Engine {
    /// The fleet plan of a policy as JSON (see [`FleetCfg::plan`]); `None` for an unknown
    /// policy or one without a `fleet` section.
    pub fn fleet_plan(&self, policy: u32) -> Option<String> {
        let p = self.policy(policy)?;
        let f = p.fleet.as_ref()?;
        Some(crate::doc::to_json(&f.plan(&p.name, p.breaker.is_some(), p.deadline)))
    }
}
