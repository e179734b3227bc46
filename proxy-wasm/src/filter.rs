//! The proxy-wasm glue: Envoy's contexts around a [`Gate`]. It decides nothing: it reads
//! headers, hands them to the gate, and does what the gate answers.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, Status};

use crate::config::{self, KeySource};
use crate::gate::{Admit, Call, Gate, Reply, Response, Stats, Store, HEADER_ATTEMPT};

#[allow(unsafe_code)] // the ABI's exported entry point (`#[no_mangle] _initialize`)
mod entry {
    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(super::Root::default()) });
    }}
}

/// The proxy-wasm host calls this module makes, counted (`levee.host_calls`): every call into
/// Envoy goes through [`host`], so that the count per request is measured, not estimated.
mod host {
    use std::cell::Cell;
    use std::time::{Duration, SystemTime};

    use proxy_wasm::hostcalls;
    use proxy_wasm::types::{BufferType, Bytes, LogLevel, MapType, MetricType, Status};

    use crate::headers::Headers;

    thread_local! {
        static CALLS: Cell<u64> = const { Cell::new(0) };
    }

    /// Host calls made so far by this VM.
    pub fn calls() -> u64 {
        CALLS.with(Cell::get)
    }

    fn count() {
        CALLS.with(|c| c.set(c.get() + 1));
    }

    pub fn time() -> Result<SystemTime, Status> {
        count();
        hostcalls::get_current_time()
    }
    pub fn log(level: LogLevel, msg: &str) {
        count();
        let _ = hostcalls::log(level, msg);
    }
    pub fn shared_get(key: &str) -> Result<(Option<Bytes>, Option<u32>), Status> {
        count();
        hostcalls::get_shared_data(key)
    }
    pub fn shared_set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        count();
        hostcalls::set_shared_data(key, Some(value), cas)
    }
    pub fn define_metric(name: &str) -> u32 {
        count();
        hostcalls::define_metric(MetricType::Counter, name).unwrap_or(0)
    }
    pub fn increment_metric(id: u32, by: i64) {
        count();
        let _ = hostcalls::increment_metric(id, by);
    }
    pub fn tick_period(period: Duration) {
        count();
        let _ = hostcalls::set_tick_period(period);
    }
    pub fn plugin_configuration() -> Option<Bytes> {
        count();
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten()
    }
    pub fn property(path: Vec<&str>) -> Option<Bytes> {
        count();
        hostcalls::get_property(path).ok().flatten()
    }
    /// Every header of a map, in one call, read in place ([`Headers`]).
    pub fn headers(map: MapType) -> Headers {
        count();
        Headers::new(super::raw::header_pairs(map))
    }
    pub fn set_header(map: MapType, name: &str, value: &str) {
        count();
        let _ = hostcalls::set_map_value(map, name, Some(value));
    }
    pub fn send_response(status: u32, headers: Vec<(&str, &str)>, body: Option<&[u8]>) {
        count();
        let _ = hostcalls::send_http_response(status, headers, body);
    }
    pub fn dispatch(cluster: &str, headers: Vec<(&str, &str)>, timeout: Duration) -> bool {
        count();
        hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout).is_ok()
    }
    pub fn call_response_body(size: usize) -> Option<Bytes> {
        count();
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten()
    }
    pub fn resume_request() {
        count();
        let _ = hostcalls::resume_http_request();
    }
}

/// The one ABI function the filter calls itself: `proxy_get_header_map_pairs`, so that the
/// serialized map is read in place (the SDK's `get_map_bytes` copies every name and value
/// into an allocation of its own).
#[allow(unsafe_code)]
mod raw {
    use proxy_wasm::types::MapType;

    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_pairs(map_type: u32, return_data: *mut *mut u8, return_size: *mut usize) -> u32;
    }

    /// The serialized map (empty when the host has none or fails).
    pub fn header_pairs(map: MapType) -> Vec<u8> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the host writes a pointer to `size` bytes it allocated through this module's
        // `proxy_on_memory_allocate` (the SDK's: a boxed `[u8]` of exactly `size` bytes) and
        // hands their ownership over; the SDK's own `get_map` takes them the same way.
        unsafe {
            let status = proxy_get_header_map_pairs(map as u32, &mut data, &mut size);
            if status != 0 || data.is_null() {
                return Vec::new();
            }
            Vec::from_raw_parts(data, size, size)
        }
    }
}

