//! `levee simulate`: the engine against simulated dependencies, in virtual time.
//!
//! A discrete-event loop: requests arrive (Poisson, seeded), each layer is one service with
//! its own engine running the policy, an attempt of layer `i` is a call of layer `i + 1`, and
//! the last layer calls the simulated dependency. The engine is called directly at every
//! step with the virtual `now`; nothing sleeps, so a minute of traffic runs in milliseconds.

pub mod rng;
pub mod svg;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use serde_json::{json, Value};

use crate::engine::core::{BreakerState, EventKind, OutcomeKind, VerdictKind};
use crate::engine::{self, human, Engine};
use crate::term::Progress;
use rng::SimRng;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;
/// Width of a time bucket of the report and chart.
pub const BUCKET: u64 = S;
/// Breaker state is sampled this often (the most severe sample of a bucket is kept).
const SAMPLE: u64 = 100 * MS;

/// Built-in scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Healthy dependency, 10-30 ms latency, 1% transient 503s; 60 s.
    Healthy,
    /// Full outage (connections refused) from 10 s to 40 s, then recovery; 70 s.
    Outage,
    /// From 10 s to 40 s every answer takes 3x the per-attempt timeout (5 s without one); 60 s.
    Slow,
    /// The dependency serves 60 requests/s and answers 429 with `Retry-After: 1` above that; 60 s.
    RateLimit,
    /// Three layers of services, each running the policy, over a dependency that fails
    /// (503) from 10 s to 40 s; run with retries only, with a budget, with a breaker and with both.
    ThreeLayerOutage,
    /// An application over a proxy (Envoy with the Levee filter) over a service that fails
    /// (503) from 10 s to 40 s; both layers run the policy; run without coordination (both
    /// retry) and with it (the application marks its attempts `x-levee-attempt`, so the proxy
    /// adds no retry, as the filter does: docs/envoy.md); 70 s.
    ProxyOutage,
    /// A dependency of fixed capacity (8 servers, 10-30 ms of work per request, FIFO queue:
    /// 400 requests/s) under offered load stepping up from a quarter of RATE to RATE (default
    /// 800/s: 0.5x to 2x the capacity); run with a fixed bulkhead and with each adaptive
    /// concurrency limit (or the policy's own); 60 s.
    Overload,
}

/// Servers of the overload scenario's dependency.
pub const SERVERS: usize = 8;
/// Steps of the overload scenario's offered load (each a quarter of the duration).
pub const STEPS: u64 = 4;
/// The overload scenario's peak offered load unless `--rate` says otherwise.
pub const OVERLOAD_RATE: f64 = 800.0;
/// The fixed bulkhead of the overload scenario when the policy has none (resilience4j's default).
pub const DEFAULT_MAX_CONCURRENT: u64 = 25;
/// The adaptive algorithms the overload scenario compares when the policy names none.
pub const ALGORITHMS: [&str; 4] = ["gradient2", "vegas", "envoy-gradient", "aimd"];

/// The overload scenario's dependency capacity, requests per second: servers over the mean work.
pub fn overload_capacity() -> f64 {
    SERVERS as f64 * S as f64 / (20 * MS) as f64
}

impl Scenario {
    /// The scenario's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Healthy => "healthy",
            Scenario::Outage => "outage",
            Scenario::Slow => "slow",
            Scenario::RateLimit => "rate-limit",
            Scenario::ThreeLayerOutage => "three-layer-outage",
            Scenario::ProxyOutage => "proxy-outage",
            Scenario::Overload => "overload",
        }
    }

    fn layers(self) -> usize {
        match self {
            Scenario::ThreeLayerOutage => 3,
            Scenario::ProxyOutage => 2,
            _ => 1,
        }
    }
    /// The interval in which the dependency is impaired, if any.
    fn window(self) -> Option<(u64, u64)> {
        match self {
            Scenario::Outage | Scenario::Slow | Scenario::ThreeLayerOutage | Scenario::ProxyOutage => Some((10 * S, 40 * S)),
            _ => None,
        }
    }
}

/// How long requests arrive in a scenario unless `--duration` says otherwise.
pub fn default_duration(s: Scenario) -> u64 {
    match s {
        Scenario::Outage | Scenario::ThreeLayerOutage | Scenario::ProxyOutage => 70 * S,
        _ => 60 * S,
    }
}

/// What the simulated dependency answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Out {
    Success,
    Timeout,
    Refused,
    Http(i32, u32),
}

#[derive(Clone, Debug)]
enum Dep {
    Healthy {
        error_rate: f64,
    },
    Refusing {
        from: u64,
        to: u64,
    },
    Failing {
        from: u64,
        to: u64,
    },
    Slow {
        from: u64,
        to: u64,
        latency: u64,
    },
    RateLimited {
        rate: f64,
        tokens: f64,
        last: u64,
    },
    /// `free[i]`: when server `i` is next free. A request waits for the first free server
    /// (FIFO), then takes its 10-30 ms of work; work of a caller that gave up is still done.
    Queue {
        free: Vec<u64>,
    },
}

struct Dependency {
    kind: Dep,
    rng: SimRng,
}

