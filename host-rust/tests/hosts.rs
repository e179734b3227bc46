//! The host scenarios (`conformance/hosts/*.json`, format in conformance/hosts/README.md),
//! replayed through the public API under tokio's paused time: the call builder
//! (`Levee::call(..).run`) for `call` scenarios and the tower `LeveeLayer` over an in-process
//! service for `http` ones. Every observable field of `expect` is compared exactly. In a
//! hedged call (`hedge: true`) an attempt whose future the host drops before it completes, and
//! not at its own timeout, is `cancelled`; a step that `unwind`s hands the attempt's
//! `AttemptLease` to a task that drops it that long after, when the attempt is `closed` (and
//! the host reports it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, clippy::print_stdout)]

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use levee::core::{HedgeCommand, Verdict};
use levee::layer::{LeveeLayer, OneShot};
use levee::telemetry::{Attributes, Telemetry, Value};
use levee::time::{Clock, Sleep, TokioClock};
use levee::{Attempted, ErrorClass, FaultOp, IntoOutcome, Levee, LeveeError, Outcome};
use serde_json::{json, Map, Value as Json};
use tower::{Layer, Service, ServiceExt};

/// Scenarios this host does not pass yet, each with the reason (the test fails when one of
/// them starts passing, so the list stays true).
const KNOWN: &[(&str, &str)] = &[];

/// What one call observed.
#[derive(Default)]
struct Record {
    attempts: Vec<Json>,
    requests: Vec<Json>,
    sleeps: Vec<u64>,
    fallbacks: Vec<String>,
    events: Vec<Json>,
    metrics: BTreeMap<String, Json>,
    on_retry: Vec<Json>,
    retry_if: Vec<Json>,
    problems: Vec<String>,
}

type Rec = Arc<Mutex<Record>>;

tokio::task_local! {
    static CURRENT: Rec;
}

fn with_rec(f: impl FnOnce(&mut Record)) {
    let _ = CURRENT.try_with(|r| f(&mut r.lock().unwrap()));
}

fn to_json(v: &Value<'_>) -> Json {
    match v {
        Value::Str(s) => json!(s),
        Value::Int(i) => json!(i),
        Value::Float(x) => json!(x),
        Value::Bool(b) => json!(b),
    }
}

fn metric_key(name: &str, attributes: &Attributes<'_>) -> String {
    let mut attrs: Vec<String> = attributes.iter().map(|(n, v)| format!("{n}={v}")).collect();
    attrs.sort();
    format!("{name}{{{}}}", attrs.join(","))
}

/// The recording sink: everything goes to the record of the call whose task emits it.
struct Recorder;

impl Telemetry for Recorder {
    fn event(&self, name: &str, attributes: &Attributes<'_>) {
        let mut m = Map::new();
        m.insert("name".into(), json!(name));
        for (n, v) in attributes {
            if !matches!(*n, "levee.policy" | "levee.key" | "levee.call") {
                m.insert((*n).into(), to_json(v));
            }
        }
        with_rec(|r| r.events.push(Json::Object(m)));
    }
    fn add(&self, counter: &'static str, value: u64, attributes: &Attributes<'_>) {
        let key = metric_key(counter, attributes);
        with_rec(|r| {
            let e = r.metrics.entry(key).or_insert(json!(0));
            *e = json!(e.as_u64().unwrap_or(0) + value);
        });
    }
    fn record(&self, histogram: &'static str, value: f64, attributes: &Attributes<'_>) {
        let key = metric_key(histogram, attributes);
        with_rec(|r| {
            let e = r.metrics.entry(key).or_insert(json!({"count": 0, "sum": 0.0}));
            let count = e["count"].as_u64().unwrap_or(0) + 1;
            let sum = e["sum"].as_f64().unwrap_or(0.0) + value;
            *e = json!({"count": count, "sum": sum});
        });
    }
    fn gauge(&self, _gauge: &'static str, _value: f64, _attributes: &Attributes<'_>) {
        // Scenarios pin counters and histograms; the gauge is the breaker state they already pin.
    }
}

/// tokio's paused clock, with the scenario's wall clock for HTTP-date `Retry-After`.
struct ScenarioClock {
    tokio: TokioClock,
    wall_start: u64,
}

impl Clock for ScenarioClock {
    fn now(&self) -> u64 {
        self.tokio.now()
    }
    fn sleep_until(&self, at: u64) -> Sleep {
        self.tokio.sleep_until(at)
    }
    fn unix_seconds(&self) -> u64 {
        self.wall_start + self.tokio.now() / 1_000_000_000
    }
}

