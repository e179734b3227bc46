//! The filter's request logic, free of the proxy-wasm ABI so that it runs (and is tested)
//! natively: admission, the retry headers for the router, feeding each attempt back, and
//! the shared state across workers.
//!
//! # State across workers
//! Each Envoy worker runs its own Wasm VM, so each has its own engine, one per worker: it
//! holds the worker's live calls, and a key's state only as a copy. The key's state
//! (breaker, limiter, budget, in-flight count) lives in the proxy's shared data as
//! [`levee_core::Engine::export_key`] bytes. Every operation on a key reads the bytes and
//! their CAS version, imports them into the worker's engine (unless they are the bytes the
//! engine's copy was last synced to), runs the core, exports and writes back with the
//! version read. On a mismatch another worker changed the key in between: the operation is
//! undone (the call put back as it was: see [`Gate::complete`]) and runs again on fresh
//! bytes, so N workers admit exactly what one engine would. After `cas-retries` mismatches
//! in a row the filter fails open (the request goes on without the filter's decision) and
//! counts it.
//!
//! Shared data has no delete, so keys are registered first in one bounded registry per
//! policy (the policy's `keys.max`); a key past the bound fails open and is counted.
//!
//! # Clock
//! The ABI's only clock is wall time. [`Clock`] hands the core the largest time it has seen,
//! so a wall clock stepped back reads as no time passing (and is counted).

use std::collections::HashMap;

use levee_core::classify::Rule;
use levee_core::{Engine, HedgeCommand, OutcomeKind, Reason, Verdict, VerdictKind};

use crate::config::{FallbackAction, FilterConfig};
use crate::envoy::{ms_ceil, request_headers, retry_on, RetryOn, NO_RETRY};

/// `report` flag of the WIT: the response is marked overloaded (`x-envoy-overloaded`).
const FLAG_OVERLOADED: u32 = 1;
/// Where the HTTP method sits in `start`'s flags (the WIT's bits 8-11).
const METHOD_SHIFT: u32 = 8;

/// Request header: the application's attempt number (1 on the first), which it retries itself.
pub const HEADER_ATTEMPT: &str = "x-levee-attempt";
/// Longest key kept in shared data, in bytes.
pub const MAX_KEY_BYTES: usize = 256;

/// The proxy's shared data (`get_shared_data` / `set_shared_data`).
pub trait Store {
    /// The value and its CAS version (0: absent).
    fn get(&self, key: &str) -> (Option<Vec<u8>>, u32);
    /// Write if the version is still `cas` (0: unconditionally). `Err(true)`: CAS mismatch.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool>;
}

/// A [`Store`] in memory with Envoy's shared-data semantics: one version counter bumped by every
/// write to any key, compare-and-swap on it, shareable across threads as Envoy's workers share
/// the real one. For tests, benchmarks and diagnostics that run the gate without a proxy.
#[derive(Debug, Default)]
pub struct MemoryStore(std::sync::Mutex<Versioned>);

/// Each key's value and the version its last write got, and the last version given out.
#[derive(Debug, Default)]
struct Versioned {
    values: std::collections::HashMap<String, (Vec<u8>, u32)>,
    version: u32,
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Versioned> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for MemoryStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        self.lock().values.get(key).map(|(v, c)| (Some(v.clone()), *c)).unwrap_or((None, 0))
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
        let mut m = self.lock();
        let next = m.version.wrapping_add(1);
        match m.values.get_mut(key) {
            Some(e) if cas != 0 && e.1 != cas => return Err(true),
            Some(e) => *e = (value.to_vec(), next),
            None => {
                m.values.insert(key.to_string(), (value.to_vec(), next));
            }
        }
        m.version = next;
        Ok(())
    }
}

/// Wall time made monotonic: the largest time seen.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    last: u64,
    /// Times the wall clock was seen going backwards.
    pub backwards: u64,
}

impl Clock {
    /// `now` for the core from a wall-clock reading in ns.
    pub fn now(&mut self, wall_ns: u64) -> u64 {
        if wall_ns < self.last {
            self.backwards += 1;
        } else {
            self.last = wall_ns;
        }
        self.last
    }
}

/// Counters the glue maps to Envoy metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests forwarded under the filter's decision.
    pub admitted: u64,
    /// Requests answered locally (rejections).
    pub rejected: u64,
    /// Fallbacks run.
    pub fallbacks: u64,
    /// Operations that failed open after `cas-retries` CAS mismatches.
    pub cas_fail_open: u64,
    /// Requests that failed open because their key could not be registered (bound reached, too long).
    pub keys_fail_open: u64,
    /// Operations that failed open because the shared bytes were not Levee key state.
    pub state_fail_open: u64,
    /// CAS mismatches seen (each one retried).
    pub cas_mismatches: u64,
}

/// Why an operation failed open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Too many CAS mismatches in a row.
    Contention,
    /// The key could not be registered.
    Keys,
    /// The shared bytes did not import.
    State,
}

/// A request the filter manages: a live call of the worker's engine.
#[derive(Clone, Debug)]
pub struct Call {
    id: u64,
    key: String,
    flags: u32,
    started: u64,
    /// The key's bytes the admission ran on: the call is made again from them when an
    /// operation on it must be undone.
    admitted_on: Vec<u8>,
    /// Retries (for a hedged policy, hedges) the router was allowed.
    pub max_retries: u32,
    /// The policy hedges: the core's call runs hedged attempts (`report_attempt`).
    hedged: bool,
    done: bool,
}