impl Dependency {
    /// The dependency's answer to a request sent at `t`: its latency and outcome.
    fn respond(&mut self, t: u64) -> (u64, Out) {
        let normal = self.rng.between(10 * MS, 30 * MS);
        match &mut self.kind {
            Dep::Healthy { error_rate } => {
                let fail = self.rng.unit() < *error_rate;
                (normal, if fail { Out::Http(503, 0) } else { Out::Success })
            }
            Dep::Refusing { from, to } if (*from..*to).contains(&t) => (self.rng.between(MS, 2 * MS), Out::Refused),
            Dep::Failing { from, to } if (*from..*to).contains(&t) => (self.rng.between(2 * MS, 5 * MS), Out::Http(503, 0)),
            Dep::Slow { from, to, latency } if (*from..*to).contains(&t) => (*latency + self.rng.between(0, 10 * MS), Out::Success),
            Dep::RateLimited { rate, tokens, last } => {
                let dt = t.saturating_sub(*last) as f64 / S as f64;
                *last = t.max(*last);
                *tokens = (*tokens + dt * *rate).min(*rate);
                if *tokens >= 1.0 {
                    *tokens -= 1.0;
                    (normal, Out::Success)
                } else {
                    (self.rng.between(MS, 3 * MS), Out::Http(429, 1))
                }
            }
            Dep::Queue { free } => {
                let first = free.iter().copied().enumerate().min_by_key(|&(i, f)| (f, i));
                let Some((i, at)) = first else { return (normal, Out::Success) };
                let end = t.max(at) + normal;
                if let Some(slot) = free.get_mut(i) {
                    *slot = end;
                }
                (end - t, Out::Success)
            }
            _ => (normal, Out::Success),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Sample,
    Arrive,
    Acquire(u64),
    End { call: u64, seq: u64, out: Out },
}

struct SimCall {
    layer: usize,
    parent: Option<(u64, u64)>,
    root: usize,
    seq: u64,
    attempt_start: u64,
    in_attempt: bool,
    fallback: bool,
}

#[derive(Clone, Debug, Default)]
struct Root {
    arrived: u64,
    finished: Option<u64>,
    ok: bool,
    fallback: bool,
    dep_calls: u64,
}

/// Per-layer counters.
#[derive(Clone, Debug, Default)]
pub struct LayerStats {
    /// Calls started at this layer.
    pub calls: u64,
    /// Attempts made by this layer.
    pub attempts: u64,
    /// Retries scheduled.
    pub retries: u64,
    /// Retries refused by the budget.
    pub budget_refusals: u64,
    /// Attempts rejected before running (breaker, limits).
    pub rejections: u64,
    /// Breaker transitions, in order: (time, from, to).
    pub transitions: Vec<(u64, BreakerState, BreakerState)>,
    /// Fallbacks used.
    pub fallbacks: u64,
    /// Breaker state per bucket (most severe sample), `None` when the policy has no breaker.
    pub breaker: Vec<Option<BreakerState>>,
}

/// The result of one run.
#[derive(Clone, Debug, Default)]
pub struct Run {
    /// Label of the variant.
    pub label: String,
    /// Requests that arrived at the first layer.
    pub requests: u64,
    /// Requests answered by the dependency (through every layer).
    pub succeeded: u64,
    /// Requests answered by a fallback.
    pub via_fallback: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Requests still unfinished when the run was cut.
    pub unfinished: u64,
    /// Calls the dependency received.
    pub dependency_calls: u64,
    /// Dependency calls per request over the whole run.
    pub amplification: f64,
    /// Dependency calls per request for requests that arrived and finished inside the
    /// impaired window (`None` without a window or without such requests).
    pub window_amplification: Option<f64>,
    /// Peak dependency calls in one bucket.
    pub peak_load: u64,
    /// Latency percentiles of the first layer's calls (p50, p90, p99, max), ns.
    pub latency: [u64; 4],
    /// Arrivals per bucket.
    pub offered: Vec<u64>,
    /// Dependency calls per bucket.
    pub load: Vec<u64>,
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// Protocol errors (invalid verdicts): must be 0.
    pub invalid: u64,
    /// The first layer's concurrency limit per bucket (its last sample), overload scenario only.
    pub limit: Vec<Option<u32>>,
    /// Requests that succeeded per bucket (by when they finished).
    pub goodput: Vec<u64>,
    /// Attempts rejected by the first layer per bucket.
    pub rejected: Vec<u64>,
    /// p50 and p99 latency of the requests that succeeded, per bucket (by when they finished).
    pub bucket_latency: Vec<[u64; 2]>,
    /// Requests that arrived in the last step of the offered load (the overload scenario's
    /// peak): p50 and p99 latency of those that succeeded, successes and failures per second.
    pub peak: Option<Peak>,
}

/// The overload scenario's figures for the requests that arrived in its last (peak) step.
#[derive(Clone, Debug, Default)]
pub struct Peak {
    /// Offered load, requests per second.
    pub offered: f64,
    /// p50 and p99 latency of the requests that succeeded.
    pub latency: [u64; 2],
    /// Succeeded requests per second.
    pub goodput: f64,
    /// Failed (rejected, timed out) requests per second.
    pub failed: f64,
    /// The limit at the end of the run.
    pub final_limit: Option<u32>,
}

struct World<'p> {
    engines: Vec<Engine>,
    policy: Vec<u32>,
    dep: Dependency,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    calls: BTreeMap<u64, SimCall>,
    next_id: u64,
    roots: Vec<Root>,
    run: Run,
    arrivals: SimRng,
    rate: f64,
    duration: u64,
    /// The first layer marks its attempts and the second (the proxy) adds no retry.
    coordinated: bool,
    /// Arrivals step up from `rate / STEPS` to `rate` (the overload scenario).
    stepped: bool,
    /// A native engine the first layer's exported state is imported into to read its adaptive
    /// limit (`levee_core::Engine::concurrency_limit`; the component exports no such call).
    mirror: Option<crate::engine::core::Engine>,
    /// The first layer's fixed bulkhead (sampled as its limit when there is no mirror).
    fixed_limit: Option<u32>,
    progress: &'p mut Progress,
}

fn bucket_add(v: &mut Vec<u64>, t: u64) {
    let i = (t / BUCKET) as usize;
    if v.len() <= i {
        v.resize(i + 1, 0);
    }
    if let Some(x) = v.get_mut(i) {
        *x += 1;
    }
}

/// Which state a bucket shows when the breaker was in several during it: half-open first (a
/// trial lasts milliseconds, and a second that opened again after it would otherwise hide it),
/// then open, then closed.
fn severity(s: Option<BreakerState>) -> u8 {
    match s {
        None => 0,
        Some(BreakerState::Closed) | Some(BreakerState::Disabled) | Some(BreakerState::ForcedClosed) => 1,
        Some(BreakerState::Open) | Some(BreakerState::ForcedOpen) => 2,
        Some(BreakerState::HalfOpen) => 3,
    }
}

/// The breaker was in state `s` at `t`: its bucket shows the most telling state seen in it.
fn mark_breaker(v: &mut Vec<Option<BreakerState>>, t: u64, s: Option<BreakerState>) {
    let i = (t / BUCKET) as usize;
    if v.len() <= i {
        v.resize(i + 1, None);
    }
    if let Some(slot) = v.get_mut(i) {
        if severity(s) > severity(*slot) {
            *slot = s;
        }
    }
}

impl World<'_> {
    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerStats> {
        self.run.layers.get_mut(layer)
    }

