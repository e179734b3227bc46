//! Fleet-wide state through Redis (feature `fleet-redis`, docs/fleet.md): a [`Levee`] handle's
//! breaker evidence, retry budget and rate limit shared with every process that runs the same
//! policies, through one Redis, with [redis-rs](https://docs.rs/redis) and its tokio
//! `ConnectionManager`.
//!
//! **The core decides, this module carries bytes.** For a policy with a `fleet` section it
//! reads a key's shared state and the store's clock, asks the engine to merge its evidence in
//! (`fleet-merge`), writes the result back with a compare-and-set in Lua (no lock; a conflict
//! merges again into what the store holds) and hands the accepted bytes to the engine
//! (`fleet-apply`), which applies the quorum rule, probe coordination and the shared budget.
//! The fleet rate limit is GCRA in Lua on Redis's `TIME`, with the parameters of the core's
//! fleet plan. The Lua scripts are byte copies of `fleet/lua/` (checked by `fleet/tests/run.sh`).
//!
//! **The hot path stays local.** Publication runs on a background task every `publish-every`;
//! a call waits on Redis only for a fleet rate limit (one round trip per `lease` tokens), or
//! for everything when the policy says `publish: strict`.
//!
//! **Redis down or slow.** Every Redis operation is bounded by its policy's `timeout` (a few
//! ms). Past it, or on any Redis error, every call goes on at once with local-only decisions
//! (the engine's own breaker, budget and rate limit), a [`FleetEvent`] of kind
//! [`FleetEventKind::Degraded`] is emitted (and logged, target `levee`), and the store is tried
//! again every `retry-every`; when it answers, [`FleetEventKind::Restored`], and the state
//! converges with the next publication. Nothing on the data path fails because of Redis.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use levee::fleet::Fleet;
//! let levee = levee::Levee::from_file("policies.yaml")?;
//! let fleet = Fleet::builder(&levee).node("web-1").connect("redis://10.0.0.5:6379/0").await?;
//! let charged = fleet
//!     .call("payments")
//!     .key("acquirer-a")
//!     .run(|_attempt| async { Ok::<_, std::io::Error>("charged") })
//!     .await;
//! fleet.close().await;
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use levee_core::{LoadError, Reason};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisResult, Script, Value};
use serde_json::Value as Json;
use tokio::sync::Notify;

use crate::call::Call;
use crate::error::LeveeError;
use crate::outcome::{IntoOutcome, Outcome};
use crate::raw::{RawEngine, Trap};
use crate::{Attempt, Levee};

/// `fleet/lua/gcra.lua`: the fleet rate limit.
const GCRA_LUA: &str = include_str!("gcra.lua");
/// `fleet/lua/state.lua`: read, or compare-and-set on a version.
const STATE_LUA: &str = include_str!("state.lua");

/// Keys (policy and key) whose evidence is published, at most; the least recently used go
/// (`fleet.MAX_KEYS` of the contract).
const MAX_KEYS: usize = crate::constants::FLEET_MAX_KEYS as usize;
/// Compare-and-set rounds of one publication (`fleet.MAX_CAS`).
const MAX_CAS: usize = crate::constants::FLEET_MAX_CAS as usize;
/// The bound of the operations outside a call: connecting and loading the scripts, inspecting.
const SETUP_TIMEOUT: Duration = Duration::from_secs(1);

/// What a [`FleetEvent`] tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FleetEventKind {
    /// The store is slow or down: local decisions only.
    Degraded,
    /// The store answers again: publishing.
    Restored,
    /// The store holds bytes the core refused (or the engine refused to apply them); local
    /// decisions go on.
    BadState,
}

impl FleetEventKind {
    /// `degraded`, `restored` or `bad-state` (the names of every host).
    pub fn name(self) -> &'static str {
        match self {
            FleetEventKind::Degraded => "degraded",
            FleetEventKind::Restored => "restored",
            FleetEventKind::BadState => "bad-state",
        }
    }
}