/// The dependency's errors.
#[derive(Debug, Clone)]
enum DepError {
    Class(String),
    Refused,
    ConnectTimeout,
    TlsCertificate,
}

impl std::fmt::Display for DepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::error::Error for DepError {}

impl ErrorClass for DepError {
    fn class(&self) -> Cow<'static, str> {
        match self {
            DepError::Class(c) => Cow::Owned(c.clone()),
            _ => Cow::Borrowed("DepError"),
        }
    }
}

impl IntoOutcome for DepError {
    fn outcome(&self) -> Outcome {
        match self {
            DepError::Class(_) => levee::outcome::class_outcome(self),
            // What the HTTP integrations make of a refused connection and a connect timeout.
            DepError::Refused | DepError::ConnectTimeout => Outcome::ConnectionError,
            DepError::TlsCertificate => Outcome::error(levee::constants::HTTP_TLS_CERTIFICATE_CLASS),
        }
    }
}

fn ns_since(t0: tokio::time::Instant) -> u64 {
    tokio::time::Instant::now().duration_since(t0).as_nanos() as u64
}

/// Records the end of an attempt when the host stops waiting for it (completion, timeout,
/// cancel: the future is dropped). In a hedged call, an attempt dropped before it completed,
/// and not by its own timeout, was cancelled; one whose step `unwind`s keeps its lease that
/// long (a task that closes its connection), and records when it closed.
struct EndOnDrop {
    rec: Rec,
    index: usize,
    t0: tokio::time::Instant,
    hedge: bool,
    at: u64,
    timeout: Option<u64>,
    completed: bool,
    unwind: Option<(u64, levee::AttemptLease)>,
    unwinding: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        let end = ns_since(self.t0);
        let timed_out = self.timeout.is_some_and(|t| end >= self.at + t);
        let cancelled = self.hedge && !self.completed && !timed_out;
        if let Some(a) = self.rec.lock().unwrap().attempts.get_mut(self.index) {
            a["end"] = json!(end);
            if cancelled {
                a["cancelled"] = json!(true);
            }
        }
        if let (true, Some((unwind, lease))) = (cancelled, self.unwind.take()) {
            let (rec, index, t0) = (self.rec.clone(), self.index, self.t0);
            self.unwinding.lock().unwrap().push(tokio::spawn(async move {
                sleep_exact(unwind).await;
                if let Some(a) = rec.lock().unwrap().attempts.get_mut(index) {
                    a["closed"] = json!(ns_since(t0));
                }
                drop(lease);
            }));
        }
    }
}