    fn drain(&mut self, layer: usize) {
        let Some(eng) = self.engines.get_mut(layer) else { return };
        let events = eng.drain_events();
        if layer == 0 {
            for e in events.iter().filter(|e| matches!(e.kind, EventKind::Rejected)) {
                bucket_add(&mut self.run.rejected, e.at);
            }
        }
        let Some(st) = self.run.layers.get_mut(layer) else { return };
        for e in events {
            match e.kind {
                EventKind::BudgetRefused => st.budget_refusals += 1,
                EventKind::Rejected => st.rejections += 1,
                EventKind::BreakerTransition => {
                    // Between two samples (every 100 ms) a half-open trial may come and go.
                    mark_breaker(&mut st.breaker, e.at, Some(e.state_to));
                    st.transitions.push((e.at, e.state_from, e.state_to));
                }
                _ => {}
            }
        }
    }

    fn start_call(&mut self, layer: usize, parent: Option<(u64, u64)>, root: usize, now: u64) {
        self.next_id += 1;
        let id = self.next_id;
        self.calls.insert(id, SimCall { layer, parent, root, seq: 0, attempt_start: now, in_attempt: false, fallback: false });
        if let Some(st) = self.layer_mut(layer) {
            st.calls += 1;
        }
        let (Some(eng), Some(p)) = (self.engines.get_mut(layer), self.policy.get(layer)) else { return };
        let v = eng.start(id, *p, "", 0, now, 0, 0, 0);
        self.verdict(id, v, now);
    }

    fn verdict(&mut self, id: u64, v: crate::engine::core::Verdict, now: u64) {
        let Some(layer) = self.calls.get(&id).map(|c| c.layer) else { return };
        if v.events_pending() {
            self.drain(layer);
        }
        match v.kind() {
            Some(VerdictKind::Attempt) => {
                let Some(c) = self.calls.get_mut(&id) else { return };
                c.seq += 1;
                c.in_attempt = true;
                c.attempt_start = now;
                let (seq, root) = (c.seq, c.root);
                if let Some(st) = self.layer_mut(layer) {
                    st.attempts += 1;
                }
                let timeout = v.payload();
                if layer + 1 == self.engines.len() {
                    let (latency, out) = self.dep.respond(now);
                    self.run.dependency_calls += 1;
                    bucket_add(&mut self.run.load, now);
                    if let Some(r) = self.roots.get_mut(root) {
                        r.dep_calls += 1;
                    }
                    let (at, out) = if timeout > 0 && latency >= timeout { (now + timeout, Out::Timeout) } else { (now + latency, out) };
                    self.push(at, Ev::End { call: id, seq, out });
                } else {
                    if timeout > 0 {
                        self.push(now + timeout, Ev::End { call: id, seq, out: Out::Timeout });
                    }
                    self.start_call(layer + 1, Some((id, seq)), root, now);
                }
            }
            Some(VerdictKind::Wait) => self.push(now + v.payload(), Ev::Acquire(id)),
            Some(VerdictKind::Retry) if self.coordinated && layer == 1 => {
                // The proxy's filter told the router x-envoy-max-retries: 0 for a marked
                // request: the failure goes back to the application, which decides.
                if let Some(eng) = self.engines.get_mut(layer) {
                    eng.cancel(id, now);
                }
                self.finish(id, false, now);
            }
            Some(VerdictKind::Retry) => {
                if let Some(st) = self.layer_mut(layer) {
                    st.retries += 1;
                }
                self.push(now + v.payload(), Ev::Acquire(id));
            }
            Some(VerdictKind::Done) => self.finish(id, true, now),
            Some(VerdictKind::Fail) => self.finish(id, false, now),
            Some(VerdictKind::Fallback) => {
                // The simulated fallback (a cached or default answer) always works.
                if let Some(c) = self.calls.get_mut(&id) {
                    c.fallback = true;
                }
                if let Some(st) = self.layer_mut(layer) {
                    st.fallbacks += 1;
                }
                let Some(eng) = self.engines.get_mut(layer) else { return };
                let v = eng.report_fallback(id, now, true);
                self.verdict(id, v, now);
            }
            _ => {
                self.run.invalid += 1;
                self.calls.remove(&id);
            }
        }
    }

    fn finish(&mut self, id: u64, ok: bool, now: u64) {
        let Some(c) = self.calls.remove(&id) else { return };
        match c.parent {
            Some((parent, seq)) => self.push(now, Ev::End { call: parent, seq, out: if ok { Out::Success } else { Out::Http(503, 0) } }),
            None => {
                if let Some(r) = self.roots.get_mut(c.root) {
                    r.finished = Some(now);
                    r.ok = ok;
                    r.fallback = c.fallback;
                }
            }
        }
    }

    fn end(&mut self, id: u64, seq: u64, out: Out, now: u64) {
        let Some(c) = self.calls.get_mut(&id) else { return };
        if !c.in_attempt || c.seq != seq {
            return; // a late answer: the attempt already timed out
        }
        c.in_attempt = false;
        let (layer, elapsed) = (c.layer, now.saturating_sub(c.attempt_start));
        let retry_after;
        let (kind, code, text) = match out {
            Out::Success => (OutcomeKind::Success, 0, ""),
            Out::Timeout => (OutcomeKind::Timeout, 0, ""),
            Out::Refused => (OutcomeKind::ConnectionError, 0, ""),
            Out::Http(code, 0) => (OutcomeKind::HttpStatus, code, ""),
            Out::Http(code, secs) => {
                retry_after = secs.to_string();
                (OutcomeKind::HttpStatus, code, retry_after.as_str())
            }
        };
        let Some(eng) = self.engines.get_mut(layer) else { return };
        let v = eng.report(id, now, elapsed, kind, code, text, 0, 0);
        self.verdict(id, v, now);
    }

    /// The arrival rate at `now`.
    fn rate_at(&self, now: u64) -> f64 {
        if !self.stepped || self.duration == 0 {
            return self.rate;
        }
        let step = (now.saturating_mul(STEPS) / self.duration).min(STEPS - 1) + 1;
        self.rate * step as f64 / STEPS as f64
    }

    fn sample(&mut self, now: u64) {
        let i = (now / BUCKET) as usize;
        if self.stepped {
            let limit = match (&mut self.mirror, self.engines.first_mut(), self.policy.first()) {
                (Some(m), Some(eng), Some(p)) => {
                    let bytes = eng.export_state();
                    m.import_state(&bytes).ok().and_then(|()| m.concurrency_limit(*p, ""))
                }
                _ => self.fixed_limit,
            };
            if self.run.limit.len() <= i {
                self.run.limit.resize(i + 1, None);
            }
            if let Some(slot) = self.run.limit.get_mut(i) {
                *slot = limit;
            }
        }
        for layer in 0..self.engines.len() {
            let (Some(eng), Some(p)) = (self.engines.get_mut(layer), self.policy.get(layer)) else { continue };
            let s = eng.breaker_state(*p, "", now);
            let Some(st) = self.run.layers.get_mut(layer) else { continue };
            mark_breaker(&mut st.breaker, now, s);
        }
    }