impl fmt::Display for FleetEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Something the fleet option did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetEvent {
    /// What happened.
    pub kind: FleetEventKind,
    /// Why (the store's error, the core's refusal).
    pub detail: String,
    /// The policy (empty when not about one key).
    pub policy: String,
    /// The key (empty when not about one key).
    pub key: String,
}

/// Why [`Fleet::connect`] or [`Fleet::inspect`] failed. Never returned on the data path.
#[derive(Debug)]
pub enum FleetError {
    /// The Redis URL or client configuration was refused.
    Client(redis::RedisError),
    /// The policy engine trapped while reading the fleet plans.
    Engine(Trap),
    /// The core's fleet plan could not be read (a host bug).
    Plan(String),
    /// No such policy, or it has no `fleet` section.
    NoFleet(String),
    /// The store did not answer (in time).
    Store(String),
    /// The store holds bytes the core refused.
    BadState(LoadError),
    /// The key is longer than the bound (docs/policy.md, "Keys"): refused before the store, as
    /// every entry that takes a key.
    KeyTooLong(crate::KeyTooLong),
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FleetError::Client(e) => write!(f, "levee fleet: the Redis client: {e}"),
            FleetError::Engine(t) => write!(f, "levee fleet: {t}"),
            FleetError::Plan(m) => write!(f, "levee fleet: the core's plan: {m}"),
            FleetError::NoFleet(p) => write!(f, "levee fleet: policy '{p}' has no fleet section"),
            FleetError::Store(m) => write!(f, "levee fleet: the store: {m}"),
            FleetError::BadState(e) => write!(f, "levee fleet: the store's bytes: {}: {}", e.path, e.message),
            FleetError::KeyTooLong(k) => write!(f, "levee fleet: {k}"),
        }
    }
}

impl std::error::Error for FleetError {}

/// A Redis operation that failed or answered too late.
#[derive(Debug)]
enum StoreError {
    Redis(redis::RedisError),
    Timeout(Duration),
    Late(Duration),
    Reply(&'static str),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Redis(e) => write!(f, "{e}"),
            StoreError::Timeout(d) => write!(f, "no answer within the policy's fleet timeout ({d:?})"),
            StoreError::Late(d) => write!(f, "the store answered after the policy's fleet timeout ({d:?})"),
            StoreError::Reply(what) => write!(f, "the store answered {what}"),
        }
    }
}

type Listener = Arc<dyn Fn(&FleetEvent) + Send + Sync>;

/// The fleet rate limit of a plan (ns).
#[derive(Clone, Copy, Debug)]
struct Rate {
    interval: u64,
    burst: u64,
    max_wait: u64,
    lease: u64,
}

/// Tokens taken from the fleet bucket ahead (a lease), or the store's last refusal.
#[derive(Clone, Copy, Debug, Default)]
struct Lease {
    tokens: u64,
    expires: u64,
    until: u64,
}

/// A policy's fleet plan, as the core gives it.
struct Plan {
    policy: String,
    index: u32,
    /// The slot of the policy's keys in [`Keys`].
    slot: usize,
    key_prefix: String,
    strict: bool,
    /// Whether it has a breaker or a shared budget to publish.
    shares: bool,
    publish_every: Duration,
    timeout: Duration,
    retry_every: Duration,
    ttl_ms: u64,
    rate: Option<Rate>,
    leases: Mutex<HashMap<String, Lease>>,
}