/// The scripted dependency: one step per attempt.
struct Script {
    steps: Vec<Json>,
    next: Mutex<usize>,
    rec: Rec,
    t0: tokio::time::Instant,
    /// The call hedges: attempts overlap and may be cancelled.
    hedge: bool,
    /// The tasks of cancelled attempts still unwinding.
    unwinding: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Script {
    fn new(call: &Json, rec: &Rec, t0: tokio::time::Instant) -> Self {
        Script {
            steps: call["script"].as_array().cloned().unwrap_or_default(),
            next: Mutex::new(0),
            rec: rec.clone(),
            t0,
            hedge: call.get("hedge") == Some(&json!(true)),
            unwinding: Arc::default(),
        }
    }

    /// Begin the next attempt, `attempt`: its step and the guard that records its end.
    fn begin(&self, attempt: &levee::Attempt) -> Option<(Json, EndOnDrop)> {
        let degraded = attempt.degraded;
        let mut next = self.next.lock().unwrap();
        let step = self.steps.get(*next).cloned();
        *next += 1;
        let mut rec = self.rec.lock().unwrap();
        let Some(step) = step else {
            rec.problems.push(format!("attempt {} asked for, the script has {}", *next, self.steps.len()));
            return None;
        };
        let at = ns_since(self.t0);
        let mut a = json!({"at": at, "end": at});
        if degraded {
            a["degraded"] = json!(true);
        }
        rec.attempts.push(a);
        let unwind = step.get("unwind").and_then(Json::as_u64).zip(attempt.lease());
        let end = EndOnDrop {
            rec: self.rec.clone(),
            index: rec.attempts.len() - 1,
            t0: self.t0,
            hedge: self.hedge,
            at,
            timeout: attempt.timeout.map(|t| t.as_nanos() as u64),
            completed: false,
            unwind,
            unwinding: self.unwinding.clone(),
        };
        Some((step, end))
    }
}

/// Sleep `ns` on the scenario's clock, exactly (tokio's own timers end on milliseconds).
async fn sleep_exact(ns: u64) {
    if ns > 0 {
        let clock = TokioClock::paused();
        clock.sleep_until(ns).await;
    }
}

/// Sleep until `at` ns after `t0`, exactly.
async fn sleep_until_exact(t0: tokio::time::Instant, at: u64) {
    sleep_exact(at.saturating_sub(ns_since(t0))).await;
}

/// Play a step: wait as it says, then its result.
async fn play(step: &Json) -> Result<Json, DepError> {
    if step.get("hang").is_some() {
        std::future::pending::<()>().await;
    }
    if let Some(late) = step.get("late").and_then(Json::as_u64) {
        sleep_exact(late).await;
    } else if let Some(after) = step.get("after").and_then(Json::as_u64) {
        sleep_exact(after).await;
    }
    if let Some(c) = step.get("raise").and_then(Json::as_str) {
        return Err(DepError::Class(c.to_string()));
    }
    if step.get("refuse").is_some() {
        return Err(DepError::Refused);
    }
    if step.get("connect_timeout").is_some() {
        return Err(DepError::ConnectTimeout);
    }
    if step.get("tls_certificate").is_some() {
        return Err(DepError::TlsCertificate);
    }
    Ok(step.get("return").cloned().unwrap_or(Json::Null))
}

fn cause_name(o: Option<&Outcome>) -> Json {
    match o {
        Some(Outcome::Timeout) => json!("timeout"),
        Some(Outcome::ConnectionError) => json!("connection-error"),
        Some(Outcome::Http { status, .. }) => json!(format!("http:{status}")),
        Some(Outcome::Error(c)) => json!(format!("error:{c}")),
        _ => Json::Null,
    }
}

fn error_result<E: IntoOutcome>(e: &LeveeError<E>) -> Json {
    if e.fault.is_some() && e.reason == levee::core::Reason::None {
        // The recovery path ended with the user's own error.
        let name = match e.last.as_ref().map(IntoOutcome::outcome) {
            Some(Outcome::Error(c)) => c.to_string(),
            Some(Outcome::Timeout) | None => "timeout".to_string(),
            Some(o) => cause_name(Some(&o)).as_str().unwrap_or("").to_string(),
        };
        return json!({"raised": name});
    }
    let last = cause_name(e.outcome.as_ref().or(e.last.as_ref().map(IntoOutcome::outcome).as_ref()));
    json!({"error": {"reason": e.reason.name(), "attempts": e.attempts, "last": last}})
}

fn hex(v: &str) -> u64 {
    u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap()
}

/// A hedged call's faults: `(op, nth, None)` a trap, `Some(commands)` the answer instead.
fn hedge_faults_of(call: &Json) -> Vec<(FaultOp, u32, Option<Vec<HedgeCommand>>)> {
    let mut out = Vec::new();
    for f in call.get("faults").and_then(Json::as_array).into_iter().flatten() {
        let op = match f["op"].as_str().unwrap_or("") {
            "hedge-step" => FaultOp::HedgeStep,
            "report-attempt" => FaultOp::ReportAttempt,
            _ => continue,
        };
        let nth = f["nth"].as_u64().unwrap_or(1) as u32;
        let commands = f.get("commands").and_then(Json::as_array).map(|cs| {
            cs.iter()
                .map(|c| {
                    let n = |v: &Json| v.as_u64().unwrap();
                    if let Some(s) = c.get("start") {
                        HedgeCommand::Start { attempt: n(&s["attempt"]) as u32, timeout: n(&s["timeout"]) }
                    } else if let Some(a) = c.get("cancel") {
                        HedgeCommand::Cancel { attempt: n(a) as u32 }
                    } else if let Some(d) = c.get("wait") {
                        HedgeCommand::Wait { delay: n(d) }
                    } else {
                        let e = &c["end"];
                        HedgeCommand::End { attempt: n(&e["attempt"]) as u32, verdict: Verdict(hex(e["verdict"].as_str().unwrap())) }
                    }
                })
                .collect()
        });
        out.push((op, nth, commands));
    }
    out
}

fn faults_of(call: &Json) -> Vec<(FaultOp, u32, Option<u64>)> {
    let mut out = Vec::new();
    for f in call.get("faults").and_then(Json::as_array).into_iter().flatten() {
        let op = match f["op"].as_str().unwrap_or("") {
            "start" => FaultOp::Start,
            "acquire" => FaultOp::Acquire,
            "report" => FaultOp::Report,
            "report-fallback" => FaultOp::ReportFallback,
            _ => continue,
        };
        let nth = f["nth"].as_u64().unwrap_or(1) as u32;
        let verdict = f.get("verdict").and_then(Json::as_str).map(hex);
        out.push((op, nth, verdict));
    }
    out
}

/// A scripted retry predicate (conformance/hosts/README.md, `retry_if`): its answers in order,
/// `null` past the end; `"raise"` panics with `PredicateBroke` (the host counts it as `null`).
/// Each call is recorded with what it was given.
fn scripted_predicate(answers: &Json, by: &'static str) -> impl Fn(&Attempted<'_>) -> Option<bool> + Send + Sync + 'static {
    let answers: Mutex<std::collections::VecDeque<Json>> = Mutex::new(answers.as_array().cloned().unwrap_or_default().into());
    move |a: &Attempted<'_>| {
        let seen = if let Some(v) = a.value::<Json>() {
            json!({"by": by, "value": v})
        } else if let Some(r) = a.value::<HttpResponse>() {
            json!({"by": by, "status": r.status().as_u16()})
        } else {
            json!({"by": by, "error": cause_name(Some(a.outcome()))})
        };
        with_rec(|r| r.retry_if.push(seen));
        match answers.lock().unwrap().pop_front().unwrap_or(Json::Null) {
            Json::Bool(b) => Some(b),
            Json::String(s) if s == "raise" => std::panic::panic_any("PredicateBroke"),
            _ => None,
        }
    }
}

