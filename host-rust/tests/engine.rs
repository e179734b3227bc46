//! The raw engine and the async handle: trap recovery for real (every guest call interrupted at once by a zero epoch deadline),
//! state kept across traps and reloads, many tasks on one engine, cancellation, both backends.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use levee::core::{BreakerState, InvalidCode, OutcomeKind, Reason, VerdictKind};
use levee::{Backend, Levee, Limits, Outcome, RawEngine};

const DOC: &str = r#"
policies:
  api:
    attempts: 3
    attempt-timeout: 1s
    backoff: {base: 1ms, cap: 2ms}
    breaker:
      window: {kind: count, size: 4}
      minimum-calls: 4
      failure-rate: 50
      open-duration: 60s
  one:
    attempts: 2
    attempt-timeout: 1s
    backoff: {base: 1ms, cap: 2ms}
    bulkhead: {max-concurrent: 1}
  shared:
    attempts: 3
    attempt-timeout: 1s
    backoff: {base: 1ms, cap: 2ms}
"#;

fn starved() -> Limits {
    Limits { call_ticks: 0, ..Limits::default() }
}

fn trip(e: &mut RawEngine, first_call: u64) {
    for i in 0..4 {
        let call = first_call + i;
        let v = e.try_start(call, 0, "k", 0, 1_000 + i, 0, 0, 0).expect("no trap");
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
        // attempts: 3, but a connection error on a fresh call is retried: cancel after it.
        let v = e.try_report(call, 1_100 + i, 100, OutcomeKind::ConnectionError, 0, "", 0, 0).expect("no trap");
        assert!(matches!(v.kind(), Some(VerdictKind::Retry | VerdictKind::Fail)), "{v:?}");
        e.try_cancel(call, 1_200 + i).expect("no trap");
    }
}

#[test]
fn a_trap_reinstantiates_and_restores_the_last_good_state() {
    let mut e = RawEngine::load_with(Backend::Wasm, DOC, 3, Limits::default()).expect("loads");
    trip(&mut e, 1);
    assert_eq!(e.breaker_state(0, "k", 2_000), Some(BreakerState::Open));
    // Draining the transition takes the snapshot.
    let events = e.drain_events();
    assert!(events.iter().any(|ev| ev.state_to == BreakerState::Open), "{events:?}");
    assert!(e.snapshot().is_some());

    // A call in flight when the engine traps is lost with the instance.
    let v = e.try_start(99, 1, "", 0, 3_000, 0, 0, 0).expect("no trap");
    assert_eq!(v.kind(), Some(VerdictKind::Attempt));
    e.set_limits(starved());
    let trap = e.try_acquire(5, 3_100).expect_err("the guest is interrupted");
    assert_eq!(trap.operation(), "acquire");
    assert!(trap.restored());
    assert_eq!(e.traps(), 1);
    e.set_limits(Limits::default());

    // The breaker is still open in the new instance; the lost call is unknown.
    assert_eq!(e.breaker_state(0, "k", 4_000), Some(BreakerState::Open));
    let v = e.report(99, 4_100, 10, OutcomeKind::Success, 0, "", 0, 0);
    assert_eq!(v.kind(), Some(VerdictKind::Invalid));
    assert_eq!(v.detail(), InvalidCode::UnknownCall as u8);

    // The plain methods answer TRAPPED after recovering.
    e.set_limits(starved());
    let v = e.start(100, 0, "k", 0, 5_000, 0, 0, 0);
    assert!(levee::raw::is_trapped(v));
    assert_eq!(e.policy_count(), 0);
    assert!(e.last_trap().is_some_and(|t| t.operation() == "policy-count"));
    assert_eq!(e.traps(), 3);
    e.set_limits(Limits::default());
    assert_eq!(e.policy_count(), 3);
    assert_eq!(e.breaker_state(0, "k", 6_000), Some(BreakerState::Open));
}