impl Plan {
    fn parse(text: &str, index: u32, slot: usize) -> Result<Plan, String> {
        let v: Json = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let num = |v: &Json, f: &str| v.get(f).and_then(Json::as_u64).ok_or_else(|| format!("no integer `{f}`"));
        let text = |f: &str| v.get(f).and_then(Json::as_str).map(str::to_string).ok_or_else(|| format!("no string `{f}`"));
        let flag = |f: &str| v.get(f).and_then(Json::as_bool).ok_or_else(|| format!("no boolean `{f}`"));
        let rate = match v.get("rate-limit") {
            None | Some(Json::Null) => None,
            Some(r) => Some(Rate {
                interval: num(r, "interval")?.max(1),
                burst: num(r, "burst")?,
                max_wait: num(r, "max-wait")?,
                lease: num(r, "lease")?,
            }),
        };
        Ok(Plan {
            policy: text("policy")?,
            index,
            slot,
            key_prefix: text("key-prefix")?,
            strict: text("publish")? == "strict",
            shares: flag("breaker")? || flag("budget")?,
            publish_every: Duration::from_nanos(num(&v, "publish-every")?.max(1_000_000)),
            timeout: Duration::from_nanos(num(&v, "timeout")?.max(1)),
            retry_every: Duration::from_nanos(num(&v, "retry-every")?.max(1_000_000)),
            ttl_ms: (num(&v, "ttl")? / 1_000_000).max(1),
            rate,
            leases: Mutex::new(HashMap::new()),
        })
    }

    /// Published by the background task (not strict, something to publish).
    fn background(&self) -> bool {
        !self.strict && self.shares
    }

    fn state_key(&self, key: &str) -> String {
        format!("{}{key}}}:s", self.key_prefix)
    }

    fn rate_key(&self, key: &str) -> String {
        format!("{}{key}}}:r", self.key_prefix)
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<String, Lease>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The keys in use per plan slot, bounded: two generations of at most `MAX_KEYS / 2` keys; a
/// key not used during two generations is no longer published (its record expires after the
/// policy's `ttl`, as a stopped process's does).
struct Keys {
    current: Vec<HashSet<String>>,
    previous: Vec<HashSet<String>>,
    count: usize,
}

impl Keys {
    fn touch(&mut self, slot: usize, key: &str) {
        if self.current.get(slot).is_some_and(|s| s.contains(key)) {
            return;
        }
        if self.count >= MAX_KEYS / 2 {
            let fresh = self.current.iter().map(|_| HashSet::new()).collect();
            self.previous = std::mem::replace(&mut self.current, fresh);
            self.count = 0;
        }
        if let Some(s) = self.current.get_mut(slot) {
            s.insert(key.to_string());
            self.count += 1;
        }
    }

    fn all(&self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for (slot, (cur, prev)) in self.current.iter().zip(&self.previous).enumerate() {
            out.extend(cur.iter().map(|k| (slot, k.clone())));
            out.extend(prev.iter().filter(|k| !cur.contains(*k)).map(|k| (slot, k.clone())));
        }
        out
    }
}

struct Inner {
    levee: Levee,
    conn: ConnectionManager,
    node: String,
    plans: HashMap<String, Arc<Plan>>,
    by_slot: Vec<Arc<Plan>>,
    /// The longest fleet timeout of the policies: for pings.
    timeout: Duration,
    up: AtomicBool,
    closed: AtomicBool,
    keys: Mutex<Keys>,
    listener: Option<Listener>,
    conflicts: AtomicU64,
    publications: AtomicU64,
    gcra: Script,
    state: Script,
    stop: Arc<Notify>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(t) = self.task.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

/// Builds a [`Fleet`] ([`Fleet::builder`]).
#[derive(Clone)]
pub struct FleetBuilder {
    levee: Levee,
    node: Option<String>,
    listener: Option<Listener>,
    background: bool,
}

impl fmt::Debug for FleetBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetBuilder").field("node", &self.node).field("background", &self.background).finish_non_exhaustive()
    }
}

impl FleetBuilder {
    /// This process's name in the shared state (default `host-pid`); unique in the fleet, at
    /// most 128 bytes.
    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// Call `f` with every [`FleetEvent`] (besides the log line, target `levee`). A listener
    /// that panics is reported and ignored.
    pub fn on_event(mut self, f: impl Fn(&FleetEvent) + Send + Sync + 'static) -> Self {
        self.listener = Some(Arc::new(f));
        self
    }

    /// Whether a background task publishes (default true); without it, call [`Fleet::sync`].
    pub fn background(mut self, on: bool) -> Self {
        self.background = on;
        self
    }