/// Envoy's shared data.
struct Shared;

impl Store for Shared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        match host::shared_get(key) {
            Ok((v, cas)) => (v, cas.unwrap_or(0)),
            Err(_) => (None, 0),
        }
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
        match host::shared_set(key, value, (cas != 0).then_some(cas)) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(true),
            Err(_) => Err(false),
        }
    }
}

fn wall() -> (u64, u64) {
    let d = host::time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).unwrap_or_default();
    (u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), d.as_secs())
}

fn log(level: LogLevel, msg: &str) {
    host::log(level, msg);
}

const METRICS: [&str; 9] = [
    "admitted",
    "rejected",
    "fallbacks",
    "cas_fail_open",
    "keys_fail_open",
    "state_fail_open",
    "cas_mismatches",
    "clock_backwards",
    "host_calls",
];
/// The counters published at once when they change (the first two, admitted and host calls,
/// wait for the next tick: they change on every request).
const EVERY_TICK: [usize; 2] = [0, 8];
/// How often a worker publishes its counters.
const TICK: Duration = Duration::from_secs(1);

fn values(s: &Stats, backwards: u64) -> [u64; 9] {
    [s.admitted, s.rejected, s.fallbacks, s.cas_fail_open, s.keys_fail_open, s.state_fail_open, s.cas_mismatches, backwards, host::calls()]
}

/// What a worker's contexts share.
struct Worker {
    gate: Gate,
    metrics: Vec<u32>,
    published: [u64; 9],
    /// `bench-shadow` builds only: a second gate on the same document over a store in the
    /// VM's memory, run once per request beside the real one (the benchmark's diagnostic).
    #[cfg(feature = "bench-shadow")]
    shadow: Shadow,
}

/// The benchmark's diagnostic (`bench-shadow`): each request also runs the gate's admission
/// and feedback once more, on a store in memory and with no host call, so that Envoy's CPU per
/// request with it, less without it, is what the filter's own work costs inside Envoy's V8 (its
/// caches as cold as a request's) apart from the host calls.
#[cfg(feature = "bench-shadow")]
struct Shadow {
    gate: Gate,
    store: crate::gate::MemoryStore,
}

#[cfg(feature = "bench-shadow")]
impl Shadow {
    fn run(&mut self, wall_ns: u64) {
        let (_, call) = self.gate.admit(&self.store, wall_ns, "shadow", "GET", None);
        if let Some(mut c) = call {
            let r = crate::gate::Response { status: 200, attempts: 1, ..Default::default() };
            self.gate.complete(&self.store, wall_ns, &mut c, &r, wall_ns / 1_000_000_000);
        }
    }
}

impl Worker {
    /// Add what the counters gained since the last publication to Envoy's metrics: all of them
    /// on a tick, else only the rare ones (a rejection, a fault), so that a request that only
    /// passes costs no metric call.
    fn publish(&mut self, tick: bool) {
        let now = values(&self.gate.stats, self.gate.clock.backwards);
        let rare = now.iter().zip(self.published.iter()).enumerate().any(|(i, (n, o))| n != o && !EVERY_TICK.contains(&i));
        if !tick && !rare {
            return;
        }
        for ((id, new), old) in self.metrics.iter().zip(now.iter()).zip(self.published.iter_mut()) {
            if *new > *old {
                host::increment_metric(*id, (*new - *old) as i64);
                *old = *new;
            }
        }
        // The metric calls just made count on the next publication.
    }
}

#[derive(Default)]
pub(crate) struct Root {
    worker: Option<Rc<RefCell<Worker>>>,
    /// `role: upstream`: a cluster's upstream filter, which only marks overloaded attempts.
    upstream: bool,
}