    fn go(&mut self) {
        self.push(0, Ev::Arrive);
        self.push(SAMPLE / 2, Ev::Sample);
        // Outstanding calls get five minutes of virtual time after the last arrival.
        let hard_end = self.duration + 300 * S;
        while let Some(Reverse((now, _, ev))) = self.queue.pop() {
            if now > hard_end {
                break;
            }
            self.progress.set(now.min(self.duration), self.duration);
            match ev {
                Ev::Sample => {
                    self.sample(now);
                    if now + SAMPLE < self.duration {
                        self.push(now + SAMPLE, Ev::Sample);
                    }
                }
                Ev::Arrive => {
                    if now >= self.duration {
                        continue;
                    }
                    let root = self.roots.len();
                    self.roots.push(Root { arrived: now, ..Root::default() });
                    bucket_add(&mut self.run.offered, now);
                    let gap = self.arrivals.exp(S as f64 / self.rate_at(now)).max(1.0) as u64;
                    self.push(now + gap, Ev::Arrive);
                    self.start_call(0, None, root, now);
                }
                Ev::Acquire(id) => {
                    let Some(layer) = self.calls.get(&id).map(|c| c.layer) else { continue };
                    let Some(eng) = self.engines.get_mut(layer) else { continue };
                    let v = eng.acquire(id, now);
                    self.verdict(id, v, now);
                }
                Ev::End { call, seq, out } => self.end(call, seq, out, now),
            }
        }
        for layer in 0..self.engines.len() {
            self.drain(layer);
        }
    }
}

/// Percentile `p` (0-100) of sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied().unwrap_or(0)
}

/// The index of a named policy (the first when `None`).
fn resolve(eng: &mut Engine, name: Option<&str>) -> Result<u32, String> {
    match name {
        Some(n) => crate::engine::policy_named(eng, n),
        None if eng.policy_count() > 0 => Ok(0),
        None => Err("the document has no policy".to_string()),
    }
}

/// Options of one run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub scenario: Scenario,
    pub seed: u64,
    /// Requests per second arriving at the first layer.
    pub rate: f64,
    /// Virtual time during which requests arrive.
    pub duration: u64,
    pub quiet: bool,
}

/// Run one document (its policy `policy`) through a scenario.
pub fn run_once(document: &str, policy: &str, label: &str, o: &RunOptions, coordinated: bool) -> Result<Run, String> {
    let layers = o.scenario.layers();
    let mut engines = Vec::new();
    let mut policy_ix = Vec::new();
    for layer in 0..layers {
        let mut eng = engine::load(document, o.seed.wrapping_add(layer as u64)).map_err(|errs| {
            let list: Vec<String> = errs.iter().map(|e| format!("  {e}")).collect();
            format!("the policy document is invalid (run `levee check`):\n{}", list.join("\n"))
        })?;
        let ix = resolve(&mut eng, Some(policy))?;
        policy_ix.push(ix);
        engines.push(eng);
    }
    let timeout =
        engines.first_mut().and_then(|e| e.policy_info(policy_ix.first().copied().unwrap_or(0))).map(|i| i.attempt_timeout).unwrap_or(0);
    let (from, to) = o.scenario.window().unwrap_or((0, 0));
    let kind = match o.scenario {
        Scenario::Healthy => Dep::Healthy { error_rate: 0.01 },
        Scenario::Outage => Dep::Refusing { from, to },
        Scenario::Slow => Dep::Slow { from, to, latency: if timeout > 0 { 3 * timeout } else { 5 * S } },
        Scenario::RateLimit => Dep::RateLimited { rate: 60.0, tokens: 60.0, last: 0 },
        Scenario::ThreeLayerOutage | Scenario::ProxyOutage => Dep::Failing { from, to },
        Scenario::Overload => Dep::Queue { free: vec![0; SERVERS] },
    };
    let stepped = o.scenario == Scenario::Overload;
    // The first layer's limit: a fixed bulkhead's `max-concurrent`, or an adaptive limit read
    // from the engine's exported state by a native engine of the same document.
    let (mut mirror, mut fixed_limit) = (None, None);
    if stepped {
        let first = policy_ix.first().copied().unwrap_or(0);
        let own: Value =
            engines.first_mut().and_then(|e| e.policy_json(first)).and_then(|j| serde_json::from_str(&j).ok()).unwrap_or_default();
        fixed_limit = own.get("bulkhead").and_then(|b| b.get("max-concurrent")).and_then(Value::as_u64).map(|n| n as u32);
        if own.get("concurrency").is_some_and(|c| !c.is_null()) {
            mirror = crate::engine::core::Engine::load(document, o.seed).ok();
        }
    }
    let mut progress = Progress::new(&format!("simulating {} ({label})", o.scenario.name()), o.quiet);
    let mut w = World {
        engines,
        policy: policy_ix,
        dep: Dependency { kind, rng: SimRng::new(o.seed ^ 0xD1CE) },
        queue: BinaryHeap::new(),
        seq: 0,
        calls: BTreeMap::new(),
        next_id: 0,
        roots: Vec::new(),
        run: Run { label: label.to_string(), layers: vec![LayerStats::default(); layers], ..Run::default() },
        arrivals: SimRng::new(o.seed ^ 0xA221),
        rate: o.rate.max(0.001),
        duration: o.duration,
        coordinated,
        stepped,
        mirror,
        fixed_limit,
        progress: &mut progress,
    };
    w.go();
    let mut run = std::mem::take(&mut w.run);
    let roots = std::mem::take(&mut w.roots);
    drop(w);
    progress.finish();
    run.requests = roots.len() as u64;
    let buckets = o.duration.div_ceil(BUCKET) as usize;
    let mut lat = Vec::new();
    let mut ok_lat: Vec<Vec<u64>> = vec![Vec::new(); if stepped { buckets } else { 0 }];
    let peak_from = o.duration - o.duration / STEPS;
    let (mut peak_lat, mut peak_failed) = (Vec::new(), 0u64);
    for r in &roots {
        match r.finished {
            None => run.unfinished += 1,
            Some(f) => {
                lat.push(f - r.arrived);
                if stepped && r.ok && !r.fallback {
                    bucket_add(&mut run.goodput, f);
                    if let Some(v) = ok_lat.get_mut((f / BUCKET) as usize) {
                        v.push(f - r.arrived);
                    }
                }
                if stepped && r.arrived >= peak_from {
                    if r.ok && !r.fallback {
                        peak_lat.push(f - r.arrived);
                    } else {
                        peak_failed += 1;
                    }
                }
                match (r.ok, r.fallback) {
                    (true, true) => run.via_fallback += 1,
                    (true, false) => run.succeeded += 1,
                    _ => run.failed += 1,
                }
            }
        }
    }
    lat.sort_unstable();
    run.latency = [percentile(&lat, 50.0), percentile(&lat, 90.0), percentile(&lat, 99.0), lat.last().copied().unwrap_or(0)];
    run.amplification = if run.requests > 0 { run.dependency_calls as f64 / run.requests as f64 } else { 0.0 };
    if to > from {
        let inside: Vec<&Root> = roots.iter().filter(|r| r.arrived >= from && r.finished.is_some_and(|f| f < to)).collect();
        if !inside.is_empty() {
            run.window_amplification = Some(inside.iter().map(|r| r.dep_calls).sum::<u64>() as f64 / inside.len() as f64);
        }
    }
    run.offered.resize(buckets, 0);
    if stepped {
        run.goodput.resize(buckets, 0);
        run.rejected.resize(buckets, 0);
        run.limit.resize(buckets, None);
        run.bucket_latency = ok_lat
            .iter_mut()
            .map(|v| {
                v.sort_unstable();
                [percentile(v, 50.0), percentile(v, 99.0)]
            })
            .collect();
        peak_lat.sort_unstable();
        let secs = (o.duration - peak_from) as f64 / S as f64;
        run.peak = Some(Peak {
            offered: o.rate,
            latency: [percentile(&peak_lat, 50.0), percentile(&peak_lat, 99.0)],
            goodput: peak_lat.len() as f64 / secs,
            failed: peak_failed as f64 / secs,
            final_limit: run.limit.iter().rev().find_map(|l| *l),
        });
    }
    run.load.resize(buckets.max(run.load.len()), 0);
    run.load.truncate(buckets);
    run.peak_load = run.load.iter().copied().max().unwrap_or(0);
    for st in &mut run.layers {
        st.breaker.resize(buckets, None);
    }
    Ok(run)
}