    /// Make the fleet option for the handle against the Redis server at `url`
    /// (`redis://host:port/db`). Fails only for a URL the client refuses or plans it cannot
    /// read: a server that is down or slow makes a fleet that starts local-only (event
    /// `degraded`) and converges once the server answers. Spawns the publishing task on the
    /// current tokio runtime.
    pub async fn connect(self, url: &str) -> Result<Fleet, FleetError> {
        let node = self.node.unwrap_or_else(default_node);
        let (plans, by_slot) = read_plans(&self.levee)?;
        let timeout = by_slot.iter().map(|p| p.timeout).max().unwrap_or(Duration::from_millis(5));
        let client = redis::Client::open(url).map_err(FleetError::Client)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(5))))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(100));
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(FleetError::Client)?;
        let slots = by_slot.len();
        let inner = Arc::new(Inner {
            levee: self.levee,
            conn,
            node,
            plans,
            by_slot,
            timeout,
            up: AtomicBool::new(true),
            closed: AtomicBool::new(false),
            keys: Mutex::new(Keys {
                current: (0..slots).map(|_| HashSet::new()).collect(),
                previous: (0..slots).map(|_| HashSet::new()).collect(),
                count: 0,
            }),
            listener: self.listener,
            conflicts: AtomicU64::new(0),
            publications: AtomicU64::new(0),
            gcra: Script::new(GCRA_LUA),
            state: Script::new(STATE_LUA),
            stop: Arc::new(Notify::new()),
            task: Mutex::new(None),
        });
        // Connect and load the scripts once, outside the per-operation timeout.
        if let Err(e) = inner.prepare(SETUP_TIMEOUT).await {
            inner.degrade(&e);
        }
        if self.background && !inner.by_slot.is_empty() {
            let task = tokio::spawn(publish_loop(Arc::downgrade(&inner), inner.stop.clone()));
            *inner.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        }
        Ok(Fleet { inner })
    }
}

fn default_node() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "host".to_string());
    format!("{host}-{}", std::process::id())
}

type PlanMaps = (HashMap<String, Arc<Plan>>, Vec<Arc<Plan>>);

fn read_plans(levee: &Levee) -> Result<PlanMaps, FleetError> {
    let names = levee.policy_names();
    let texts = levee.with_raw(|raw: &mut RawEngine| -> Result<Vec<(u32, String)>, Trap> {
        let mut out = Vec::new();
        for name in &names {
            if let Some(index) = raw.try_policy_index(name)? {
                if let Some(text) = raw.try_fleet_plan(index)? {
                    out.push((index, text));
                }
            }
        }
        Ok(out)
    });
    let mut plans = HashMap::new();
    let mut by_slot = Vec::new();
    for (slot, (index, text)) in texts.map_err(FleetError::Engine)?.into_iter().enumerate() {
        let plan = Arc::new(Plan::parse(&text, index, slot).map_err(FleetError::Plan)?);
        plans.insert(plan.policy.clone(), plan.clone());
        by_slot.push(plan);
    }
    Ok((plans, by_slot))
}

/// The fleet option of one [`Levee`] handle: its policies' breaker evidence, retry budgets
/// and fleet rate limits shared through Redis. Cheap to clone, `Send + Sync`; publication
/// stops when [`Fleet::close`] is called or every clone is dropped.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
}