async fn run_call(levee: Levee, call: Json, rec: Rec, t0: tokio::time::Instant, script: Arc<Script>) -> Json {
    let _ = rec;
    let policy = call["policy"].as_str().unwrap_or("").to_string();
    let mut c = levee.call::<Json, DepError>(&policy).key(call.get("key").and_then(Json::as_str).unwrap_or(""));
    if call.get("idempotent") == Some(&json!(false)) {
        c = c.non_idempotent();
    }
    if call.get("idempotency_key").is_some_and(|k| !k.is_null()) {
        c = c.idempotency_key();
    }
    for (op, nth, verdict) in faults_of(&call) {
        c = c.fault(op, nth, verdict);
    }
    for (op, nth, commands) in hedge_faults_of(&call) {
        c = c.hedge_fault(op, nth, commands);
    }
    let _ = t0;
    if let Some(answers) = call.get("retry_if") {
        c = c.retry_if(scripted_predicate(answers, "call"));
    }
    for (name, spec) in call.get("fallbacks").and_then(Json::as_object).into_iter().flatten() {
        let (n, spec) = (name.clone(), spec.clone());
        c = c.fallback(name, move |_ctx| {
            let (n, spec) = (n.clone(), spec.clone());
            async move {
                with_rec(|r| r.fallbacks.push(n));
                match spec.get("raise").and_then(Json::as_str) {
                    Some(cls) => Err(DepError::Class(cls.to_string())),
                    None => Ok(spec.get("return").cloned().unwrap_or(Json::Null)),
                }
            }
        });
    }
    let r = c
        .run(move |attempt| {
            let script = script.clone();
            async move {
                let Some((step, mut end)) = script.begin(&attempt) else { return Err(DepError::Class("NoMoreSteps".into())) };
                let r = play(&step).await;
                end.completed = true;
                r
            }
        })
        .await;
    match r {
        Ok(v) => json!({"value": v}),
        Err(e) => error_result(&e),
    }
}

type HttpResponse = http::Response<String>;