/// This worker's number among the VM's workers: a shared counter, taken with CAS.
fn worker_number() -> u64 {
    let store = Shared;
    for _ in 0..64 {
        let (v, cas) = store.get("levee:#workers");
        let n = v.and_then(|b| std::str::from_utf8(&b).ok().and_then(|s| s.parse::<u64>().ok())).unwrap_or(0) + 1;
        if store.set("levee:#workers", n.to_string().as_bytes(), cas).is_ok() {
            return n;
        }
    }
    // Unique enough: the wall clock's low bits (call ids only need to differ across workers).
    wall().0 & 0xFF_FFFF
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t,
            Err(_) => {
                log(LogLevel::Error, "levee: the plugin configuration is not UTF-8");
                return false;
            }
        };
        match config::parse_plugin(text) {
            Ok(config::Plugin::Upstream) => {
                self.upstream = true;
                log(LogLevel::Info, "levee: upstream role: overloaded attempts are marked x-envoy-ratelimited (never retried)");
                true
            }
            Ok(config::Plugin::Downstream(cfg)) => {
                let cfg = *cfg;
                let info = cfg.engine.policy_info(cfg.policy);
                // What the router cannot do as the policy says (hedging, backoff kinds, ...).
                if let Some(p) = cfg.engine.policy(cfg.policy) {
                    for n in crate::envoy::notes(p) {
                        log(LogLevel::Warn, &format!("levee: policy `{}`: {n}", p.name));
                    }
                }
                let metrics = METRICS.iter().map(|m| host::define_metric(&format!("levee.{m}"))).collect();
                #[cfg(feature = "bench-shadow")]
                let shadow = match config::parse(text) {
                    Ok(c) => Shadow { gate: Gate::new(c, 0), store: Default::default() },
                    Err(_) => return false,
                };
                let gate = Gate::new(cfg, worker_number());
                self.worker = Some(Rc::new(RefCell::new(Worker {
                    gate,
                    metrics,
                    published: [0; 9],
                    #[cfg(feature = "bench-shadow")]
                    shadow,
                })));
                host::tick_period(TICK);
                log(LogLevel::Info, &format!("levee: policy `{}` loaded", info.map(|i| i.name).unwrap_or_default()));
                true
            }
            Err(errors) => {
                for e in &errors {
                    let path = if e.path.is_empty() { "(document)" } else { &e.path };
                    log(LogLevel::Error, &format!("levee: configuration: {path}: {}", e.message));
                }
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(w) = &self.worker {
            w.borrow_mut().publish(true);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        if self.upstream {
            return Some(Box::new(Attempt));
        }
        let worker = self.worker.clone()?;
        Some(Box::new(Request { worker, call: None, local: false, path: None, authority: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One attempt, seen by the filter in its upstream role.
struct Attempt;

impl Context for Attempt {}

impl HttpContext for Attempt {
    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some((name, value)) = crate::envoy::attempt_response_marks(&host::headers(MapType::HttpResponseHeaders)) {
            host::set_header(MapType::HttpResponseHeaders, name, value);
        }
        Action::Continue
    }
}

struct Request {
    worker: Rc<RefCell<Worker>>,
    call: Option<Call>,
    /// The filter answered this request itself; its own reply passes back through the filter.
    local: bool,
    /// The request's `:path` and `:authority`, kept for a fallback cluster call.
    path: Option<String>,
    authority: Option<String>,
}

fn text(v: &[u8]) -> &str {
    std::str::from_utf8(v).unwrap_or_default()
}

impl Request {
    fn reply(&mut self, r: &Reply) {
        self.local = true;
        let headers: Vec<(&str, &str)> = r.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        host::send_response(u32::from(r.status), headers, Some(r.body.as_bytes()));
    }

    fn dispatch(&mut self, cluster: &str, authority: Option<&str>, timeout_ms: u64) -> bool {
        let path = self.path.as_deref().unwrap_or("/");
        let authority = authority.or(self.authority.as_deref()).unwrap_or_default();
        let headers = vec![(":method", "GET"), (":path", path), (":authority", authority)];
        host::dispatch(cluster, headers, Duration::from_millis(timeout_ms))
    }

    /// Do what the gate answered; the action for the filter chain.
    fn act(&mut self, a: Admit) -> Action {
        match a {
            Admit::Forward(headers) => {
                for (k, v) in &headers {
                    host::set_header(MapType::HttpRequestHeaders, k, v);
                }
                Action::Continue
            }
            Admit::Reply(r) => {
                self.reply(&r);
                Action::Pause
            }
            Admit::Dispatch { cluster, authority, timeout_ms } => {
                if self.dispatch(&cluster, authority.as_deref(), timeout_ms) {
                    return Action::Pause;
                }
                let (wall_ns, _) = wall();
                let next = match self.call.as_mut() {
                    Some(call) => self.worker.borrow_mut().gate.fallback_result(call, wall_ns, None),
                    None => return Action::Continue,
                };
                self.act(next)
            }
            Admit::FailOpen(fault) => {
                log(LogLevel::Warn, &format!("levee: failing open ({fault:?})"));
                Action::Continue
            }
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let response = host::headers(MapType::HttpCallResponseHeaders);
        let status = response.get(":status").and_then(|v| v.parse::<u16>().ok());
        let (wall_ns, _) = wall();
        let Some(mut call) = self.call.take() else { return };
        let next = self.worker.borrow_mut().gate.fallback_result(&mut call, wall_ns, status);
        self.call = Some(call);
        match next {
            Admit::Forward(_) => {
                let body = host::call_response_body(body_size).unwrap_or_default();
                let mut headers: Vec<(&str, &str)> =
                    response.iter().filter(|(k, _)| !k.starts_with(b":")).map(|(k, v)| (text(k), text(v))).collect();
                headers.push(("x-levee-fallback", "cluster"));
                self.local = true;
                host::send_response(u32::from(status.unwrap_or(200)), headers, Some(&body));
            }
            other => {
                if self.act(other) == Action::Continue {
                    host::resume_request();
                }
            }
        }
        self.worker.borrow_mut().publish(false);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Every header in one host call: cheaper than one call per header the filter reads.
        let headers = host::headers(MapType::HttpRequestHeaders);
        let get = |name: &str| headers.get(name);
        #[cfg(feature = "test-trap")]
        if get("x-levee-test-trap").is_some() {
            #[allow(clippy::panic)]
            {
                panic!("levee: trap asked for by x-levee-test-trap (test build)");
            }
        }
        let by_cluster = matches!(self.worker.borrow().gate.config().key, KeySource::Cluster);
        let key = if by_cluster {
            // The route's cluster: it depends on the route, which only Envoy knows at this point.
            host::property(vec!["xds", "cluster_name"]).and_then(|b| String::from_utf8(b).ok()).unwrap_or_default()
        } else {
            let w = self.worker.borrow();
            match &w.gate.config().key {
                KeySource::Header(h) => get(h).unwrap_or_default().to_string(),
                KeySource::Cluster => String::new(),
            }
        };
        let method = get(":method").unwrap_or_default();
        let app = get(HEADER_ATTEMPT).and_then(|v| v.trim().parse::<u32>().ok());
        let (wall_ns, _) = wall();
        let (admit, call) = self.worker.borrow_mut().gate.admit(&Shared, wall_ns, &key, method, app);
        #[cfg(feature = "bench-shadow")]
        self.worker.borrow_mut().shadow.run(wall_ns);
        if matches!(admit, Admit::Dispatch { .. }) {
            self.path = get(":path").map(str::to_string);
            self.authority = get(":authority").map(str::to_string);
        }
        self.call = call;
        let action = self.act(admit);
        self.worker.borrow_mut().publish(false);
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.local {
            return Action::Continue;
        }
        let Some(mut call) = self.call.take() else { return Action::Continue };
        if call.is_done() {
            self.call = Some(call);
            return Action::Continue;
        }
        let headers = host::headers(MapType::HttpResponseHeaders);
        let get = |name: &str| headers.get(name);
        let status = get(":status").and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
        let attempts = get("x-envoy-attempt-count").and_then(|s| s.parse::<u32>().ok()).unwrap_or(1);
        let retry_after = get("retry-after").unwrap_or_default();
        let overloaded = get("x-envoy-overloaded").is_some();
        let (wall_ns, wall_secs) = wall();
        let r = Response { status, attempts, retry_after, overloaded };
        let next = self.worker.borrow_mut().gate.complete(&Shared, wall_ns, &mut call, &r, wall_secs);
        self.call = Some(call);
        let action = match next {
            Some(a) => self.act(a),
            None => Action::Continue,
        };
        self.worker.borrow_mut().publish(false);
        action
    }

    fn on_log(&mut self) {
        // Nothing to release (the usual case): no host call.
        if let Some(mut call) = self.call.take().filter(|c| !c.is_done()) {
            let (wall_ns, _) = wall();
            let mut w = self.worker.borrow_mut();
            w.gate.abandon(&Shared, wall_ns, &mut call);
            w.publish(false);
        }
    }
}