impl fmt::Debug for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("node", &self.inner.node)
            .field("policies", &self.inner.plans.len())
            .field("up", &self.is_up())
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// A builder of the fleet option of `levee` (node name, event listener).
    pub fn builder(levee: &Levee) -> FleetBuilder {
        FleetBuilder { levee: levee.clone(), node: None, listener: None, background: true }
    }

    /// [`Fleet::builder`] with the defaults, connected to `url`.
    pub async fn connect(levee: &Levee, url: &str) -> Result<Fleet, FleetError> {
        Fleet::builder(levee).connect(url).await
    }

    /// The handle the fleet shares the state of.
    pub fn levee(&self) -> &Levee {
        &self.inner.levee
    }

    /// This process's name in the shared state.
    pub fn node(&self) -> &str {
        &self.inner.node
    }

    /// False while the fleet runs local-only (the store was slow or down).
    pub fn is_up(&self) -> bool {
        self.inner.up.load(Ordering::Relaxed)
    }

    /// Compare-and-set conflicts merged again (none is lost).
    pub fn conflicts(&self) -> u64 {
        self.inner.conflicts.load(Ordering::Relaxed)
    }

    /// Publications the store accepted.
    pub fn publications(&self) -> u64 {
        self.inner.publications.load(Ordering::Relaxed)
    }

    /// Start describing a call under a named policy with the fleet's state (a policy without
    /// a `fleet` section runs as [`Levee::call`] does).
    pub fn call<'a, T, E>(&'a self, policy: &'a str) -> FleetCall<'a, T, E> {
        FleetCall { fleet: self, policy, key: String::new(), call: self.inner.levee.call(policy) }
    }

    /// Run `f` under a named policy and key with the fleet's state.
    pub async fn run<T, E, F, Fut>(&self, policy: &str, key: &str, f: F) -> Result<T, LeveeError<E>>
    where
        T: 'static,
        E: IntoOutcome + 'static,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call(policy).key(key).run(f).await
    }

    /// Publish this process's evidence for a policy and key and apply the fleet's state now;
    /// false when there is nothing to publish or the store did not answer (then local-only).
    /// A key longer than the bound ([`crate::KeyTooLong`]) publishes nothing (false).
    pub async fn sync(&self, policy: &str, key: &str) -> bool {
        if crate::KeyTooLong::check(key).is_err() {
            return false;
        }
        let Some(plan) = self.inner.plans.get(policy) else { return false };
        if !self.is_up() {
            return false;
        }
        match self.inner.sync(plan, key).await {
            Ok(()) => true,
            Err(e) => {
                self.inner.degrade(&e);
                false
            }
        }
    }

    /// A key's shared state as the core's JSON (`None` when the store holds none).
    pub async fn inspect(&self, policy: &str, key: &str) -> Result<Option<String>, FleetError> {
        crate::KeyTooLong::check(key).map_err(FleetError::KeyTooLong)?;
        let plan = self.inner.plans.get(policy).ok_or_else(|| FleetError::NoFleet(policy.to_string()))?;
        let reply = self
            .inner
            .state_op(SETUP_TIMEOUT, &plan.state_key(key), None, &[], plan.ttl_ms)
            .await
            .map_err(|e| FleetError::Store(e.to_string()))?;
        if reply.data.is_empty() {
            return Ok(None);
        }
        let json = self.inner.levee.with_raw(|raw| raw.try_fleet_inspect(&reply.data));
        match json {
            Ok(Ok(j)) => Ok(Some(j)),
            Ok(Err(e)) => Err(FleetError::BadState(e)),
            Err(t) => Err(FleetError::Engine(t)),
        }
    }

    /// Stop publishing (waiting for a publication under way). Calls go on, with the state
    /// the engine has.
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::Relaxed);
        self.inner.stop.notify_one();
        let task = self.inner.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }
}

/// A call under a policy with the fleet's state ([`Fleet::call`]): the fleet rate limit
/// first (a [`LeveeError`] with reason `rate-limited` when it rejects), then the policy as
/// [`Levee::call`] runs it, then, in strict mode, a publication before it returns.
#[must_use = "a call does nothing until it is run"]
pub struct FleetCall<'a, T, E> {
    fleet: &'a Fleet,
    policy: &'a str,
    key: String,
    call: Call<'a, T, E>,
}