impl Call {
    /// The filter has nothing left to do for this request.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

/// What to do with a request's headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Forward, setting these request headers.
    Forward(Vec<(&'static str, String)>),
    /// Answer locally.
    Reply(Reply),
    /// Run the fallback cluster call.
    Dispatch {
        /// Cluster.
        cluster: String,
        /// `:authority` override.
        authority: Option<String>,
        /// Timeout in ms.
        timeout_ms: u64,
    },
    /// The filter did not decide (see the fault); the request goes on as the route says.
    FailOpen(Fault),
}

/// A local response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Status.
    pub status: u16,
    /// Headers.
    pub headers: Vec<(&'static str, String)>,
    /// Body.
    pub body: String,
}

/// What the router reported of a request's attempts.
#[derive(Clone, Debug, Default)]
pub struct Response<'a> {
    /// Final status.
    pub status: u16,
    /// `x-envoy-attempt-count` (1 when absent).
    pub attempts: u32,
    /// Raw `retry-after`.
    pub retry_after: &'a str,
    /// `x-envoy-overloaded` was set.
    pub overloaded: bool,
}

/// One worker's gate: the validated configuration, the worker's engine and what it needs to
/// run requests.
#[derive(Debug)]
pub struct Gate {
    /// `cfg.engine` is the worker's engine: its live calls, and copies of its keys' states.
    cfg: FilterConfig,
    retry_on: RetryOn,
    static_headers: Vec<(&'static str, String)>,
    prefix: String,
    max_keys: u32,
    /// `attempts - 1` of the policy.
    max_retries: u32,
    /// An outcome the router retries, as the core classifies it (see `probe_outcome`).
    probe: Option<(OutcomeKind, i32)>,
    /// A fresh key's bytes.
    fresh: Vec<u8>,
    /// Per key, the bytes the engine's copy of its state was last synced to (imported, or
    /// exported and written): when shared data still holds them, no import is needed.
    synced: HashMap<String, Vec<u8>>,
    worker: u64,
    seq: u64,
    /// The monotonic clock.
    pub clock: Clock,
    /// Counters.
    pub stats: Stats,
}

fn method_number(method: &str) -> u32 {
    match method {
        "GET" => 1,
        "HEAD" => 2,
        "POST" => 3,
        "PUT" => 4,
        "DELETE" => 5,
        "PATCH" => 6,
        "OPTIONS" => 7,
        "TRACE" => 8,
        "CONNECT" => 9,
        "" => 0,
        _ => 15,
    }
}

fn secs_ceil(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

fn is(v: Verdict, kind: VerdictKind) -> bool {
    v.kind() == Some(kind)
}

/// An outcome the router retries under this policy, as the core classifies it: the first
/// retriable 5xx, else the first retriable status, else a connection error or timeout.
fn probe_outcome(cfg: &FilterConfig, retry_on: &RetryOn) -> Option<(OutcomeKind, i32)> {
    let codes = &retry_on.status_codes;
    if let Some(c) = codes.iter().find(|c| **c >= 500).or(codes.first()) {
        return Some((OutcomeKind::HttpStatus, i32::from(*c)));
    }
    let p = cfg.engine.policy(cfg.policy)?;
    p.retry_on.0.iter().find_map(|r| match r {
        Rule::ConnectionError => Some((OutcomeKind::ConnectionError, 0)),
        Rule::Timeout => Some((OutcomeKind::Timeout, 0)),
        _ => None,
    })
}

impl Gate {
    /// A gate for a configuration; `worker` makes call ids unique across workers.
    pub fn new(cfg: FilterConfig, worker: u64) -> Gate {
        let policy = cfg.engine.policy(cfg.policy).cloned();
        let retry_on =
            policy.as_ref().map(retry_on).unwrap_or(RetryOn { http: vec![], status_codes: vec![], grpc: vec![], unmapped: vec![] });
        let static_headers = policy.as_ref().map(|p| request_headers(p, &retry_on)).unwrap_or_default();
        let prefix = format!("levee:{}:", policy.as_ref().map(|p| p.name.as_str()).unwrap_or(""));
        let max_keys = policy.as_ref().map(|p| p.max_keys).unwrap_or(1).min(65_536);
        let max_retries = policy.as_ref().map(crate::envoy::num_retries).unwrap_or(0);
        let probe = probe_outcome(&cfg, &retry_on);
        // The engine holds no key yet: this is a fresh key's state (the same for every name).
        let fresh = cfg.engine.export_key(cfg.policy, "").unwrap_or_default();
        Gate {
            cfg,
            retry_on,
            static_headers,
            prefix,
            max_keys,
            max_retries,
            probe,
            fresh,
            synced: HashMap::new(),
            // Never 0, so that no call id is 0.
            worker: (worker & 0xFF_FFFF).max(1),
            seq: 0,
            clock: Clock::default(),
            stats: Stats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &FilterConfig {
        &self.cfg
    }

    fn next_id(&mut self) -> u64 {
        self.seq = (self.seq + 1) & ((1 << 40) - 1);
        (self.worker << 40) | self.seq.max(1)
    }

    /// Register `key` in the policy's bounded registry, so that it may be created.
    fn register(&self, store: &impl Store, key: &str, mismatches: &mut u64) -> Result<(), Fault> {
        let reg = format!("{}#keys", self.prefix);
        for _ in 0..=self.cfg.cas_retries {
            let (bytes, cas) = store.get(&reg);
            let bytes = bytes.unwrap_or_default();
            let known = bytes.split(|b| *b == b'\n').filter(|k| !k.is_empty());
            let (mut count, mut found) = (0u32, false);
            for k in known {
                count += 1;
                found |= k == key.as_bytes();
            }
            if found {
                return Ok(()); // registered by another worker, which creates the value next
            }
            if count >= self.max_keys {
                return Err(Fault::Keys);
            }
            let mut next = bytes;
            next.extend_from_slice(key.as_bytes());
            next.push(b'\n');
            match store.set(&reg, &next, cas) {
                Ok(()) => {
                    // Only the worker that registered a key creates it; nobody writes it with
                    // version 0 again, so no later write is lost.
                    return store.set(&self.shared_key(key), &self.fresh, 0).map_err(|_| Fault::State);
                }
                Err(true) => *mismatches += 1,
                Err(false) => return Err(Fault::State),
            }
        }
        Err(Fault::Contention)
    }

    fn shared_key(&self, key: &str) -> String {
        let mut s = String::with_capacity(self.prefix.len() + key.len());
        s.push_str(&self.prefix);
        s.push_str(key);
        s
    }

    /// Run `op` on the worker's engine holding the key's shared state (the bytes read are
    /// its second argument), and publish the result with compare-and-swap; on a mismatch
    /// `undo` puts the engine's calls back as they were before `op` (false: it cannot, the
    /// operation fails open) and the operation runs again on fresh bytes, failing open after
    /// `cas-retries`. On an error `undo` has run. Returns `op`'s answer and the bytes read.
    fn with_key<T>(
        &mut self,
        store: &impl Store,
        key: &str,
        mut op: impl FnMut(&mut Engine, &[u8]) -> Result<T, Fault>,
        mut undo: impl FnMut(&mut Engine) -> bool,
    ) -> Result<(T, Vec<u8>), Fault> {
        let skey = self.shared_key(key);
        let pi = self.cfg.policy;
        let mut registered = false;
        let mut fault = Fault::Contention;
        for _ in 0..=self.cfg.cas_retries {
            let (bytes, cas) = store.get(&skey);
            let Some(bytes) = bytes.filter(|_| cas != 0) else {
                if !registered {
                    registered = true;
                    let mut mismatches = 0;
                    let r = self.register(store, key, &mut mismatches);
                    self.stats.cas_mismatches += mismatches;
                    r?;
                } else {
                    // Registered by another worker that has not created it yet.
                    self.stats.cas_mismatches += 1;
                }
                continue;
            };
            let e = &mut self.cfg.engine;
            // A table at its bound may have evicted the key's copy: then import anyway.
            let full = e.policy(pi).is_some_and(|p| e.key_count(pi) >= p.max_keys as usize);
            if full || self.synced.get(key).is_none_or(|s| *s != bytes) {
                self.synced.remove(key);
                if e.import_key(pi, key, &bytes).is_err() {
                    return Err(Fault::State);
                }
            }
            let out = op(e, &bytes);
            if e.has_events() {
                e.drain_events();
            }
            let (Ok(out), Some(next)) = (out, e.export_key(pi, key)) else {
                fault = Fault::State;
                break;
            };
            let written = if next == bytes { Ok(()) } else { store.set(&skey, &next, cas) };
            match written {
                Ok(()) => {
                    match self.synced.get_mut(key) {
                        Some(s) => *s = next,
                        None => {
                            self.synced.insert(key.to_string(), next);
                        }
                    }
                    return Ok((out, bytes));
                }
                Err(true) => {
                    // The engine's copy is not what shared data holds: imported next time.
                    self.synced.remove(key);
                    self.stats.cas_mismatches += 1;
                    if !undo(&mut self.cfg.engine) {
                        return Err(Fault::State);
                    }
                }
                Err(false) => {
                    fault = Fault::State;
                    break;
                }
            }
        }
        self.synced.remove(key);
        if fault == Fault::State {
            undo(&mut self.cfg.engine);
        }
        Err(fault)
    }

    fn count_fault(&mut self, f: Fault) {
        match f {
            Fault::Contention => self.stats.cas_fail_open += 1,
            Fault::Keys => self.stats.keys_fail_open += 1,
            Fault::State => self.stats.state_fail_open += 1,
        }
    }

    /// Admission of a request: `key` as the configuration says, `method` its `:method`,
    /// `app_attempt` the application's `x-levee-attempt` when it retries the request itself.
    pub fn admit(&mut self, store: &impl Store, wall_ns: u64, key: &str, method: &str, app_attempt: Option<u32>) -> (Admit, Option<Call>) {
        let now = self.clock.now(wall_ns);
        if key.len() > MAX_KEY_BYTES || key.contains('\n') {
            self.stats.keys_fail_open += 1;
            return (Admit::FailOpen(Fault::Keys), None);
        }
        let id = self.next_id();
        let (pi, flags) = (self.cfg.policy, method_number(method) << METHOD_SHIFT);
        // The application retries this request: one layer retries, so the router does not.
        let probe = self.probe.filter(|_| app_attempt.is_none() && self.max_retries > 0);
        let max = self.max_retries;
        let result = self.with_key(
            store,
            key,
            |e, bytes| {
                let mut v = e.start(id, pi, key, flags, now, 0, 0, 0);
                let mut left = 0;
                let probed = match (v.kind(), probe) {
                    (Some(VerdictKind::Attempt), Some((kind, code))) => {
                        left = retries_left(e, id, now, kind, code, max);
                        true
                    }
                    (Some(VerdictKind::Hedge), _) if app_attempt.is_none() => {
                        left = hedges_left(e, id, now, max);
                        true
                    }
                    _ => false,
                };
                if probed {
                    // The replay changed the key and ended the call: both are made again from
                    // the bytes read, exactly as the first `start` made them.
                    e.cancel(id, now);
                    e.import_key(pi, key, bytes).map_err(|_| Fault::State)?;
                    v = e.start(id, pi, key, flags, now, 0, 0, 0);
                }
                if is(v, VerdictKind::Wait) {
                    // The ABI gives an HTTP context no timer: the wait is the client's (Retry-After).
                    e.cancel(id, now);
                }
                Ok((v, left))
            },
            |e| {
                e.cancel(id, now);
                true
            },
        );
        let ((v, left), bytes) = match result {
            Ok(r) => r,
            Err(f) => {
                self.count_fault(f);
                return (Admit::FailOpen(f), None);
            }
        };
        let hedged = is(v, VerdictKind::Hedge);
        let mut call = Call { id, key: key.to_string(), flags, started: now, admitted_on: bytes, max_retries: 0, hedged, done: false };
        match v.kind() {
            // A hedged call's first attempt is the request; the router sends the hedges.
            Some(VerdictKind::Attempt | VerdictKind::Hedge) => {
                self.stats.admitted += 1;
                call.max_retries = left;
                let mut headers = Vec::with_capacity(self.static_headers.len() + 1);
                headers.push(("x-envoy-max-retries", call.max_retries.to_string()));
                headers.extend(self.static_headers.iter().cloned());
                (Admit::Forward(headers), Some(call))
            }
            Some(VerdictKind::Wait) => {
                self.stats.rejected += 1;
                (Admit::Reply(self.rejection(Reason::RateLimited, v.payload())), None)
            }
            Some(VerdictKind::Fail) => {
                self.stats.rejected += 1;
                (Admit::Reply(self.rejection(v.reason(), v.payload())), None)
            }
            Some(VerdictKind::Fallback) => {
                let a = self.fallback(&mut call, v, now);
                (a, Some(call))
            }
            _ => {
                self.cfg.engine.cancel(id, now);
                self.stats.state_fail_open += 1;
                (Admit::FailOpen(Fault::State), None)
            }
        }
    }

    /// The local answer to a rejection: 429 for a rate limit, else 503 marked overloaded;
    /// Retry-After from the core's hint. Both carry [`NO_RETRY`], so that an Envoy in front
    /// (whatever its route retries) never retries them.
    pub fn rejection(&self, reason: Reason, hint_ns: u64) -> Reply {
        let status = if reason == Reason::RateLimited { 429 } else { 503 };
        let mut headers = vec![("x-levee-reason", reason.name().to_string()), (NO_RETRY.0, NO_RETRY.1.to_string())];
        if status == 503 {
            headers.push(("x-envoy-overloaded", "true".to_string()));
        }
        if hint_ns > 0 {
            headers.push(("retry-after", secs_ceil(hint_ns).to_string()));
        }
        Reply { status, headers, body: format!("levee: {}\n", reason.name()) }
    }

    fn fallback(&mut self, call: &mut Call, v: Verdict, now: u64) -> Admit {
        self.stats.fallbacks += 1;
        match self.cfg.fallbacks.get(v.payload() as usize).cloned() {
            Some(FallbackAction::Local { status, body, content_type }) => {
                let _ = self.cfg.engine.report_fallback(call.id, now, true);
                self.drain();
                call.done = true;
                Admit::Reply(Reply { status, headers: vec![("content-type", content_type), ("x-levee-fallback", "local".into())], body })
            }
            Some(FallbackAction::Cluster { cluster, authority, timeout }) => {
                Admit::Dispatch { cluster, authority, timeout_ms: ms_ceil(timeout) }
            }
            None => {
                self.cfg.engine.cancel(call.id, now);
                call.done = true;
                Admit::Reply(self.rejection(v.reason(), 0))
            }
        }
    }

    fn drain(&mut self) {
        if self.cfg.engine.has_events() {
            self.cfg.engine.drain_events();
        }
    }

    /// The fallback cluster answered (`status`, or `None` when the call failed): the response
    /// to send, or the next fallback to run.
    pub fn fallback_result(&mut self, call: &mut Call, wall_ns: u64, status: Option<u16>) -> Admit {
        let now = self.clock.now(wall_ns);
        let ok = status.is_some_and(|s| s < 500);
        let v = self.cfg.engine.report_fallback(call.id, now, ok);
        self.drain();
        match v.kind() {
            Some(VerdictKind::Done) => {
                call.done = true;
                Admit::Forward(Vec::new())
            }
            Some(VerdictKind::Fallback) => self.fallback(call, v, now),
            _ => {
                call.done = true;
                Admit::Reply(self.rejection(v.reason(), 0))
            }
        }
    }

    /// The router answered: feed every attempt to the breaker and the budget. The router
    /// retried only what `x-envoy-retry-on` allowed, so each attempt before the last failed
    /// retriably; its status is not reported downstream, so it counts as the final status when
    /// that is a retriable failure, else as the probe outcome. Returns a fallback to run, if
    /// the core chose one.
    ///
    /// Undoing this on a CAS mismatch: the call is ended and made again in the worker's engine
    /// by the same `start` on the bytes its admission ran on (the same state, the same `now`:
    /// the same call, in flight on its first attempt), then the fresh bytes are imported.
    pub fn complete(&mut self, store: &impl Store, wall_ns: u64, call: &mut Call, r: &Response<'_>, wall_secs: u64) -> Option<Admit> {
        if call.done {
            return None;
        }
        call.done = true;
        let now = self.clock.now(wall_ns);
        let elapsed = now.saturating_sub(call.started);
        let attempts = r.attempts.clamp(1, call.max_retries.saturating_add(1));
        let final_code = i32::from(r.status);
        let retriable_final = self.retry_on.status_codes.binary_search(&r.status).is_ok();
        let earlier = if retriable_final { Some((OutcomeKind::HttpStatus, final_code)) } else { self.probe };
        let flags = if r.overloaded { FLAG_OVERLOADED } else { 0 };
        let (id, per) = (call.id, elapsed / u64::from(attempts));
        let pi = self.cfg.policy;
        let (key, admitted_on, start_flags, started) = (call.key.as_str(), call.admitted_on.as_slice(), call.flags, call.started);
        let hedged = call.hedged;
        let result = self.with_key(
            store,
            key,
            |e, _| {
                if hedged {
                    // The router's attempts, in order: each before the last failed retriably
                    // when the last did (as for retries), and a non-fatal failure is what
                    // sends the next hedge; else the first attempt carries the result (the
                    // router cancelled the others when it came).
                    let reports = if retriable_final { attempts } else { 1 };
                    return Ok(replay_hedged(e, id, now, per, reports, final_code, r.retry_after, wall_secs, flags));
                }
                let mut live = true;
                for _ in 1..attempts {
                    let Some((kind, code)) = earlier else { break };
                    let v = e.report(id, now, per, kind, code, "", wall_secs, 0);
                    if !is(v, VerdictKind::Retry) || !is(e.acquire(id, now), VerdictKind::Attempt) {
                        live = false;
                        break;
                    }
                }
                if !live {
                    e.cancel(id, now);
                    return Ok(Verdict::new(VerdictKind::Done, 0, 0));
                }
                let v = e.report(id, now, per, OutcomeKind::HttpStatus, final_code, r.retry_after, wall_secs, flags);
                if is(v, VerdictKind::Retry) {
                    // The router is done with this request: no retry of the core's happens.
                    e.cancel(id, now);
                }
                Ok(v)
            },
            |e| remake(e, pi, id, key, start_flags, started, admitted_on),
        );
        match result {
            Ok((v, _)) => {
                if is(v, VerdictKind::Fallback) {
                    call.done = false;
                    let a = self.fallback(call, v, now);
                    // A fallback cluster call pending: the call stays live in the worker's
                    // engine until its answer, and a reset before it (`abandon`) ends it.
                    call.done = !matches!(a, Admit::Dispatch { .. });
                    return Some(a);
                }
                None
            }
            Err(f) => {
                self.cfg.engine.cancel(id, now);
                self.count_fault(f);
                None
            }
        }
    }

    /// The request ended without a response the filter saw (a reset): release what it holds.
    pub fn abandon(&mut self, store: &impl Store, wall_ns: u64, call: &mut Call) {
        if call.done {
            return;
        }
        call.done = true;
        let now = self.clock.now(wall_ns);
        let (pi, id) = (self.cfg.policy, call.id);
        let (key, admitted_on, flags, started) = (call.key.as_str(), call.admitted_on.as_slice(), call.flags, call.started);
        let result = self.with_key(
            store,
            key,
            |e, _| {
                e.cancel(id, now);
                Ok(())
            },
            |e| remake(e, pi, id, key, flags, started, admitted_on),
        );
        if let Err(f) = result {
            self.cfg.engine.cancel(id, now);
            self.count_fault(f);
        }
    }
}

/// How many retries the router may make now: the attempts the core would grant if every one
/// failed retriably (the budget, the breaker and the deadline all answer), at most `max`.
/// Asked of the call itself, which this ends: the caller makes it again.
fn retries_left(e: &mut Engine, id: u64, now: u64, kind: OutcomeKind, code: i32, max: u32) -> u32 {
    let mut t = now;
    let mut n = 0u32;
    while n < max {
        let v = e.report(id, t, 0, kind, code, "", 0, 0);
        if !is(v, VerdictKind::Retry) {
            break;
        }
        t = t.saturating_add(v.payload());
        if !is(e.acquire(id, t), VerdictKind::Attempt) {
            break;
        }
        n += 1;
    }
    n
}

/// How many hedges the router may send now: the hedges the core would start, stepping its
/// hedge delays from `now` (the deadline, the breaker, the budget and the limits all answer),
/// at most `max`. Asked of the call itself, which this ends: the caller makes it again.
fn hedges_left(e: &mut Engine, id: u64, now: u64, max: u32) -> u32 {
    let mut t = now;
    let mut n = 0u32;
    for _ in 0..=max {
        let mut wait = None;
        for c in e.hedge_step(id, t) {
            match c {
                HedgeCommand::Start { .. } => n += 1,
                HedgeCommand::Wait { delay } => wait = Some(delay),
                HedgeCommand::End { .. } => return n.min(max),
                HedgeCommand::Cancel { .. } => {}
            }
        }
        match wait {
            Some(d) if n < max && d > 0 => t = t.saturating_add(d),
            _ => break,
        }
    }
    n.min(max)
}

/// Feed a hedged request's attempts to the core: `reports` attempts, each with the final
/// status (an attempt the core does not start, because its hedging stopped, is not
/// reported). The call's verdict (`done` when the router answered and the core would still
/// go on: the router is done with this request).
#[allow(clippy::too_many_arguments)]
fn replay_hedged(
    e: &mut Engine,
    id: u64,
    now: u64,
    per: u64,
    reports: u32,
    code: i32,
    retry_after: &str,
    wall_secs: u64,
    flags: u32,
) -> Verdict {
    let mut attempt = 1;
    for left in (0..reports).rev() {
        let mut next = None;
        for c in e.report_attempt(id, attempt, now, per, OutcomeKind::HttpStatus, code, retry_after, wall_secs, flags) {
            match c {
                HedgeCommand::End { verdict, .. } => return verdict,
                HedgeCommand::Start { attempt: a, .. } => next = Some(a),
                HedgeCommand::Cancel { .. } | HedgeCommand::Wait { .. } => {}
            }
        }
        match next {
            Some(a) if left > 0 => attempt = a,
            _ => break,
        }
    }
    e.cancel(id, now);
    Verdict::new(VerdictKind::Done, 0, 0)
}

/// Put a call back as its admission made it (in flight on its first attempt): end it, and
/// `start` it again on the bytes the admission ran on, at the admission's `now`.
fn remake(e: &mut Engine, pi: u32, id: u64, key: &str, flags: u32, started: u64, admitted_on: &[u8]) -> bool {
    e.cancel(id, started);
    if e.import_key(pi, key, admitted_on).is_err() {
        return false;
    }
    let v = e.start(id, pi, key, flags, started, 0, 0, 0);
    if e.has_events() {
        e.drain_events();
    }
    is(v, VerdictKind::Attempt) || is(v, VerdictKind::Hedge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Envoy's shared data, one store for every worker (and thread) of a test.
    #[derive(Default, Clone)]
    struct Shared(Arc<MemoryStore>);

    impl Store for Shared {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
            self.0.set(key, value, cas)
        }
    }

    fn gate(doc: &str, worker: u64) -> Gate {
        Gate::new(crate::config::parse(doc).expect("config"), worker)
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn workers_on_threads_admit_exactly_the_rate() {
        let doc = "policies: { p: { rate-limit: { rate: 50, per: 1s, burst: 50 } } }";
        let store = Shared::default();
        let admitted = Arc::new(Mutex::new(0u32));
        let threads: Vec<_> = (0..4u64)
            .map(|w| {
                let (store, admitted) = (store.clone(), admitted.clone());
                std::thread::spawn(move || {
                    let mut g = gate(doc, w + 1);
                    for _ in 0..100 {
                        let (a, call) = g.admit(&store, S, "k", "GET", None);
                        assert!(!matches!(a, Admit::FailOpen(_)), "{a:?}");
                        if let (Admit::Forward(_), Some(mut c)) = (a, call) {
                            *admitted.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                            g.complete(&store, S, &mut c, &Response { status: 200, attempts: 1, ..Default::default() }, 1);
                        }
                    }
                    g.stats.cas_mismatches
                })
            })
            .collect();
        for t in threads {
            let _ = t.join();
        }
        assert_eq!(*admitted.lock().unwrap_or_else(|e| e.into_inner()), 50);
    }

    #[test]
    fn the_breaker_opens_rejects_with_retry_after_and_closes_through_half_open() {
        let doc = "policies: { p: { attempts: 3, breaker: { window: { kind: count, size: 4 }, minimum-calls: 4, failure-rate: 50, open-duration: 2s, half-open-permits: 1 } } }";
        let store = Shared::default();
        let (mut a, mut b) = (gate(doc, 1), gate(doc, 2));
        for i in 0..2 {
            let g = if i == 0 { &mut a } else { &mut b };
            let (adm, call) = g.admit(&store, S, "c", "GET", None);
            let Admit::Forward(h) = adm else { panic!("{adm:?}") };
            // The second request's retries would find the breaker open after its first failure.
            let want = if i == 0 { "2" } else { "0" };
            assert!(h.contains(&("x-envoy-max-retries", want.into())), "{h:?}");
            let mut c = call.expect("call");
            // The router made three attempts, all 503 (then one): 4 failures of 4 open the breaker.
            let attempts = if i == 0 { 3 } else { 1 };
            g.complete(&store, S, &mut c, &Response { status: 503, attempts, ..Default::default() }, 1);
        }
        let (adm, _) = a.admit(&store, S, "c", "GET", None);
        let Admit::Reply(r) = adm else { panic!("{adm:?}") };
        assert_eq!(r.status, 503);
        assert!(r.headers.contains(&("x-envoy-overloaded", "true".into())));
        // An Envoy in front never retries it, whatever its route's retry policy.
        assert!(r.headers.contains(&("x-envoy-ratelimited", "true".into())));
        assert!(r.headers.contains(&("retry-after", "2".into())), "{:?}", r.headers);
        // After the open duration one trial goes through (on either worker) and closes it.
        let (adm, call) = b.admit(&store, 3 * S + 1, "c", "GET", None);
        assert!(matches!(adm, Admit::Forward(_)), "{adm:?}");
        let (adm2, _) = a.admit(&store, 3 * S + 2, "c", "GET", None);
        assert!(matches!(adm2, Admit::Reply(_)), "one half-open permit across workers: {adm2:?}");
        let mut c = call.expect("call");
        b.complete(&store, 3 * S + 3, &mut c, &Response { status: 200, attempts: 1, ..Default::default() }, 3);
        let (adm, _) = a.admit(&store, 3 * S + 4, "c", "GET", None);
        assert!(matches!(adm, Admit::Forward(_)), "closed again: {adm:?}");
    }

    #[test]
    fn a_hedged_policy_lets_the_router_hedge_and_feeds_the_result_back() {
        let store = Shared::default();
        let doc = "policies: { p: { hedge: { attempts: 3, delay: 100ms }, breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 10s } } }";
        let mut g = gate(doc, 1);
        for i in 0..2 {
            let (adm, call) = g.admit(&store, S + i, "k", "GET", None);
            let Admit::Forward(h) = adm else { panic!("a hedged request is admitted, not failed open: {adm:?}") };
            assert!(h.contains(&("x-envoy-max-retries", "2".into())), "{h:?}");
            assert!(h.contains(&("x-envoy-hedge-on-per-try-timeout", "true".into())), "{h:?}");
            let mut c = call.expect("call");
            assert_eq!(g.complete(&store, S + i + 1, &mut c, &Response { status: 500, attempts: 3, ..Default::default() }, 1), None);
        }
        assert_eq!(g.stats.state_fail_open, 0);
        // The two failed requests opened the breaker: the next is answered locally.
        let (adm, _) = g.admit(&store, 2 * S, "k", "GET", None);
        assert!(matches!(&adm, Admit::Reply(r) if r.status == 503), "{adm:?}");
        assert_eq!(g.config().engine.live_calls(), 0);
    }

    #[test]
    fn app_retried_requests_get_no_router_retries_and_budget_limits_them() {
        let store = Shared::default();
        let mut g = gate("policies: { p: { attempts: 4 } }", 1);
        let (adm, _) = g.admit(&store, S, "k", "GET", Some(1));
        assert!(matches!(&adm, Admit::Forward(h) if h.contains(&("x-envoy-max-retries", "0".into()))), "{adm:?}");
        let (adm, _) = g.admit(&store, S, "k", "POST", None);
        assert!(matches!(&adm, Admit::Forward(h) if h.contains(&("x-envoy-max-retries", "0".into()))), "POST is not idempotent: {adm:?}");
        let mut g = gate("policies: { p: { attempts: 4, budget: { kind: token, max-tokens: 4, token-ratio: 0.1 } } }", 1);
        let (adm, _) = g.admit(&store, S, "k", "GET", None);
        // Tokens 4: a failure takes one (3 > 2 allows), then 2 (not above half): one retry.
        assert!(matches!(&adm, Admit::Forward(h) if h.contains(&("x-envoy-max-retries", "1".into()))), "{adm:?}");
    }

    #[test]
    fn keys_are_bounded_and_contention_fails_open() {
        let store = Shared::default();
        let mut g = gate("policies: { p: { keys: { max: 2 } } }", 1);
        for k in ["a", "b", "a"] {
            assert!(matches!(g.admit(&store, S, k, "GET", None).0, Admit::Forward(_)));
        }
        assert_eq!(g.admit(&store, S, "c", "GET", None).0, Admit::FailOpen(Fault::Keys));
        assert_eq!(g.admit(&store, S, &"x".repeat(300), "GET", None).0, Admit::FailOpen(Fault::Keys));
        assert_eq!(g.stats.keys_fail_open, 2);

        /// A store whose every write loses the race.
        struct Busy(Shared);
        impl Store for Busy {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
                self.0.get(key)
            }
            fn set(&self, _: &str, _: &[u8], _: u32) -> Result<(), bool> {
                Err(true)
            }
        }
        let mut g = gate("policies: { p: { rate-limit: { rate: 5, per: 1s } } }", 1);
        let busy = Busy(store.clone());
        store.set("levee:p:k", &g.config().engine.export_key(0, "k").unwrap_or_default(), 0).expect("set");
        assert_eq!(g.admit(&busy, S, "k", "GET", None).0, Admit::FailOpen(Fault::Contention));
        assert_eq!((g.stats.cas_fail_open, g.stats.cas_mismatches), (1, 9));
        // Garbage in shared data fails open too.
        store.set("levee:p:k", b"garbage", 0).expect("set");
        assert_eq!(g.admit(&store, S, "k", "GET", None).0, Admit::FailOpen(Fault::State));
    }

    /// Counts the shared-data host calls.
    struct Counting(Shared, std::cell::Cell<(u32, u32)>);
    impl Store for Counting {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
            let (g, s) = self.1.get();
            self.1.set((g + 1, s));
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
            let (g, s) = self.1.get();
            self.1.set((g, s + 1));
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn a_request_costs_two_shared_data_reads_and_two_writes() {
        let doc =
            "policies: { p: { attempts: 3, budget: { kind: token }, breaker: { window: { kind: count, size: 100 }, minimum-calls: 20 } } }";
        let store = Counting(Shared::default(), Default::default());
        let (mut a, mut b) = (gate(doc, 1), gate(doc, 2));
        // The first request registers the key: two more reads and two more writes.
        let (_, call) = a.admit(&store, S, "k", "GET", None);
        a.complete(&store, S, &mut call.expect("call"), &Response { status: 200, attempts: 1, ..Default::default() }, 1);
        assert_eq!(store.1.get(), (4, 4));
        for i in 0..10u64 {
            // Two workers taking turns: each imports what the other wrote.
            let g = if i % 2 == 0 { &mut a } else { &mut b };
            store.1.set((0, 0));
            let t = S + (i + 1) * 1000;
            let (adm, call) = g.admit(&store, t, "k", "GET", None);
            assert!(matches!(&adm, Admit::Forward(h) if h.contains(&("x-envoy-max-retries", "2".into()))), "{adm:?}");
            g.complete(&store, t + 500, &mut call.expect("call"), &Response { status: 200, attempts: 1, ..Default::default() }, 1);
            assert_eq!(store.1.get(), (2, 2), "request {i}");
        }
        assert_eq!(a.config().engine.live_calls() + b.config().engine.live_calls(), 0, "no call left behind");
    }

    #[test]
    fn a_mismatch_undoes_the_completion_and_runs_it_again_on_fresh_bytes() {
        // Worker a's completion loses one race to worker b: its report runs again on b's bytes,
        // so the breaker sees both failures and the bulkhead both releases.
        let doc = "policies: { p: { attempts: 1, bulkhead: { max-concurrent: 2 }, breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50 } } }";
        let store = Shared::default();
        let (mut a, mut b) = (gate(doc, 1), gate(doc, 2));
        let (_, ca) = a.admit(&store, S, "k", "GET", None);
        let (_, cb) = b.admit(&store, S, "k", "GET", None);
        let (mut ca, mut cb) = (ca.expect("a"), cb.expect("b"));
        /// Runs b's completion when a first writes, so that a's write finds a new version.
        struct Race<'a>(&'a Shared, std::cell::RefCell<Option<(&'a mut Gate, &'a mut Call)>>);
        impl Store for Race<'_> {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
                self.0.get(key)
            }
            fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
                if let Some((g, c)) = self.1.borrow_mut().take() {
                    g.complete(self.0, S, c, &Response { status: 503, attempts: 1, ..Default::default() }, 1);
                }
                self.0.set(key, value, cas)
            }
        }
        let race = Race(&store, std::cell::RefCell::new(Some((&mut b, &mut cb))));
        a.complete(&race, S, &mut ca, &Response { status: 503, attempts: 1, ..Default::default() }, 1);
        assert_eq!(a.stats.cas_mismatches, 1);
        assert_eq!(a.config().engine.live_calls(), 0);
        // Both failures counted (2 of 2: open), both slots released.
        let (adm, _) = a.admit(&store, S, "k", "GET", None);
        let Admit::Reply(r) = adm else { panic!("{adm:?}") };
        assert!(r.headers.contains(&("x-levee-reason", "breaker-open".into())), "{:?}", r.headers);
        let mut fresh = gate(doc, 3);
        let bytes = store.get("levee:p:k").0.expect("state");
        fresh.cfg.engine.import_key(0, "k", &bytes).expect("import");
        assert_eq!(fresh.config().engine.in_flight(0, "k"), 0);
    }

    #[test]
    fn no_call_outlives_its_request() {
        // Every way a request ends leaves the worker's engine with no live call: forwarded and
        // answered, rejected, a local fallback, a cluster fallback answered or reset.
        let doc = r#"
document: { policies: { p: { attempts: 1, breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 10s },
  fallbacks: [{ name: spare, on: [retries-exhausted, non-retryable, breaker-open] }] } } }
fallbacks: { spare: { cluster: spare } }"#;
        let store = Shared::default();
        let mut g = gate(doc, 1);
        let live = |g: &Gate| g.config().engine.live_calls();
        // Two failures: each answer is a fallback cluster call.
        for reset in [false, true] {
            let (adm, call) = g.admit(&store, S, "k", "GET", None);
            assert!(matches!(adm, Admit::Forward(_)), "{adm:?}");
            let mut c = call.expect("call");
            let a = g.complete(&store, S, &mut c, &Response { status: 503, attempts: 1, ..Default::default() }, 1);
            assert!(matches!(a, Some(Admit::Dispatch { .. })), "{a:?}");
            assert_eq!(live(&g), 1);
            if reset {
                g.abandon(&store, S, &mut c);
            } else {
                assert_eq!(g.fallback_result(&mut c, S, Some(200)), Admit::Forward(Vec::new()));
            }
            assert_eq!(live(&g), 0, "reset {reset}");
        }
        // The breaker is open: admission chooses the fallback; its call fails, then a reset.
        let (adm, call) = g.admit(&store, S, "k", "GET", None);
        assert!(matches!(adm, Admit::Dispatch { .. }), "{adm:?}");
        let mut c = call.expect("call");
        assert!(matches!(g.fallback_result(&mut c, S, None), Admit::Reply(_)));
        g.abandon(&store, S, &mut c);
        assert_eq!(live(&g), 0);
    }

    #[test]
    fn the_clock_never_goes_back() {
        let mut c = Clock::default();
        assert_eq!((c.now(10), c.now(5), c.now(12)), (10, 10, 12));
        assert_eq!(c.backwards, 1);
    }

    #[test]
    fn rate_limit_rejections_are_429_with_retry_after() {
        let store = Shared::default();
        let mut g = gate("policies: { p: { rate-limit: { rate: 1, per: 10s } } }", 1);
        assert!(matches!(g.admit(&store, S, "", "GET", None).0, Admit::Forward(_)));
        let Admit::Reply(r) = g.admit(&store, S, "", "GET", None).0 else { panic!("rejected") };
        assert_eq!(r.status, 429);
        assert!(r.headers.contains(&("retry-after", "10".into())), "{:?}", r.headers);
    }
}