async fn run_http(levee: Levee, call: Json, rec: Rec, t0: tokio::time::Instant, script: Arc<Script>) -> Json {
    let _ = (rec, t0);
    let spec = &call["http"];
    let policy = call["policy"].as_str().unwrap_or("");
    for (name, f) in call.get("fallbacks").and_then(Json::as_object).into_iter().flatten() {
        let (n, f) = (name.clone(), f.clone());
        levee.register_fallback::<HttpResponse, DepError, _, _>(name, move |_ctx| {
            let (n, f) = (n.clone(), f.clone());
            async move {
                with_rec(|r| r.fallbacks.push(n));
                match f.get("raise").and_then(Json::as_str) {
                    Some(cls) => Err(DepError::Class(cls.to_string())),
                    None => {
                        let status = f["return"]["status"].as_u64().unwrap_or(200) as u16;
                        Ok(http::Response::builder().status(status).body(String::new()).unwrap())
                    }
                }
            }
        });
    }
    let mut layer = match LeveeLayer::new(levee.clone(), policy) {
        Ok(l) => l,
        Err(e) => return json!({"error": e.to_string()}),
    };
    if let Some(answers) = call.get("retry_if") {
        layer = layer.retry_if(scripted_predicate(answers, "call"));
    }
    let svc = tower::service_fn(move |req: http::Request<String>| {
        let script = script.clone();
        async move {
            let mut seen = Map::new();
            for h in ["x-levee-attempt", "idempotency-key", "x-idempotency-key"] {
                if let Some(v) = req.headers().get(h) {
                    seen.insert(h.into(), json!(v.to_str().unwrap_or("")));
                }
            }
            let attempt = *req.extensions().get::<levee::Attempt>().unwrap();
            with_rec(|r| r.requests.push(Json::Object(seen)));
            let Some((step, mut end)) = script.begin(&attempt) else { return Err(DepError::Class("NoMoreSteps".into())) };
            let status = step.get("status").and_then(Json::as_u64);
            let headers = step.get("headers").cloned();
            let played = play(&step).await;
            end.completed = true;
            played?;
            let mut b = http::Response::builder().status(status.unwrap_or(200) as u16);
            for (n, v) in headers.as_ref().and_then(Json::as_object).into_iter().flatten() {
                b = b.header(n.as_str(), v.as_str().unwrap_or(""));
            }
            Ok::<_, DepError>(b.body(String::new()).unwrap())
        }
    });
    let mut service = layer.layer(svc);
    let method = http::Method::from_bytes(spec["method"].as_str().unwrap_or("GET").as_bytes()).unwrap();
    let mut req = http::Request::builder().method(method).uri(spec["url"].as_str().unwrap_or(""));
    for (n, v) in spec.get("headers").and_then(Json::as_object).into_iter().flatten() {
        req = req.header(n.as_str(), v.as_str().unwrap_or(""));
    }
    let mut req = req.body(String::new()).unwrap();
    if spec.get("body").and_then(Json::as_str) == Some("stream") {
        req.extensions_mut().insert(OneShot);
    }
    req.extensions_mut().insert(levee::FaultPlan(faults_of(&call)));
    let r = match service.ready().await {
        Ok(s) => s.call(req).await,
        Err(e) => Err(e),
    };
    match r {
        Ok(resp) => json!({"status": resp.status().as_u16()}),
        Err(e) => error_result(&e),
    }
}

/// JSON equality with numbers compared as f64 (sums of seconds).
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) => (x.as_f64().unwrap_or(f64::NAN) - y.as_f64().unwrap_or(f64::NAN)).abs() < 1e-9,
        (Json::Array(x), Json::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q)),
        (Json::Object(x), Json::Object(y)) => x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w))),
        _ => a == b,
    }
}