impl<'a, T: 'static, E: 'static> FleetCall<'a, T, E> {
    /// The key whose breaker, limiter and budget apply, locally and in the fleet.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// Describe the call further (fallbacks, flags, retry predicates: any [`Call`] option
    /// but the key, which is [`FleetCall::key`]'s).
    pub fn with(mut self, f: impl FnOnce(Call<'a, T, E>) -> Call<'a, T, E>) -> Self {
        self.call = f(self.call);
        self
    }

    /// Run `f`; `Ok` is a success, an `Err` is described by [`IntoOutcome`].
    pub async fn run<F, Fut>(self, f: F) -> Result<T, LeveeError<E>>
    where
        E: IntoOutcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_classified(crate::call::of_result::<T, E>, f).await
    }

    /// Run `f`, describing each result with `classify` (see [`Call::run_classified`]).
    pub async fn run_classified<C, F, Fut>(self, classify: C, f: F) -> Result<T, LeveeError<E>>
    where
        C: Fn(&Result<T, E>) -> Outcome,
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let FleetCall { fleet, policy, key, call } = self;
        // Refused before the store sees the key (its rate-limit token and records are named by it).
        if let Err(k) = crate::KeyTooLong::check(&key) {
            let mut e = LeveeError::new(Reason::None, policy);
            e.key_too_long = Some(k);
            return Err(e);
        }
        let inner = &*fleet.inner;
        let Some(plan) = inner.plans.get(policy) else { return call.key(key).run_classified(classify, f).await };
        if plan.background() {
            inner.keys().touch(plan.slot, &key);
        }
        if let Some(rate) = &plan.rate {
            if let Err(hint) = inner.take(plan, rate, &key).await {
                let mut e = LeveeError::new(Reason::RateLimited, policy);
                e.retry_after = Some(Duration::from_nanos(hint));
                return Err(e);
            }
        }
        if !(plan.strict && plan.shares) {
            return call.key(key).run_classified(classify, f).await;
        }
        let r = call.key(key.clone()).run_classified(classify, f).await;
        if fleet.is_up() {
            if let Err(e) = inner.sync(plan, &key).await {
                inner.degrade(&e);
            }
        }
        r
    }
}

/// What `state.lua` answered.
struct StateReply {
    written: bool,
    version: u64,
    wall: u64,
    data: Vec<u8>,
}

fn int(v: Option<&Value>) -> Result<i64, StoreError> {
    match v {
        Some(Value::Int(n)) => Ok(*n),
        _ => Err(StoreError::Reply("no integer where the script returns one")),
    }
}

fn state_reply(v: Value) -> Result<StateReply, StoreError> {
    let Value::Array(items) = v else { return Err(StoreError::Reply("no array from the state script")) };
    let (written, version, wall) = (int(items.first())?, int(items.get(1))?, int(items.get(2))?);
    let data = match items.into_iter().nth(3) {
        Some(Value::BulkString(b)) => b,
        Some(Value::SimpleString(s)) => s.into_bytes(),
        _ => Vec::new(),
    };
    Ok(StateReply { written: written == 1, version: version.max(0) as u64, wall: wall.max(0) as u64, data })
}

impl Inner {
    fn keys(&self) -> MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn now(&self) -> u64 {
        self.levee.shared.now()
    }

