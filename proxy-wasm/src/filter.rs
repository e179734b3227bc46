//! The proxy-wasm glue: Envoy's contexts around a [`Gate`]. It decides nothing: it reads
//! headers, hands them to the gate, and does what the gate answers.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, Status};

use crate::config::{self, KeySource};
use crate::gate::{Admit, Call, Gate, Reply, Response, Stats, Store, HEADER_ATTEMPT};

#[allow(unsafe_code)] // the ABI's exported entry point (`#[no_mangle] _initialize`)
mod entry {
    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(super::Root::default()) });
    }}
}

/// Envoy's shared data.
struct Shared;

impl Store for Shared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        match hostcalls::get_shared_data(key) {
            Ok((v, cas)) => (v, cas.unwrap_or(0)),
            Err(_) => (None, 0),
        }
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
        match hostcalls::set_shared_data(key, Some(value), (cas != 0).then_some(cas)) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(true),
            Err(_) => Err(false),
        }
    }
}

fn wall() -> (u64, u64) {
    let d = hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).unwrap_or_default();
    (u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), d.as_secs())
}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

const METRICS: [&str; 8] =
    ["admitted", "rejected", "fallbacks", "cas_fail_open", "keys_fail_open", "state_fail_open", "cas_mismatches", "clock_backwards"];

fn values(s: &Stats, backwards: u64) -> [u64; 8] {
    [s.admitted, s.rejected, s.fallbacks, s.cas_fail_open, s.keys_fail_open, s.state_fail_open, s.cas_mismatches, backwards]
}

/// What a worker's contexts share.
struct Worker {
    gate: Gate,
    metrics: Vec<u32>,
    published: [u64; 8],
}

impl Worker {
    /// Add what the counters gained since the last publication to Envoy's metrics.
    fn publish(&mut self) {
        let now = values(&self.gate.stats, self.gate.clock.backwards);
        for ((id, new), old) in self.metrics.iter().zip(now.iter()).zip(self.published.iter()) {
            if new > old {
                let _ = hostcalls::increment_metric(*id, (new - old) as i64);
            }
        }
        self.published = now;
    }
}

#[derive(Default)]
pub(crate) struct Root {
    worker: Option<Rc<RefCell<Worker>>>,
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
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t,
            Err(_) => {
                log(LogLevel::Error, "levee: the plugin configuration is not UTF-8");
                return false;
            }
        };
        match config::parse(text) {
            Ok(cfg) => {
                let info = cfg.engine.policy_info(cfg.policy);
                let metrics =
                    METRICS.iter().map(|m| hostcalls::define_metric(MetricType::Counter, &format!("levee.{m}")).unwrap_or(0)).collect();
                let gate = Gate::new(cfg, worker_number());
                self.worker = Some(Rc::new(RefCell::new(Worker { gate, metrics, published: [0; 8] })));
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

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.clone()?;
        Some(Box::new(Request { worker, call: None, local: false }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    worker: Rc<RefCell<Worker>>,
    call: Option<Call>,
    /// The filter answered this request itself; its own reply passes back through the filter.
    local: bool,
}

impl Request {
    fn reply(&mut self, r: &Reply) {
        self.local = true;
        let headers: Vec<(&str, &str)> = r.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.send_http_response(u32::from(r.status), headers, Some(r.body.as_bytes()));
    }

    fn dispatch(&mut self, cluster: &str, authority: Option<&str>, timeout_ms: u64) -> bool {
        let path = self.get_http_request_header(":path").unwrap_or_else(|| "/".into());
        let own = self.get_http_request_header(":authority").unwrap_or_default();
        let authority = authority.unwrap_or(&own).to_string();
        let headers = vec![(":method", "GET"), (":path", path.as_str()), (":authority", authority.as_str())];
        self.dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(timeout_ms)).is_ok()
    }

    /// Do what the gate answered; the action for the filter chain.
    fn act(&mut self, a: Admit) -> Action {
        match a {
            Admit::Forward(headers) => {
                for (k, v) in &headers {
                    self.set_http_request_header(k, Some(v));
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
        let status = self.get_http_call_response_header(":status").and_then(|s| s.parse::<u16>().ok());
        let (wall_ns, _) = wall();
        let Some(mut call) = self.call.take() else { return };
        let next = self.worker.borrow_mut().gate.fallback_result(&mut call, wall_ns, status);
        self.call = Some(call);
        match next {
            Admit::Forward(_) => {
                let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
                let kept: Vec<(String, String)> =
                    self.get_http_call_response_headers().into_iter().filter(|(k, _)| !k.starts_with(':')).collect();
                let mut headers: Vec<(&str, &str)> = kept.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                headers.push(("x-levee-fallback", "cluster"));
                self.local = true;
                self.send_http_response(u32::from(status.unwrap_or(200)), headers, Some(&body));
            }
            other => {
                if self.act(other) == Action::Continue {
                    self.resume_http_request();
                }
            }
        }
        self.worker.borrow_mut().publish();
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        #[cfg(feature = "test-trap")]
        if self.get_http_request_header("x-levee-test-trap").is_some() {
            #[allow(clippy::panic)]
            {
                panic!("levee: trap asked for by x-levee-test-trap (test build)");
            }
        }
        let key_source = self.worker.borrow().gate.config().key.clone();
        let key = match key_source {
            KeySource::Cluster => {
                self.get_property(vec!["xds", "cluster_name"]).and_then(|b| String::from_utf8(b).ok()).unwrap_or_default()
            }
            KeySource::Header(h) => self.get_http_request_header(&h).unwrap_or_default(),
        };
        let method = self.get_http_request_header(":method").unwrap_or_default();
        let app = self.get_http_request_header(HEADER_ATTEMPT).and_then(|v| v.trim().parse::<u32>().ok());
        let (wall_ns, _) = wall();
        let (admit, call) = self.worker.borrow_mut().gate.admit(&Shared, wall_ns, &key, &method, app);
        self.call = call;
        let action = self.act(admit);
        self.worker.borrow_mut().publish();
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.local {
            return Action::Continue;
        }
        let Some(mut call) = self.call.take() else { return Action::Continue };
        let status = self.get_http_response_header(":status").and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
        let attempts = self.get_http_response_header("x-envoy-attempt-count").and_then(|s| s.parse::<u32>().ok()).unwrap_or(1);
        let retry_after = self.get_http_response_header("retry-after").unwrap_or_default();
        let overloaded = self.get_http_response_header("x-envoy-overloaded").is_some();
        let (wall_ns, wall_secs) = wall();
        let r = Response { status, attempts, retry_after: &retry_after, overloaded };
        let next = self.worker.borrow_mut().gate.complete(&Shared, wall_ns, &mut call, &r, wall_secs);
        self.call = Some(call);
        let action = match next {
            Some(a) => self.act(a),
            None => Action::Continue,
        };
        self.worker.borrow_mut().publish();
        action
    }

    fn on_log(&mut self) {
        if let Some(mut call) = self.call.take() {
            let (wall_ns, _) = wall();
            let mut w = self.worker.borrow_mut();
            w.gate.abandon(&Shared, wall_ns, &mut call);
            w.publish();
        }
    }
}