async fn replay(scenario: &Json) -> Vec<String> {
    let t0 = tokio::time::Instant::now();
    let clock = ScenarioClock { tokio: TokioClock::paused(), wall_start: scenario["wall_start"].as_u64().unwrap_or(0) };
    let mut builder = Levee::builder();
    for (policy, answers) in scenario.get("retry_if_policy").and_then(Json::as_object).into_iter().flatten() {
        builder = builder.retry_if(policy, scripted_predicate(answers, "policy"));
    }
    let levee = builder
        .seed(scenario["seed"].as_u64().unwrap_or(0))
        .clock(clock)
        .telemetry(Recorder)
        .on_retry(|info| {
            let error = match info.outcome {
                Outcome::Http { .. } | Outcome::Success => Json::Null,
                o => cause_name(Some(o)),
            };
            with_rec(|r| r.on_retry.push(json!({"attempt": info.attempt, "delay": info.delay.as_secs_f64(), "error": error})));
        })
        .trace(|step| {
            if let Some(d) = step.sleep {
                with_rec(|r| r.sleeps.push(d.as_nanos() as u64));
            }
        })
        .load(scenario["document"].as_str().unwrap_or(""));
    let levee = match levee {
        Ok(l) => l,
        Err(e) => return vec![format!("did not load: {e}")],
    };
    let calls = scenario["calls"].as_array().cloned().unwrap_or_default();
    let mut tasks = Vec::new();
    for call in calls.iter().cloned() {
        let rec: Rec = Arc::default();
        let levee = levee.clone();
        let r2 = rec.clone();
        let task = tokio::spawn(CURRENT.scope(rec.clone(), async move {
            sleep_until_exact(t0, call["at"].as_u64().unwrap_or(0)).await;
            let script = Arc::new(Script::new(&call, &r2, t0));
            let run = async {
                if call["api"] == "http" {
                    run_http(levee, call.clone(), r2, t0, script.clone()).await
                } else {
                    run_call(levee, call.clone(), r2, t0, script.clone()).await
                }
            };
            let result = match call.get("cancel_at").and_then(Json::as_u64) {
                Some(at) => tokio::select! {
                    r = run => r,
                    () = sleep_until_exact(t0, at) => json!({"cancelled": true}),
                },
                None => run.await,
            };
            // Cancelled attempts that unwind close later; the trace waits for them, and for
            // the host's report of them (on the same instant).
            let unwinding: Vec<_> = std::mem::take(&mut *script.unwinding.lock().unwrap());
            for t in unwinding {
                t.await.unwrap();
            }
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
            result
        }));
        tasks.push((task, rec));
    }
    let mut problems = Vec::new();
    let all = async {
        let mut out = Vec::new();
        for (t, rec) in tasks {
            out.push((t.await, rec));
        }
        out
    };
    let Ok(results) = tokio::time::timeout(Duration::from_secs(100_000), all).await else {
        return vec!["deadlock: a call never ended".into()];
    };
    for (i, ((result, rec), call)) in results.into_iter().zip(&calls).enumerate() {
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                problems.push(format!("call {i}: panicked: {e}"));
                continue;
            }
        };
        let rec = rec.lock().unwrap();
        problems.extend(rec.problems.iter().map(|p| format!("call {i}: {p}")));
        let expect = &call["expect"];
        let observed = json!({
            "attempts": rec.attempts,
            "requests": rec.requests,
            "sleeps": rec.sleeps,
            "fallbacks": rec.fallbacks,
            "result": result,
            "events": rec.events,
            "metrics": rec.metrics,
            "on_retry": rec.on_retry,
            "retry_if": rec.retry_if,
        });
        for (field, want) in expect.as_object().into_iter().flatten() {
            let got = &observed[field.as_str()];
            if !same(want, got) {
                problems.push(format!("call {i}: {field}: expected {want}, got {got}"));
            }
        }
    }
    problems
}

#[tokio::test(start_paused = true)]
async fn every_host_scenario_through_the_public_api() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../conformance/hosts");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "json") && !p.ends_with("schema.json"));
    files.sort();
    assert!(files.len() >= 80, "only {} scenarios in {}", files.len(), dir.display());
    let (mut passed, mut failed, mut fixed) = (0, Vec::new(), Vec::new());
    for f in &files {
        let scenario: Json = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        let name = scenario["name"].as_str().unwrap_or("?").to_string();
        let problems = replay(&scenario).await;
        let known = KNOWN.iter().any(|(n, _)| *n == name);
        match (problems.is_empty(), known) {
            (true, false) => passed += 1,
            (true, true) => fixed.push(name),
            (false, true) => {
                let reason = KNOWN.iter().find(|(n, _)| *n == name).map_or("", |(_, r)| *r);
                println!("skipped {name}: {reason}");
            }
            (false, false) => failed.push(format!("{name}:\n    {}", problems.join("\n    "))),
        }
    }
    println!("host scenarios: {passed} of {} pass, {} known failures", files.len(), KNOWN.len());
    assert!(fixed.is_empty(), "listed as known failures but pass now (take them off KNOWN): {fixed:?}");
    assert!(failed.is_empty(), "{} scenarios failed:\n{}", failed.len(), failed.join("\n"));
}