    fn emit(&self, kind: FleetEventKind, detail: String, policy: &str, key: &str) {
        if kind == FleetEventKind::Restored {
            tracing::info!(target: "levee", event = kind.name(), node = %self.node, detail = %detail, "levee fleet {kind}");
        } else {
            tracing::warn!(target: "levee", event = kind.name(), node = %self.node, policy, key, detail = %detail, "levee fleet {kind}");
        }
        if let Some(l) = &self.listener {
            let ev = FleetEvent { kind, detail, policy: policy.to_string(), key: key.to_string() };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l(&ev))).is_err() {
                tracing::error!(target: "levee", "a levee fleet listener panicked; ignored");
            }
        }
    }

    fn degrade(&self, err: &StoreError) {
        for p in &self.by_slot {
            p.leases().clear();
        }
        if self.up.swap(false, Ordering::Relaxed) {
            self.emit(FleetEventKind::Degraded, format!("{err}; local decisions only"), "", "");
        }
    }

    /// One Redis operation within `limit`: an answer past it counts as none.
    async fn bounded<T>(&self, limit: Duration, op: impl Future<Output = RedisResult<T>>) -> Result<T, StoreError> {
        let start = Instant::now();
        match tokio::time::timeout(limit, op).await {
            Err(_) => Err(StoreError::Timeout(limit)),
            Ok(Err(e)) => Err(StoreError::Redis(e)),
            Ok(Ok(_)) if start.elapsed() > limit => Err(StoreError::Late(limit)),
            Ok(Ok(v)) => Ok(v),
        }
    }

    /// Ping and load both scripts (after a start or an outage), within `limit` each.
    async fn prepare(&self, limit: Duration) -> Result<(), StoreError> {
        let mut c = self.conn.clone();
        self.bounded(limit, redis::cmd("PING").query_async::<String>(&mut c)).await?;
        let mut c = self.conn.clone();
        self.bounded(limit, self.gcra.load_async(&mut c)).await?;
        let mut c = self.conn.clone();
        self.bounded(limit, self.state.load_async(&mut c)).await?;
        Ok(())
    }

    async fn state_op(&self, limit: Duration, sk: &str, version: Option<u64>, data: &[u8], ttl_ms: u64) -> Result<StateReply, StoreError> {
        let mut c = self.conn.clone();
        let mut inv = self.state.prepare_invoke();
        inv.key(sk);
        match version {
            Some(v) => inv.arg(v),
            None => inv.arg(""),
        };
        inv.arg(data).arg(ttl_ms);
        state_reply(self.bounded(limit, inv.invoke_async::<Value>(&mut c)).await?)
    }

    /// The fleet rate limit: `Ok` when admitted (after a wait, if the core's semantics gave
    /// one), `Err(retry-after ns)` when rejected. The store being down admits (the engine's
    /// own limiter still applies).
    async fn take(&self, plan: &Plan, rate: &Rate, key: &str) -> Result<(), u64> {
        if !self.up() {
            return Ok(());
        }
        let (want, upto) = if rate.lease > 1 { (rate.lease, 1u64) } else { (1, 0u64) };
        let now = self.now();
        if let Some(b) = plan.leases().get_mut(key) {
            if b.tokens > 0 && now < b.expires {
                b.tokens -= 1;
                return Ok(());
            }
            if now < b.until {
                // The store's last answer: no token before then.
                return Err(b.until - now);
            }
        }
        let mut c = self.conn.clone();
        let mut inv = self.gcra.prepare_invoke();
        inv.key(plan.rate_key(key)).arg(rate.interval).arg(rate.burst).arg(want).arg(rate.max_wait).arg(upto);
        let answer = self.bounded(plan.timeout, inv.invoke_async::<Vec<i64>>(&mut c)).await;
        let (kind, granted, ns) = match answer {
            Ok(v) => match v.as_slice() {
                &[kind, granted, ns] => (kind, granted, ns.max(0) as u64),
                _ => {
                    self.degrade(&StoreError::Reply("no triple from the rate script"));
                    return Ok(());
                }
            },
            Err(e) => {
                self.degrade(&e);
                return Ok(());
            }
        };
        match kind {
            0 => {
                if want > 1 && granted > 1 {
                    let mut leases = plan.leases();
                    if leases.len() >= MAX_KEYS && !leases.contains_key(key) {
                        leases.clear(); // unused leased tokens lapse: the fleet can only under-admit
                    }
                    let b = leases.entry(key.to_string()).or_default();
                    if now >= b.expires {
                        b.tokens = 0;
                    }
                    b.tokens += granted as u64 - 1;
                    b.expires = now.saturating_add(rate.interval.saturating_mul(rate.burst));
                }
                Ok(())
            }
            1 => {
                tokio::time::sleep(Duration::from_nanos(ns.min(rate.max_wait))).await;
                Ok(())
            }
            _ => {
                let mut leases = plan.leases();
                if leases.len() >= MAX_KEYS && !leases.contains_key(key) {
                    leases.clear();
                }
                leases.entry(key.to_string()).or_default().until = now.saturating_add(ns);
                Err(ns)
            }
        }
    }

    /// The engine, locked (a held-back success settled first), for one fleet crossing; the
    /// events it leaves (a quorum opening) and a trap are emitted once unlocked.
    fn engine<R>(&self, op: impl FnOnce(&mut RawEngine) -> Result<R, Trap>) -> Option<R> {
        let shared = &*self.levee.shared;
        let mut core = shared.lock();
        core.flush();
        let r = op(&mut core.raw);
        let r = match r {
            Ok(v) => Some(v),
            Err(t) => {
                core.traps.push(t);
                None
            }
        };
        core.collect_events();
        shared.finish_locked(core);
        r
    }

    /// One publication: read, merge, compare-and-set (merging again on a conflict), apply.
    async fn sync(&self, plan: &Plan, key: &str) -> Result<(), StoreError> {
        let sk = plan.state_key(key);
        let mut cur = self.state_op(plan.timeout, &sk, None, &[], plan.ttl_ms).await?;
        for _ in 0..MAX_CAS {
            let now = self.now();
            let merged = match self.engine(|raw| raw.try_fleet_merge(plan.index, key, &self.node, now, cur.wall, &cur.data)) {
                Some(Ok(bytes)) => bytes,
                Some(Err(e)) => {
                    self.emit(FleetEventKind::BadState, format!("{}: {}", e.path, e.message), &plan.policy, key);
                    return Ok(());
                }
                None => return Ok(()), // the engine trapped and recovered: publish next time
            };
            let out = self.state_op(plan.timeout, &sk, Some(cur.version), &merged, plan.ttl_ms).await?;
            if out.written {
                self.publications.fetch_add(1, Ordering::Relaxed);
                let wall = cur.wall;
                if let Some(Err(e)) = self.engine(|raw| raw.try_fleet_apply(plan.index, key, &self.node, now, wall, &merged)) {
                    self.emit(FleetEventKind::BadState, format!("{}: {}", e.path, e.message), &plan.policy, key);
                }
                return Ok(());
            }
            self.conflicts.fetch_add(1, Ordering::Relaxed);
            cur = out;
        }
        Ok(())
    }

    /// Publish every key in use of the plans published in the background.
    async fn publish_all(&self) {
        let keys = self.keys().all();
        for (slot, key) in keys {
            let Some(plan) = self.by_slot.get(slot) else { continue };
            if !plan.background() || !self.up() || self.closed.load(Ordering::Relaxed) {
                continue;
            }
            if let Err(e) = self.sync(plan, &key).await {
                self.degrade(&e);
            }
        }
    }
}