/// Remove the null fields of the engine's policy JSON (absent in a document).
fn strip(v: &mut Value) {
    if let Value::Object(m) = v {
        m.retain(|_, x| !x.is_null());
        m.values_mut().for_each(strip);
    }
}

/// A variant of a policy: the engine's own JSON of it with its budget and breaker replaced
/// and its fallbacks removed.
/// The result is a document the engine validates again.
pub fn variant_document(eng: &mut Engine, index: u32, budget: Option<Value>, breaker: Option<Value>) -> Result<String, String> {
    let info = eng.policy_info(index).ok_or("no such policy")?;
    let text = eng.policy_json(index).ok_or("no such policy")?;
    let mut v: Value = serde_json::from_str(&text).map_err(|e| format!("the engine's policy JSON does not parse: {e}"))?;
    let Value::Object(m) = &mut v else { return Err("the engine's policy JSON is not an object".into()) };
    m.remove("name");
    // Layers pass failures up: a fallback would hide them from the layer above.
    m.remove("fallbacks");
    m.insert("budget".into(), budget.unwrap_or(Value::Null));
    m.insert("breaker".into(), breaker.unwrap_or(Value::Null));
    strip(&mut v);
    let mut policies = serde_json::Map::new();
    policies.insert(info.name, v);
    Ok(json!({ "policies": policies }).to_string())
}

/// A variant of a policy with its concurrency limit replaced: a fixed `bulkhead` or an adaptive
/// `concurrency` (the other removed); everything else as the engine has it.
pub fn limit_document(eng: &mut Engine, index: u32, bulkhead: Option<Value>, adaptive: Option<Value>) -> Result<String, String> {
    let info = eng.policy_info(index).ok_or("no such policy")?;
    let text = eng.policy_json(index).ok_or("no such policy")?;
    let mut v: Value = serde_json::from_str(&text).map_err(|e| format!("the engine's policy JSON does not parse: {e}"))?;
    let Value::Object(m) = &mut v else { return Err("the engine's policy JSON is not an object".into()) };
    m.remove("name");
    m.remove("bulkhead");
    m.remove("concurrency");
    if let Some(b) = bulkhead {
        m.insert("bulkhead".into(), b);
    }
    if let Some(c) = adaptive {
        m.insert("concurrency".into(), c);
    }
    strip(&mut v);
    let mut policies = serde_json::Map::new();
    policies.insert(info.name, v);
    Ok(json!({ "policies": policies }).to_string())
}

/// Levee's budget used when a policy has none (gRPC A6 token throttling with its defaults).
pub fn default_budget() -> Value {
    json!({"kind": "token"})
}

/// Levee's breaker used when a policy has none: 20-call window, half failing trips it, 5 s open.
pub fn default_breaker() -> Value {
    json!({"window": {"kind": "count", "size": 20}, "minimum-calls": 10, "failure-rate": 50, "open-duration": "5s", "half-open-permits": 3})
}

/// Everything `simulate` printed and computed.
pub struct Outcome {
    pub runs: Vec<Run>,
    /// Analytic A^L and the budget bound, for the policy as given.
    pub analytic: Option<(f64, f64, u32)>,
}