/// `TokioClock` follows paused time: the engine's `now`, the sleeps and the attempt timeouts
/// all move with `tokio::time::advance` and auto-advance, and no real time passes.
#[tokio::test(start_paused = true)]
async fn a_tokio_clock_follows_paused_time() {
    let doc = "policies:\n  p:\n    attempts: 3\n    attempt-timeout: 30s\n    backoff: { kind: constant, base: 10s, jitter: none }\n    retry-on: [timeout, \"error:Boom\"]\n";
    let real = std::time::Instant::now();
    let t0 = tokio::time::Instant::now();
    let steps: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let s2 = steps.clone();
    let levee = Levee::builder()
        .seed(1)
        .clock(TokioClock::new())
        .trace(move |s| s2.lock().unwrap().push((s.op.to_string(), s.now)))
        .load(doc)
        .unwrap();
    let starts: Arc<Mutex<Vec<u64>>> = Arc::default();
    let st = starts.clone();
    let r = levee
        .call::<&str, DepError>("p")
        .run(move |a| {
            st.lock().unwrap().push(ns_since(t0));
            async move {
                match a.number {
                    1 => std::future::pending().await,        // times out at 30 s
                    2 => Err(DepError::Class("Boom".into())), // fails at once
                    _ => Ok("done"),
                }
            }
        })
        .await;
    assert_eq!(r.unwrap(), "done");
    let s = 1_000_000_000;
    assert_eq!(*starts.lock().unwrap(), vec![0, 40 * s, 50 * s]);
    // The engine saw the same times (its `now` is 1 ns ahead of the clock: never 0).
    let reports: Vec<u64> = steps.lock().unwrap().iter().filter(|(op, _)| op == "report").map(|(_, t)| *t).collect();
    // The third attempt's success is reported at once: only a first attempt's is held back.
    assert_eq!(reports, vec![30 * s + 1, 40 * s + 1, 50 * s + 1]);
    assert!(real.elapsed() < Duration::from_secs(5), "paused time took real time: {:?}", real.elapsed());
}

/// An injected clock is the one the engine reads and the one its timers run on.
#[tokio::test(start_paused = true)]
async fn an_injected_clock_runs_now_timeouts_and_sleeps() {
    struct Shifted(TokioClock, Arc<Mutex<Vec<u64>>>);
    impl Clock for Shifted {
        fn now(&self) -> u64 {
            self.0.now() + 1_000_000_000_000
        }
        fn sleep_until(&self, at: u64) -> Sleep {
            self.1.lock().unwrap().push(at);
            self.0.sleep_until(at - 1_000_000_000_000)
        }
    }
    let timers: Arc<Mutex<Vec<u64>>> = Arc::default();
    let nows: Arc<Mutex<Vec<u64>>> = Arc::default();
    let n2 = nows.clone();
    let levee = Levee::builder()
        .clock(Shifted(TokioClock::new(), timers.clone()))
        .trace(move |s| n2.lock().unwrap().push(s.now))
        .load("policies:\n  p:\n    attempts: 2\n    attempt-timeout: 2s\n    backoff: { kind: constant, base: 1s, jitter: none }\n    retry-on: [timeout]\n")
        .unwrap();
    let r = levee.call::<(), DepError>("p").run(|_| std::future::pending()).await;
    let e = r.unwrap_err();
    assert_eq!(e.reason, levee::core::Reason::RetriesExhausted);
    let s = 1_000_000_000u64;
    let base = 1_000 * s;
    // The first attempt's timer, the sleep, the second attempt's timer: all on the clock.
    assert_eq!(*timers.lock().unwrap(), vec![base + 2 * s, base + 3 * s, base + 5 * s]);
    assert!(nows.lock().unwrap().iter().all(|t| *t > base));
}

#[allow(dead_code)]
fn _infallible(_: Infallible) {}

/// Records the `levee.*` spans made, with their fields.
/// The spans made on one thread (the test's), with their fields. It is the process's global
/// subscriber: as a scoped one (`set_default`) it raced with the other tests' threads, which
/// could register one of the crate's callsites with no subscriber of their own, and tracing
/// caches that "never" for every thread (with one dispatcher registered, a callsite's interest
/// is the registering thread's default's). Spans of other threads get an id and are not kept.
/// Also the `levee` events of that thread, each with the name of the span it was in
/// (`Spans::3`), and the stack of spans entered (`Spans::4`).
struct Spans(Mutex<Vec<String>>, std::sync::atomic::AtomicU64, std::thread::ThreadId, Mutex<Vec<String>>, Mutex<Vec<u64>>);

/// The ids given to spans of other threads start here (never an index of `Spans::0`).
const OTHER_THREADS: u64 = 1 << 62;

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