/// The background task: publish every `publish-every` while the store answers; while it
/// does not, try it every `retry-every`. It holds the fleet only while it works, so that
/// dropping the last [`Fleet`] ends it (aborted by `Inner`'s drop).
async fn publish_loop(weak: Weak<Inner>, stop: Arc<Notify>) {
    let (every, retry) = match weak.upgrade() {
        Some(inner) => (
            inner.by_slot.iter().map(|p| p.publish_every).min().unwrap_or(Duration::from_millis(250)),
            inner.by_slot.iter().map(|p| p.retry_every).min().unwrap_or(Duration::from_secs(1)),
        ),
        None => return,
    };
    loop {
        let wait = {
            let Some(inner) = weak.upgrade() else { return };
            if inner.closed.load(Ordering::Relaxed) {
                return;
            }
            if inner.up() {
                inner.publish_all().await;
                every
            } else {
                retry
            }
        };
        if tokio::time::timeout(wait, stop.notified()).await.is_ok() {
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        if inner.closed.load(Ordering::Relaxed) {
            return;
        }
        if !inner.up() && inner.prepare(inner.timeout).await.is_ok() {
            inner.up.store(true, Ordering::Relaxed);
            inner.emit(FleetEventKind::Restored, "the store answers again; publishing".to_string(), "", "");
        }
    }
}