/// Run a scenario: once for most, four variants for `three-layer-outage`, two for `proxy-outage`.
pub fn simulate(document: &str, policy: Option<&str>, o: &RunOptions) -> Result<Outcome, String> {
    let mut eng = engine::load(document, o.seed).map_err(|errs| {
        let list: Vec<String> = errs.iter().map(|e| format!("  {e}")).collect();
        format!("the policy document is invalid (run `levee check`):\n{}", list.join("\n"))
    })?;
    let index = resolve(&mut eng, policy)?;
    let name = eng.policy_info(index).ok_or("the document has no policy")?.name;
    // The simulator runs one attempt of a call at a time; a hedged call's concurrent attempts
    // are not modelled, so it says so rather than simulate something else.
    let hedged = eng.policy_json(index).and_then(|j| serde_json::from_str::<Value>(&j).ok()).is_some_and(|j| j.get("hedge").is_some());
    if hedged {
        return Err(format!(
            "policy `{name}` hedges: `levee simulate` does not model hedged attempts (run it on the policy without `hedge`)"
        ));
    }
    let layers = o.scenario.layers() as u32;
    let analytic = eng.analyze(index, layers).map(|a| (a.amplification, a.amplification_with_budget, a.worst_attempts));
    if o.scenario == Scenario::ProxyOutage {
        let runs = vec![
            run_once(document, &name, "app -> proxy -> service, both retry", o, false)?,
            run_once(document, &name, "coordinated: the app marks x-levee-attempt, the proxy adds no retry", o, true)?,
        ];
        return Ok(Outcome { runs, analytic });
    }
    if o.scenario == Scenario::Overload {
        let full: Value = eng.policy_json(index).and_then(|j| serde_json::from_str(&j).ok()).unwrap_or(Value::Null);
        let own_bulkhead = full.get("bulkhead").filter(|b| !b.is_null()).cloned();
        let own_adaptive = full.get("concurrency").filter(|c| !c.is_null()).cloned();
        let bulkhead = own_bulkhead.clone().unwrap_or_else(|| json!({ "max-concurrent": DEFAULT_MAX_CONCURRENT }));
        let n = bulkhead.get("max-concurrent").and_then(Value::as_u64).unwrap_or(DEFAULT_MAX_CONCURRENT);
        let whose = if own_bulkhead.is_some() { "policy's " } else { "" };
        let mut variants = vec![(format!("{whose}fixed bulkhead, max-concurrent {n}"), Some(bulkhead), None)];
        match own_adaptive {
            Some(c) => {
                let alg = c.get("algorithm").and_then(Value::as_str).unwrap_or("gradient2").to_string();
                variants.push((format!("policy's adaptive limit, {alg}"), None, Some(c)));
            }
            None => {
                for alg in ALGORITHMS {
                    variants.push((format!("adaptive {alg}"), None, Some(json!({ "kind": "adaptive", "algorithm": alg }))));
                }
            }
        }
        let mut runs = Vec::new();
        for (label, bulkhead, adaptive) in variants {
            let doc = limit_document(&mut eng, index, bulkhead, adaptive)?;
            runs.push(run_once(&doc, &name, &label, o, false)?);
        }
        return Ok(Outcome { runs, analytic });
    }
    if o.scenario != Scenario::ThreeLayerOutage {
        let run = run_once(document, &name, "policy as given", o, false)?;
        return Ok(Outcome { runs: vec![run], analytic });
    }
    let full: Value = eng.policy_json(index).and_then(|j| serde_json::from_str(&j).ok()).unwrap_or(Value::Null);
    let own_budget = full.get("budget").filter(|b| !b.is_null()).cloned();
    let own_breaker = full.get("breaker").filter(|b| !b.is_null()).cloned();
    let budget = own_budget.clone().unwrap_or_else(default_budget);
    let breaker = own_breaker.clone().unwrap_or_else(default_breaker);
    let b_label = if own_budget.is_some() { "policy's budget" } else { "token budget" };
    let k_label = if own_breaker.is_some() { "policy's breaker" } else { "breaker" };
    let variants = [
        ("retries only".to_string(), None, None),
        (format!("+ {b_label}"), Some(budget.clone()), None),
        (format!("+ {k_label}"), None, Some(breaker.clone())),
        (format!("+ {b_label} + {k_label}"), Some(budget), Some(breaker)),
    ];
    let mut runs = Vec::new();
    for (label, budget, breaker) in variants {
        let doc = variant_document(&mut eng, index, budget, breaker)?;
        runs.push(run_once(&doc, &name, &label, o, false)?);
    }
    Ok(Outcome { runs, analytic })
}

/// One character per bucket: `.` closed, `O` open, `h` half-open, `F` forced, ` ` no breaker.
pub fn breaker_strip(states: &[Option<BreakerState>]) -> String {
    states
        .iter()
        .map(|s| match s {
            None => ' ',
            Some(BreakerState::Closed) => '.',
            Some(BreakerState::Open) => 'O',
            Some(BreakerState::HalfOpen) => 'h',
            Some(BreakerState::ForcedOpen) => 'F',
            Some(BreakerState::ForcedClosed) | Some(BreakerState::Disabled) => '-',
        })
        .collect()
}

/// Text report.
pub fn report_text(o: &Outcome, opts: &RunOptions, style: crate::term::Style) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let (from, to) = opts.scenario.window().unwrap_or((0, 0));
    let _ = writeln!(
        s,
        "{}",
        style.bold(&format!(
            "scenario {}: {} requests/s for {}, {} layer{}, seed {}",
            opts.scenario.name(),
            opts.rate,
            human(opts.duration),
            opts.scenario.layers(),
            if opts.scenario.layers() == 1 { "" } else { "s" },
            opts.seed
        ))
    );
    if to > from {
        let _ = writeln!(s, "impaired dependency from {} to {}", human(from), human(to));
    }
    if opts.scenario == Scenario::ThreeLayerOutage {
        let _ = writeln!(s, "each layer runs the policy without its fallbacks (a layer passes failures up as 503)");
    }
    if opts.scenario == Scenario::Overload {
        let _ = writeln!(
            s,
            "dependency: {SERVERS} servers, 10-30 ms of work per request, a FIFO queue in front: capacity {:.0} requests/s",
            overload_capacity()
        );
        let steps: Vec<String> = (1..=STEPS).map(|k| format!("{:.0}", opts.rate * k as f64 / STEPS as f64)).collect();
        let _ = writeln!(s, "offered load steps every {}: {} requests/s", human(opts.duration / STEPS), steps.join(", "));
    }
    if opts.scenario == Scenario::ProxyOutage {
        let _ = writeln!(s, "layer 1 is the application, layer 2 the proxy (Envoy with the Levee filter); both run the policy");
    }
    if let Some((a, b, w)) = o.analytic {
        let _ = writeln!(
            s,
            "analytic (levee check): {w} attempts per layer -> {} without a budget, {} with the policy's budget",
            crate::check::fmt_x(a),
            crate::check::fmt_x(b)
        );
    }
    for r in &o.runs {
        let _ = writeln!(s);
        let _ = writeln!(s, "{}", style.bold(&format!("[{}]", r.label)));
        let pct = |n: u64| if r.requests > 0 { 100.0 * n as f64 / r.requests as f64 } else { 0.0 };
        let ok = format!("{:.2}%", pct(r.succeeded));
        let _ = writeln!(
            s,
            "  requests          {}: {} succeeded ({}), {} by fallback, {} failed{}",
            r.requests,
            r.succeeded,
            if pct(r.succeeded) >= 99.0 { style.green(&ok) } else { style.yellow(&ok) },
            r.via_fallback,
            r.failed,
            if r.unfinished > 0 { format!(", {} unfinished", r.unfinished) } else { String::new() }
        );
        let _ =
            writeln!(s, "  dependency calls  {} ({:.2} per request overall, peak {}/s)", r.dependency_calls, r.amplification, r.peak_load);
        if let Some(w) = r.window_amplification {
            let _ =
                writeln!(s, "  amplification     {} dependency calls per request during the impairment", style.bold(&format!("{w:.2}x")));
        }
        let [p50, p90, p99, max] = r.latency;
        let _ = writeln!(s, "  latency           p50 {}  p90 {}  p99 {}  max {}", human(p50), human(p90), human(p99), human(max));
        for (i, st) in r.layers.iter().enumerate() {
            let who = if r.layers.len() == 1 { "caller".to_string() } else { format!("layer {}", i + 1) };
            let _ = writeln!(
                s,
                "  {who:<17} {} calls, {} attempts, {} retries, {} refused by budget, {} rejected, {} fallbacks, {} breaker transitions",
                st.calls,
                st.attempts,
                st.retries,
                st.budget_refusals,
                st.rejections,
                st.fallbacks,
                st.transitions.len()
            );
            if st.breaker.iter().any(Option::is_some) {
                let _ = writeln!(s, "  {:<17} |{}|", "  breaker (1 s)", breaker_strip(&st.breaker));
            }
        }
        if opts.scenario == Scenario::Overload {
            overload_strips(&mut s, r, &o.runs);
        }
        if r.invalid > 0 {
            let _ = writeln!(s, "  {}", style.red(&format!("{} invalid verdicts (a simulator bug)", r.invalid)));
        }
    }
    if opts.scenario == Scenario::Overload {
        overload_table(&mut s, o, opts, style);
    }
    if o.runs.iter().any(|r| r.layers.iter().any(|l| l.breaker.iter().any(Option::is_some))) {
        let _ = writeln!(s, "\nbreaker strips: one character per second; . closed, O open, h half-open");
    }
    s
}