impl tracing::Subscriber for Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        if std::thread::current().id() != self.2 {
            return tracing::span::Id::from_u64(OTHER_THREADS + self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        }
        let mut line = span.metadata().name().to_string();
        span.record(&mut Fields(&mut line));
        let mut lines = self.0.lock().unwrap();
        lines.push(line);
        tracing::span::Id::from_u64(lines.len() as u64)
    }
    fn record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut line = String::new();
        values.record(&mut Fields(&mut line));
        if let Some(l) = self.0.lock().unwrap().get_mut(id.into_u64() as usize - 1) {
            l.push_str(&line);
        }
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if std::thread::current().id() != self.2 || event.metadata().target() != "levee" {
            return;
        }
        let within = match self.4.lock().unwrap().last() {
            Some(&id) if id < OTHER_THREADS => {
                self.0.lock().unwrap().get(id as usize - 1).map(|l| l.split(' ').next().unwrap_or("").to_string()).unwrap_or_default()
            }
            _ => "(no span)".to_string(),
        };
        let mut line = format!("in {within}:");
        event.record(&mut Fields(&mut line));
        self.3.lock().unwrap().push(line);
    }
    fn enter(&self, id: &tracing::span::Id) {
        if std::thread::current().id() == self.2 {
            self.4.lock().unwrap().push(id.into_u64());
        }
    }
    fn exit(&self, id: &tracing::span::Id) {
        if std::thread::current().id() == self.2 {
            let mut stack = self.4.lock().unwrap();
            if let Some(i) = stack.iter().rposition(|s| *s == id.into_u64()) {
                stack.remove(i);
            }
        }
    }
}

/// A call span with its result, and an attempt span per attempt with its outcome; HTTP attempts
/// after the first carry `http.request.resend_count`.
#[test]
fn calls_and_attempts_are_spans() {
    let spans = Arc::new(Spans(
        Mutex::default(),
        std::sync::atomic::AtomicU64::new(0),
        std::thread::current().id(),
        Mutex::default(),
        Mutex::default(),
    ));
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    tracing::subscriber::set_global_default(spans.clone()).unwrap();
    rt.block_on(async {
        let levee = Levee::builder()
            .clock(TokioClock::paused())
            .load("policies:\n  p:\n    attempts: 2\n    backoff: { kind: constant, base: 1s, jitter: none }\n    retry-on: [\"error:Boom\", 503]\n")
            .unwrap();
        let r = levee.call::<u8, DepError>("p").run(|a| async move { if a.number == 1 { Err(DepError::Class("Boom".into())) } else { Ok(1) } }).await;
        assert_eq!(r.unwrap(), 1);
        let svc = tower::service_fn(|req: http::Request<String>| async move {
            let n = req.headers().get("x-levee-attempt").and_then(|v| v.to_str().ok()).unwrap_or("1").to_string();
            Ok::<_, DepError>(http::Response::builder().status(if n == "1" { 503 } else { 200 }).body(String::new()).unwrap())
        });
        let mut s = LeveeLayer::new(levee.clone(), "p").unwrap().layer(svc);
        let req = http::Request::builder().uri("http://svc.test/").body(String::new()).unwrap();
        let resp = s.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(resp.status(), 200);
    });
    let got = spans.0.lock().unwrap().clone();
    let want = [
        "levee.call levee.policy=\"p\" levee.key=\"\" levee.result=\"success\"",
        "levee.attempt levee.attempt=1 levee.outcome=\"error-class\"",
        "levee.attempt levee.attempt=2 levee.outcome=\"success\"",
        "levee.call levee.policy=\"p\" levee.key=\"svc.test:80\" levee.result=\"success\"",
        "levee.attempt levee.attempt=1 levee.outcome=\"http-status\"",
        "levee.attempt levee.attempt=2 http.request.resend_count=1 levee.outcome=\"http-status\"",
    ];
    assert_eq!(got, want);
    // Issue 39: each event is in its call's `levee.call` span, one field per attribute (the
    // contract's names), not one Debug-formatted `attributes` field outside any span.
    let events = spans.3.lock().unwrap().clone();
    let want = [
        "in levee.call: message=levee event event=\"retry-scheduled\" levee.policy=\"p\" levee.key=\"\" levee.call=1 levee.attempt=1 levee.delay=1.0",
        "in levee.call: message=levee event event=\"retry-scheduled\" levee.policy=\"p\" levee.key=\"svc.test:80\" levee.call=2 levee.attempt=1 levee.delay=1.0",
    ];
    assert_eq!(events, want);
}