#[test]
fn the_native_backend_never_traps_and_decides_the_same() {
    let mut w = RawEngine::load_with(Backend::Wasm, DOC, 3, Limits::default()).expect("loads");
    let mut n = RawEngine::load_with(Backend::Native, DOC, 3, Limits::default()).expect("loads");
    trip(&mut w, 1);
    trip(&mut n, 1);
    assert_eq!(w.drain_events(), n.drain_events());
    assert_eq!(w.export_state(), n.export_state());
    n.set_limits(starved());
    assert!(n.try_policy_count().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_mid_call_lets_the_call_end_after_one_attempt() {
    let rec = common::recorder();
    let l = Levee::builder().backend(Backend::Wasm).seed(1).load(DOC).expect("loads");
    let runs = AtomicU32::new(0);
    let err = l
        .call::<(), std::io::Error>("api")
        .run(|_| {
            runs.fetch_add(1, Ordering::SeqCst);
            // The guest will be interrupted in the report of this attempt.
            l.with_raw(|r| r.set_limits(starved()));
            async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset)) }
        })
        .await
        .expect_err("the attempt failed");
    l.with_raw(|r| r.set_limits(Limits::default()));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "no retry after a trap");
    assert!(err.trap.as_ref().is_some_and(|t| t.operation() == "report"), "{err:?}");
    assert_eq!(err.attempts, 1);
    assert!(err.last.is_some());
    assert!(l.traps() >= 1);
    assert!(rec.counter("levee.engine.faults{levee.fault=trap}") >= 1);

    // A trap in `start` runs the call as a single attempt.
    l.with_raw(|r| r.set_limits(starved()));
    let runs = AtomicU32::new(0);
    let r = l
        .call::<u32, std::io::Error>("api")
        .run(|a| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok(a.number) }
        })
        .await;
    l.with_raw(|r| r.set_limits(Limits::default()));
    assert_eq!(r.expect("the single attempt succeeds"), 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // And the engine works normally afterwards.
    let runs = AtomicU32::new(0);
    let r = l
        .call::<u32, std::io::Error>("api")
        .run(|a| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                if a.number < 2 {
                    Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
                } else {
                    Ok(a.number)
                }
            }
        })
        .await;
    assert_eq!(r.expect("retried to success"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_share_one_engine() {
    for backend in [Backend::Wasm, Backend::Native] {
        let l = Levee::builder().backend(backend).seed(9).load(DOC).expect("loads");
        let ok = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for t in 0..16u32 {
            let (l, ok) = (l.clone(), ok.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..200u32 {
                    let r = l
                        .call::<u32, Outcome>("shared")
                        // A quarter unkeyed: those start through `start-unkeyed` in the component.
                        .key(if t % 4 == 0 { String::new() } else { format!("k{}", t % 4) })
                        .run(|a| async move {
                            if (i + t) % 7 == 0 && a.number == 1 {
                                Err(Outcome::http(503))
                            } else {
                                tokio::task::yield_now().await;
                                Ok(a.number)
                            }
                        })
                        .await;
                    if r.is_ok() {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(ok.load(Ordering::Relaxed), 16 * 200, "{backend}");
        assert_eq!(l.traps(), 0);
        // Every call finished: nothing is left in flight.
        let live = l.with_raw(|r| (1..=16 * 200 * 3).filter(|c| r.call_info(*c).is_some()).count());
        assert_eq!(live, 0, "{backend}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulkhead_slot_is_released_when_a_call_is_dropped() {
    let l = Levee::builder().seed(2).load(DOC).expect("loads");
    let l2 = l.clone();
    let hung = tokio::spawn(async move {
        l2.call::<(), std::io::Error>("one")
            .run(|_| async {
                std::future::pending::<()>().await;
                Ok(())
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = l.call::<(), std::io::Error>("one").run(|_| async { Ok(()) }).await.expect_err("the only slot is taken");
    assert_eq!(err.reason, Reason::BulkheadFull);
    assert!(err.is_rejected());
    hung.abort();
    let _ = hung.await;
    l.call::<(), std::io::Error>("one").run(|_| async { Ok(()) }).await.expect("the slot came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_keeps_the_breaker_state() {
    let l = Levee::builder().seed(4).load(DOC).expect("loads");
    for _ in 0..4 {
        let _ = l.call::<(), Outcome>("api").key("down").run(|_| async { Err(Outcome::ConnectionError) }).await;
    }
    assert_eq!(l.breaker_state("api", "down"), Some(BreakerState::Open));
    let bad = l.reload("policies:\n  api:\n    attempts: 0\n").expect_err("attempts 0 is invalid");
    assert_eq!(bad.0[0].path, "policies.api.attempts");
    assert_eq!(l.policy_info("api").map(|p| p.max_attempts), Some(3));
    l.reload(&DOC.replace("attempts: 3", "attempts: 5")).expect("reloads");
    assert_eq!(l.policy_info("api").map(|p| p.max_attempts), Some(5));
    assert_eq!(l.breaker_state("api", "down"), Some(BreakerState::Open));
    let err = l.call::<(), Outcome>("api").key("down").run(|_| async { Ok(()) }).await.expect_err("still open");
    assert_eq!(err.reason, Reason::BreakerOpen);

    // From a watched file too.
    let dir = std::env::temp_dir().join(format!("levee-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("policy.yaml");
    std::fs::write(&path, DOC).expect("write");
    let watch = l.watch_file(&path, Duration::from_millis(20));
    std::fs::write(&path, DOC.replace("attempts: 3", "attempts: 4")).expect("write");
    for _ in 0..200 {
        if l.policy_info("api").map(|p| p.max_attempts) == Some(4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    watch.abort();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(l.policy_info("api").map(|p| p.max_attempts), Some(4));
    assert_eq!(l.breaker_state("api", "down"), Some(BreakerState::Open));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_policy_is_a_protocol_error() {
    let l = Levee::from_str(DOC).expect("loads");
    let err = l.run("nope", |_| async { Ok::<(), std::io::Error>(()) }).await.expect_err("unknown");
    assert_eq!(err.invalid, Some(InvalidCode::UnknownPolicy));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_found_by_name_in_small_and_large_documents() {
    // A few policies are compared in turn, many go through a map: both must find every one.
    for count in [3usize, 12] {
        let doc: String = std::iter::once("policies:\n".to_string())
            .chain(
                (0..count).map(|i| format!("  p{i}: {{attempts: {}, backoff: {{kind: exponential, base: 1ms, cap: 1ms}}}}\n", i % 5 + 1)),
            )
            .collect();
        let l = Levee::from_str(&doc).expect("loads");
        assert_eq!(l.policy_names().len(), count);
        for i in 0..count {
            let name = format!("p{i}");
            assert_eq!(l.policy_info(&name).map(|p| p.max_attempts), Some((i % 5 + 1) as u32), "{name} of {count}");
            let calls = Arc::new(AtomicU32::new(0));
            let c = calls.clone();
            let r = l
                .run(&name, move |_| {
                    c.fetch_add(1, Ordering::Relaxed);
                    async { Err::<(), _>(Outcome::http(503)) }
                })
                .await;
            assert!(r.is_err());
            // The policy found is the one named: its attempts ran.
            assert_eq!(calls.load(Ordering::Relaxed), (i % 5 + 1) as u32, "{name} of {count}");
        }
        assert!(l.policy_info("p99").is_none());
        let err = l.run("p99", |_| async { Ok::<(), std::io::Error>(()) }).await.expect_err("unknown");
        assert_eq!(err.invalid, Some(InvalidCode::UnknownPolicy));
    }
}

#[test]
fn the_handle_and_its_futures_are_send_and_sync() {
    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}
    let l = Levee::from_str(DOC).expect("loads");
    send_sync(&l);
    let fut = l.call::<u32, std::io::Error>("api").run(|_| async { Ok(1) });
    send(&fut);
    let raw = RawEngine::load(DOC, 1).expect("loads");
    send(&raw);
}

// ---------------------------------------------------------------- issue 14: bounds and trips

const BREAKER_BODY: &str =
    "    attempts: 1\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }\n";

fn many_policies(n: usize) -> String {
    let mut doc = String::from("policies:\n");
    for i in 0..n {
        doc.push_str(&format!("  p{i}:\n{BREAKER_BODY}"));
    }
    doc
}

/// The bounds on guest work fit the largest valid work: a 4,096-policy load (the most a
/// document may hold), a 4,000-policy reload, the export and import of 10,000 keys.
#[test]
fn the_bounds_fit_the_largest_valid_work() {
    let mut e = RawEngine::load_with(Backend::Wasm, &many_policies(4096), 1, Limits::default()).expect("4,096 policies load");
    e.try_reload(&many_policies(4000)).expect("no trap").expect("4,000 policies reload");
    let doc = format!("policies:\n  p:\n{BREAKER_BODY}    keys: {{ max: 1000000 }}\n");
    e.try_reload(&doc).expect("no trap").expect("reloads");
    for i in 0..10_000u64 {
        let v = e.try_start(i + 1, 0, &format!("host-{i}"), 0, 1_000 + i, 0, 0, 0).expect("no trap");
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
        e.try_report(i + 1, 1_100 + i, 10, OutcomeKind::Success, 0, "", 0, 0).expect("no trap");
    }
    let state = e.try_export_state().expect("the export of 10,000 keys fits its bound");
    assert!(state.len() > 1 << 20, "{} bytes", state.len());
    e.try_import_state(&state).expect("no trap").expect("the state of 10,000 keys imports");
    assert_eq!(e.traps(), 0);
}

/// A trap never brings a tripped breaker back closed: the handle drains the transition under
/// its lock and the engine snapshots on it, with no periodic snapshot and no explicit export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_never_forgets_a_trip() {
    let limits = Limits { checkpoint_interval: 0, ..Limits::default() };
    let doc = format!("policies:\n  b:\n{BREAKER_BODY}");
    let l = Levee::builder().backend(Backend::Wasm).seed(1).limits(limits).load(&doc).expect("loads");
    for key in ["", "db-1"] {
        for _ in 0..2 {
            let r = l
                .call::<(), std::io::Error>("b")
                .key(key)
                .run(|_| async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
                .await;
            assert!(r.is_err());
        }
        assert_eq!(l.breaker_state("b", key), Some(BreakerState::Open));
    }
    l.set_breaker_state("b", "db-2", BreakerState::ForcedOpen).expect("forced open");
    l.with_raw(|r| r.set_limits(starved()));
    let r = l.call::<u32, std::io::Error>("b").run(|_| async { Ok(7) }).await;
    l.with_raw(|r| r.set_limits(limits));
    assert_eq!(r.expect("the faulted call runs once"), 7);
    assert!(l.traps() >= 1);
    for key in ["", "db-1", "db-2"] {
        let runs = AtomicU32::new(0);
        let r = l
            .call::<u32, std::io::Error>("b")
            .key(key)
            .run(|_| {
                runs.fetch_add(1, Ordering::SeqCst);
                async { Ok(1) }
            })
            .await;
        let err = r.expect_err("the breaker is still open");
        assert_eq!(err.reason, Reason::BreakerOpen, "key {key:?}: {err:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }
}

/// A fallback the policy names but nobody registered fails, and the error says so (the
/// attempt's error stands).
#[tokio::test]
async fn an_unregistered_fallback_is_named_in_the_error() {
    let doc = "policies:\n  up:\n    attempts: 1\n    fallbacks: [cached, stale]\n";
    let l = Levee::builder().backend(Backend::Wasm).seed(1).load(doc).expect("loads");
    let err = l
        .call::<u32, std::io::Error>("up")
        .run(|_| async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
        .await
        .expect_err("no fallback ran");
    assert_eq!(err.reason, Reason::FallbacksFailed);
    assert_eq!(err.unregistered, ["cached", "stale"]);
    assert!(err.last.is_some());
    let msg = err.to_string();
    assert!(msg.contains("fallbacks 'cached', 'stale' are named by the policy but not registered"), "{msg}");
}

async fn refused<T>() -> Result<T, std::io::Error> {
    Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
}

/// Issue 39: the registry keeps one fallback per name and result type. Registering `stale`
/// for a second type kept the first one only until now: the second replaced it, and a call
/// of the first type then said "named by the policy but not registered".
#[tokio::test]
async fn fallbacks_are_kept_per_name_and_result_type() {
    let doc = "policies:\n  up:\n    attempts: 1\n    fallbacks: [stale]\n";
    let l = Levee::builder().backend(Backend::Wasm).seed(1).load(doc).expect("loads");
    l.register_fallback("stale", |_ctx| async { Ok::<u32, std::io::Error>(7) });
    l.register_fallback("stale", |_ctx| async { Ok::<String, std::io::Error>("stale".to_string()) });
    let n = l.call::<u32, std::io::Error>("up").run(|_| refused()).await.expect("the u32 fallback");
    assert_eq!(n, 7);
    let s = l.call::<String, std::io::Error>("up").run(|_| refused()).await.expect("the String fallback");
    assert_eq!(s, "stale");
    // Registering again for a type replaces that type's only.
    l.register_fallback("stale", |_ctx| async { Ok::<u32, std::io::Error>(8) });
    assert_eq!(l.call::<u32, std::io::Error>("up").run(|_| refused()).await.expect("the new u32 fallback"), 8);
    assert_eq!(l.call::<String, std::io::Error>("up").run(|_| refused()).await.expect("still there"), "stale");

    // A call whose result type none was registered for: the error names what is registered.
    let err = l.call::<i64, std::io::Error>("up").run(|_| refused()).await.expect_err("no i64 fallback");
    assert_eq!(err.reason, Reason::FallbacksFailed);
    assert!(err.unregistered.is_empty(), "{err:?}");
    assert_eq!(err.mistyped.len(), 1, "{err:?}");
    let m = &err.mistyped[0];
    assert_eq!(m.name, "stale");
    assert_eq!(m.registered.len(), 2, "{m:?}");
    assert!(m.registered.iter().any(|t| t.contains("u32")) && m.registered.iter().any(|t| t.contains("String")), "{m:?}");
    assert!(m.call.contains("i64"), "{m:?}");
    let msg = err.to_string();
    assert!(msg.contains("fallback 'stale' is registered for Result<"), "{msg}");
    assert!(msg.contains(", not for this call's Result<i64, "), "{msg}");
    assert!(!msg.contains("not registered"), "{msg}");
}

/// The README's paused-time example ("Testing with virtual time"), as written there.
#[tokio::test(start_paused = true)] // tokio's `test-util` feature
async fn retries_without_waiting() {
    let levee = levee::Levee::builder()
        .clock(levee::time::TokioClock::paused())
        // `jitter: none`: with the default full jitter each delay is random in [0, 10 s]
        .load("policies:\n  p: { attempts: 3, backoff: { kind: constant, base: 10s, jitter: none } }\n")
        .unwrap();
    let (start, real) = (tokio::time::Instant::now(), std::time::Instant::now());
    let mut tries = 0;
    let answer = levee
        .call::<&str, std::io::Error>("p")
        .run(|_attempt| {
            tries += 1;
            let n = tries;
            async move {
                if n < 3 {
                    Err(std::io::ErrorKind::ConnectionRefused.into())
                } else {
                    Ok("up")
                }
            }
        })
        .await
        .unwrap();
    assert_eq!((answer, tries), ("up", 3));
    // two retries, 10 s apart: the engine saw exactly 20 s pass, in next to no real time
    assert_eq!(start.elapsed(), std::time::Duration::from_secs(20));
    assert!(real.elapsed() < std::time::Duration::from_secs(5));
}

/// Counters as a telemetry sink saw them: (name, attributes) -> total.
#[derive(Default)]
struct Counters(std::sync::Mutex<Vec<Added>>);

/// One counter increment: its name, attributes (name, value) and value.
type Added = (String, Vec<(String, String)>, u64);

/// The events a sink saw: name and `levee.key`.
type SeenEvents = Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

impl Counters {
    fn total(&self, name: &str) -> u64 {
        self.0.lock().unwrap().iter().filter(|(n, _, _)| n == name).map(|(_, _, v)| v).sum()
    }
    fn attributes(&self, name: &str) -> Vec<Vec<(String, String)>> {
        self.0.lock().unwrap().iter().filter(|(n, _, _)| n == name).map(|(_, a, _)| a.clone()).collect()
    }
}

struct CountingSink(Arc<Counters>, SeenEvents);

impl levee::Telemetry for CountingSink {
    fn event(&self, name: &str, attributes: &levee::telemetry::Attributes<'_>) {
        let key = attributes.iter().find(|(n, _)| *n == levee::constants::ATTR_KEY).map(|(_, v)| v.to_string());
        self.1.lock().unwrap().push((name.to_string(), key));
    }
    fn add(&self, counter: &'static str, value: u64, attributes: &levee::telemetry::Attributes<'_>) {
        let a = attributes.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        self.0 .0.lock().unwrap().push((counter.to_string(), a, value));
    }
    fn record(&self, _histogram: &'static str, _value: f64, _attributes: &levee::telemetry::Attributes<'_>) {}
    fn gauge(&self, _gauge: &'static str, _value: f64, _attributes: &levee::telemetry::Attributes<'_>) {}
}

/// `key-evicted` and `key-overflow` (issue 41) are events of their own, each counted per policy
/// (`levee.keys.evicted`, `levee.keys.overflow`): a key at rest is evicted for a new one; when
/// every key holds protection, a new key is decided against the shared overflow entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_evictions_and_overflows_are_events_and_counted() {
    for backend in [Backend::Wasm, Backend::Native] {
        let counters = Arc::new(Counters::default());
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let doc = format!("policies:\n  b:\n{BREAKER_BODY}    keys: {{ max: 1 }}\n");
        let l =
            Levee::builder().backend(backend).seed(1).telemetry(CountingSink(counters.clone(), events.clone())).load(&doc).expect("loads");
        // "a" at rest is evicted for "b".
        for key in ["a", "b"] {
            l.call::<u32, std::io::Error>("b").key(key).run(|_| async { Ok(1) }).await.expect("runs");
        }
        assert_eq!(counters.total(levee::constants::METRIC_KEYS_EVICTED), 1, "{backend}");
        // "b" trips (its breaker holds protection): "c" overflows.
        for _ in 0..2 {
            let r = l
                .call::<u32, std::io::Error>("b")
                .key("b")
                .run(|_| async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
                .await;
            assert!(r.is_err());
        }
        assert_eq!(l.breaker_state("b", "b"), Some(BreakerState::Open), "{backend}");
        l.call::<u32, std::io::Error>("b").key("c").run(|_| async { Ok(1) }).await.expect("runs on the overflow entry");
        assert_eq!(counters.total(levee::constants::METRIC_KEYS_OVERFLOW), 1, "{backend}");
        assert_eq!(counters.total(levee::constants::METRIC_KEYS_EVICTED), 1, "{backend}");
        for name in [levee::constants::METRIC_KEYS_EVICTED, levee::constants::METRIC_KEYS_OVERFLOW] {
            let policy = (levee::constants::ATTR_POLICY.to_string(), "b".to_string());
            assert_eq!(counters.attributes(name), vec![vec![policy]], "{backend} {name}");
        }
        let events = events.lock().unwrap().clone();
        let evicted = levee::constants::EVENT_KINDS[levee::core::EventKind::KeyEvicted as usize];
        let overflow = levee::constants::EVENT_KINDS[levee::core::EventKind::KeyOverflow as usize];
        assert!(events.contains(&(evicted.to_string(), Some("a".to_string()))), "{backend}: {events:?}");
        // The overflow event names the caller's key.
        assert!(events.contains(&(overflow.to_string(), Some("c".to_string()))), "{backend}: {events:?}");
    }
}

/// A key longer than the bound (in UTF-8 bytes) is refused before the engine, at every entry
/// that takes one, with its length and the bound; a key of exactly the bound runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_longer_than_the_bound_is_refused() {
    let max = levee::constants::GUARD_MAX_KEY_BYTES as usize;
    let doc = format!("policies:\n  b:\n{BREAKER_BODY}");
    let l = Levee::builder().seed(1).load(&doc).expect("loads");
    // 'é' is two bytes: max/2 + 1 of them are max + 2 bytes.
    for long in ["k".repeat(max + 1), "é".repeat(max / 2 + 1)] {
        let runs = AtomicU32::new(0);
        let err = l
            .call::<u32, std::io::Error>("b")
            .key(long.as_str())
            .run(|_| {
                runs.fetch_add(1, Ordering::SeqCst);
                async { Ok(1) }
            })
            .await
            .expect_err("refused");
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_eq!(err.key_too_long, Some(levee::KeyTooLong { bytes: long.len() }));
        let text = err.to_string();
        assert!(text.contains(&format!("key: {} bytes, longer than the {max} a key may be", long.len())), "{text}");
        let set = l.set_breaker_state("b", &long, BreakerState::ForcedOpen).expect_err("refused");
        assert!(set.contains(&format!("key: {} bytes", long.len())), "{set}");
        assert_eq!(l.breaker_state("b", &long), None);
    }
    let exact = "k".repeat(max);
    assert_eq!(l.call::<u32, std::io::Error>("b").key(exact.as_str()).run(|_| async { Ok(1) }).await.expect("runs"), 1);
    l.set_breaker_state("b", &exact, BreakerState::ForcedOpen).expect("a key of the bound is a key");
    assert_eq!(l.breaker_state("b", &exact), Some(BreakerState::ForcedOpen));
}

/// The recovery snapshot is `export-snapshot` (issue 41): the keys holding protection only,
/// so its cost follows them, not the table; a recovery from it keeps every open breaker.
#[test]
fn the_recovery_snapshot_holds_the_protected_keys_only() {
    let doc = format!("policies:\n  p:\n{BREAKER_BODY}    keys: {{ max: 1000000 }}\n");
    let mut e = RawEngine::load_with(Backend::Wasm, &doc, 1, Limits::default()).expect("loads");
    for i in 0..1000u64 {
        e.try_start(i + 1, 0, &format!("host-{i}"), 0, 1_000 + i, 0, 0, 0).expect("no trap");
        e.try_report(i + 1, 1_100 + i, 10, OutcomeKind::Success, 0, "", 0, 0).expect("no trap");
    }
    for i in 0..2u64 {
        e.try_start(5_000 + i, 0, "open", 0, 10_000 + i, 0, 0, 0).expect("no trap");
        e.try_report(5_000 + i, 10_100 + i, 10, OutcomeKind::ConnectionError, 0, "", 0, 0).expect("no trap");
    }
    assert!(e.drain_events().iter().any(|ev| ev.state_to == BreakerState::Open));
    let snapshot = e.snapshot().expect("the transition took a snapshot").to_vec();
    assert_eq!(snapshot, e.export_snapshot());
    let state = e.export_state();
    assert!(snapshot.len() * 10 < state.len(), "snapshot {} bytes, state {}", snapshot.len(), state.len());
    e.set_limits(starved());
    assert!(e.try_policy_count().is_err());
    e.set_limits(Limits::default());
    assert_eq!(e.breaker_state(0, "open", 20_000), Some(BreakerState::Open));
}

/// Restore at any size (issue 41): 20,000 keys of ~1,000 bytes and one open breaker; the
/// whole state exports and imports within its bounds, and a trap after it recovers with the
/// breaker still open (the next call on its key is rejected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_state_exports_imports_and_survives_a_trap() {
    let doc = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";
    let l = Levee::builder().backend(Backend::Wasm).seed(1).load(doc).expect("loads");
    let pad = "x".repeat(990);
    for i in 0..20_000 {
        let key = format!("{pad}{i:05}");
        l.call::<u32, std::io::Error>("p").key(key).run(|_| async { Ok(1) }).await.expect("runs");
    }
    for _ in 0..2 {
        let r = l
            .call::<u32, std::io::Error>("p")
            .key("open")
            .run(|_| async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
            .await;
        assert!(r.is_err());
    }
    assert_eq!(l.breaker_state("p", "open"), Some(BreakerState::Open));
    let state = l.export_state();
    assert!(state.len() > 20_000 * 990, "{} bytes", state.len());
    l.import_state(&state).expect("the whole state imports");
    assert_eq!(l.traps(), 0);
    l.with_raw(|r| r.set_limits(starved()));
    let r = l.call::<u32, std::io::Error>("p").run(|_| async { Ok(7) }).await;
    l.with_raw(|r| r.set_limits(Limits::default()));
    assert_eq!(r.expect("the faulted call runs once"), 7);
    assert!(l.traps() >= 1);
    let err = l.call::<u32, std::io::Error>("p").key("open").run(|_| async { Ok(1) }).await.expect_err("still open");
    assert_eq!(err.reason, Reason::BreakerOpen, "{err:?}");
}

/// Keys of `GUARD_MAX_KEY_BYTES` the guest holds within its memory bound with room to spare
/// (docs/hosts.md, "State of any size").
const LONG_KEYS: u64 = 200_000;

/// `n` keys of `len` bytes (at least 8) at rest, one call each, and one breaker ("open") open.
fn fill(e: &mut RawEngine, n: u64, len: usize) {
    for i in 0..n {
        let key = format!("{i:0>len$}");
        e.try_start(i + 1, 0, &key, 0, 1_000 + i, 0, 0, 0).expect("no trap");
        e.try_report(i + 1, 1_000 + i, 10, OutcomeKind::Success, 0, "", 0, 0).expect("no trap");
    }
    for i in 0..2u64 {
        e.try_start(n + 10 + i, 0, "open", 0, 1_000 + n + i, 0, 0, 0).expect("no trap");
        e.try_report(n + 10 + i, 1_000 + n + i, 10, OutcomeKind::ConnectionError, 0, "", 0, 0).expect("no trap");
    }
    assert_eq!(e.breaker_state(0, "open", 1_000 + n + 5), Some(BreakerState::Open));
}

/// Export and import at a million short keys (issue 41): about 250 MB of state, which trapped
/// against the guest's 512 MiB when the guest built the whole document; page by page it never
/// holds it, in either direction.
#[test]
fn a_million_keys_export_and_import() {
    let doc = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";
    let limits = Limits { checkpoint_interval: 0, ..Limits::default() };
    let mut e = RawEngine::load_with(Backend::Wasm, doc, 1, limits).expect("loads");
    fill(&mut e, 999_999, 8);
    let state = e.try_export_state().expect("the export of a million keys");
    assert!(state.len() > 200 << 20, "{} bytes", state.len());
    let mut other = RawEngine::load_with(Backend::Wasm, doc, 2, limits).expect("loads");
    other.try_import_state(&state).expect("no trap").expect("a million keys import");
    assert_eq!(other.breaker_state(0, "open", 2_000_000), Some(BreakerState::Open));
    assert_eq!(other.try_export_state().expect("no trap"), state);
    assert_eq!((e.traps(), other.traps()), (0, 0));
}

/// `keys.max: 1000000` with as many keys of the longest length as the guest holds
/// (`LONG_KEYS`, issue 41): the whole state exports, a trap recovers, and the open breaker
/// stays open.
#[test]
fn at_a_million_keys_bound_long_keys_export_trap_and_keep_an_open_breaker() {
    let doc = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";
    let max = levee::constants::GUARD_MAX_KEY_BYTES as usize;
    let mut e = RawEngine::load_with(Backend::Wasm, doc, 1, Limits::default()).expect("loads");
    fill(&mut e, LONG_KEYS, max);
    let state = e.try_export_state().expect("the export of the long keys");
    assert!(state.len() as u64 > LONG_KEYS * max as u64, "{} bytes", state.len());
    // Draining the breaker's transition takes the recovery snapshot (its time is under the
    // snapshot interval, so no call took one).
    assert!(e.drain_events().iter().any(|ev| ev.state_to == BreakerState::Open));
    assert!(e.snapshot().is_some());
    e.set_limits(starved());
    assert!(e.try_policy_count().is_err());
    e.set_limits(Limits::default());
    assert_eq!(e.traps(), 1);
    assert!(e.last_trap().is_some_and(|t| t.to_string().contains("restored")), "{:?}", e.last_trap());
    assert_eq!(e.breaker_state(0, "open", 5_000_000), Some(BreakerState::Open));
    let v = e.try_start(9_000_000, 0, "open", 0, 5_000_000, 0, 0, 0).expect("no trap");
    assert_eq!(v.kind(), Some(VerdictKind::Fail), "the open breaker rejects");
}