/// One character per bucket, ` ` (0) to `█` (`max`).
pub fn spark(values: &[f64], max: f64) -> String {
    const LEVELS: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    values
        .iter()
        .map(|v| {
            let k = if max > 0.0 { (v / max * 8.0).ceil().clamp(0.0, 8.0) as usize } else { 0 };
            LEVELS.get(k).copied().unwrap_or(' ')
        })
        .collect()
}

fn limit_values(r: &Run) -> Vec<f64> {
    r.limit.iter().map(|l| l.map(f64::from).unwrap_or(0.0)).collect()
}

fn p99_values(r: &Run) -> Vec<f64> {
    r.bucket_latency.iter().map(|l| l[1] as f64).collect()
}

fn per_bucket(v: &[u64]) -> Vec<f64> {
    v.iter().map(|x| *x as f64 * S as f64 / BUCKET as f64).collect()
}

fn max_of(runs: &[Run], f: impl Fn(&Run) -> Vec<f64>) -> f64 {
    runs.iter().flat_map(f).fold(0.0, f64::max)
}

/// The overload scenario's terminal chart of one run: limit, p99, goodput and rejections per
/// second, each scaled to the largest value of any run so the runs compare at a glance.
fn overload_strips(s: &mut String, r: &Run, runs: &[Run]) {
    use std::fmt::Write;
    let offered = per_bucket(&r.offered);
    let cap = overload_capacity();
    let rows: [(&str, Vec<f64>, f64, String); 5] = [
        (
            "offered (1 s)",
            offered.clone(),
            max_of(runs, |r| per_bucket(&r.offered)),
            format!("max {:.0}/s, capacity {cap:.0}/s", offered.iter().fold(0.0f64, |a, b| a.max(*b))),
        ),
        ("limit", limit_values(r), max_of(std::slice::from_ref(r), limit_values), {
            let first = r.limit.iter().find_map(|l| *l).map(|l| l.to_string()).unwrap_or_else(|| "-".into());
            let last = r.limit.iter().rev().find_map(|l| *l).map(|l| l.to_string()).unwrap_or_else(|| "-".into());
            format!("{first} -> {last} ({SERVERS} servers)")
        }),
        (
            "p99 latency",
            p99_values(r),
            max_of(runs, p99_values),
            format!("max {}", human(r.bucket_latency.iter().map(|l| l[1]).max().unwrap_or(0))),
        ),
        (
            "goodput",
            per_bucket(&r.goodput),
            max_of(runs, |r| per_bucket(&r.goodput)),
            format!("max {}/s", r.goodput.iter().max().unwrap_or(&0)),
        ),
        (
            "rejected",
            per_bucket(&r.rejected),
            max_of(runs, |r| per_bucket(&r.rejected)),
            format!("max {}/s", r.rejected.iter().max().unwrap_or(&0)),
        ),
    ];
    for (name, values, max, note) in rows {
        let _ = writeln!(s, "  {name:<17} |{}| {note}", spark(&values, max));
    }
}

/// The overload scenario's summary: every run at the peak of the offered load.
fn overload_table(s: &mut String, o: &Outcome, opts: &RunOptions, style: crate::term::Style) {
    use std::fmt::Write;
    let from = opts.duration - opts.duration / STEPS;
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{}",
        style.bold(&format!(
            "at the peak ({:.0} requests/s offered, {:.0}/s capacity; requests arriving from {} on)",
            opts.rate,
            overload_capacity(),
            human(from)
        ))
    );
    let w = o.runs.iter().map(|r| r.label.chars().count()).max().unwrap_or(7).max(7);
    let _ = writeln!(s, "  {:<w$}  {:>9}  {:>9}  {:>9}  {:>10}  {:>9}", "variant", "limit end", "p50", "p99", "goodput/s", "failed/s");
    for r in &o.runs {
        let Some(p) = &r.peak else { continue };
        let limit = p.final_limit.map(|l| l.to_string()).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "  {:<w$}  {:>9}  {:>9}  {:>9}  {:>10.1}  {:>9.1}",
            r.label,
            limit,
            human(p.latency[0]),
            human(p.latency[1]),
            p.goodput,
            p.failed
        );
    }
    let _ = writeln!(s, "\nstrips: one character per second, each row scaled to its largest value over all runs (the limit: over its run)");
}

/// JSON report.
pub fn report_json(o: &Outcome, opts: &RunOptions) -> Value {
    let runs: Vec<Value> = o
        .runs
        .iter()
        .map(|r| {
            json!({
                "label": r.label, "requests": r.requests, "succeeded": r.succeeded, "via_fallback": r.via_fallback,
                "failed": r.failed, "unfinished": r.unfinished, "dependency_calls": r.dependency_calls,
                "amplification": r.amplification, "window_amplification": r.window_amplification, "peak_load": r.peak_load,
                "success_rate": if r.requests > 0 { r.succeeded as f64 / r.requests as f64 } else { 0.0 },
                "latency": {"p50": r.latency[0], "p90": r.latency[1], "p99": r.latency[2], "max": r.latency[3]},
                "offered": r.offered, "load": r.load, "invalid": r.invalid,
                "limit": r.limit, "goodput": r.goodput, "rejected": r.rejected,
                "bucket_latency": r.bucket_latency.iter().map(|l| json!({"p50": l[0], "p99": l[1]})).collect::<Vec<_>>(),
                "peak": r.peak.as_ref().map(|p| json!({
                    "offered": p.offered, "p50": p.latency[0], "p99": p.latency[1], "goodput": p.goodput,
                    "failed": p.failed, "final_limit": p.final_limit,
                })),
                "layers": r.layers.iter().map(|l| json!({
                    "calls": l.calls, "attempts": l.attempts, "retries": l.retries, "budget_refusals": l.budget_refusals,
                    "rejections": l.rejections, "fallbacks": l.fallbacks,
                    "transitions": l.transitions.iter().map(|(t, a, b)| json!([t, a.name(), b.name()])).collect::<Vec<_>>(),
                    "breaker": breaker_strip(&l.breaker),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "scenario": opts.scenario.name(), "seed": opts.seed, "rate": opts.rate, "duration": opts.duration,
        "dependency": (opts.scenario == Scenario::Overload).then(|| json!({"servers": SERVERS, "capacity": overload_capacity()})),
        "analytic": o.analytic.map(|(a, b, w)| json!({"worst_attempts": w, "amplification": a, "amplification_with_budget": b})),
        "runs": runs,
    })
}

const COLORS: [&str; 5] = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];

/// The SVG chart: offered load and dependency calls per second, breaker state per layer; for
/// the overload scenario four panels: limit, p99 latency, goodput and rejections over time.
pub fn chart(o: &Outcome, opts: &RunOptions) -> String {
    if opts.scenario == Scenario::Overload {
        return overload_chart(o, opts);
    }
    let bucket_secs = BUCKET as f64 / S as f64;
    let mut series = Vec::new();
    if let Some(first) = o.runs.first() {
        series.push(svg::Series { name: "requests/s".into(), color: "#111827", values: first.offered.iter().map(|v| *v as f64).collect() });
    }
    for (i, r) in o.runs.iter().enumerate() {
        let name = if o.runs.len() == 1 { "dependency calls/s".to_string() } else { r.label.clone() };
        series.push(svg::Series {
            name,
            color: COLORS.get(i % COLORS.len()).copied().unwrap_or("#000"),
            values: r.load.iter().map(|v| *v as f64).collect(),
        });
    }
    let mut bands = Vec::new();
    for r in &o.runs {
        for (i, l) in r.layers.iter().enumerate() {
            if l.breaker.iter().any(Option::is_some) {
                let who = if r.layers.len() == 1 { "caller".to_string() } else { format!("layer {}", i + 1) };
                let name = if o.runs.len() == 1 { who } else { format!("{who} ({})", r.label) };
                bands.push(svg::Band { name, states: l.breaker.clone() });
            }
        }
    }
    let marks: Vec<(f64, f64, &str)> =
        opts.scenario.window().map(|(a, b)| (a as f64 / S as f64, b as f64 / S as f64, "impaired")).into_iter().collect();
    let title = format!("levee simulate --scenario {} (seed {}, {} requests/s)", opts.scenario.name(), opts.seed, opts.rate);
    svg::render(&title, "calls per second", bucket_secs, &series, &bands, &marks)
}

fn overload_chart(o: &Outcome, opts: &RunOptions) -> String {
    let bucket_secs = BUCKET as f64 / S as f64;
    let buckets = opts.duration.div_ceil(BUCKET) as usize;
    let color = |i: usize| COLORS.get(i % COLORS.len()).copied().unwrap_or("#000");
    let runs = |f: &dyn Fn(&Run) -> Vec<f64>| -> Vec<svg::Series> {
        o.runs.iter().enumerate().map(|(i, r)| svg::Series { name: r.label.clone(), color: color(i), values: f(r) }).collect()
    };
    let flat = |name: String, v: f64| svg::Series { name, color: "#111827", values: vec![v; buckets] };
    let cap = overload_capacity();
    // Where the offered load is above the capacity.
    let over = (0..STEPS).find(|k| opts.rate * (*k + 1) as f64 / STEPS as f64 > cap);
    let marks: Vec<(f64, f64, &str)> = over
        .map(|k| ((opts.duration / STEPS * k) as f64 / S as f64, opts.duration as f64 / S as f64, "offered > capacity"))
        .into_iter()
        .collect();
    let mut limit = runs(&limit_values);
    limit.push(flat(format!("{SERVERS} servers"), SERVERS as f64));
    let p99 = runs(&|r: &Run| r.bucket_latency.iter().map(|l| l[1] as f64 / MS as f64).collect());
    let mut goodput = runs(&|r: &Run| per_bucket(&r.goodput));
    if let Some(first) = o.runs.first() {
        goodput.push(svg::Series { name: "offered".into(), color: "#6b7280", values: per_bucket(&first.offered) });
    }
    goodput.push(flat(format!("capacity {cap:.0}/s"), cap));
    let rejected = runs(&|r: &Run| per_bucket(&r.rejected));
    let head = format!("levee simulate --scenario overload (seed {}, up to {} requests/s)", opts.seed, opts.rate);
    let panels = [
        (format!("{head}: concurrency limit"), "limit", limit),
        ("p99 latency of the requests that succeeded".to_string(), "ms", p99),
        ("goodput: requests that succeeded per second".to_string(), "requests/s", goodput),
        ("attempts rejected by the limit per second".to_string(), "rejected/s", rejected),
    ];
    let parts: Vec<String> = panels.iter().map(|(title, y, series)| svg::render(title, y, bucket_secs, series, &[], &marks)).collect();
    svg::stack(&parts)
}
