//! The fleet option (feature `fleet-redis`, docs/fleet.md). Without a Redis: a store that is
//! down, or that accepts and never answers, leaves every call local-only at once (event
//! `degraded`) and fails none. With one (`LEVEE_FLEET_REDIS=host:port`, as fleet/tests/run.sh
//! runs them, `--include-ignored`): two engines share records, a strict fleet limit admits
//! its burst and then rejects with the script's hint, the shared state is the core's, bytes
//! the core refuses are reported (`bad-state`) without failing a call, and one engine's
//! deposits in a ratio budget pay another's retries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use levee::core::Reason;
use levee::fleet::{Fleet, FleetEventKind};
use levee::Levee;

const DOC: &str = r#"
policies:
  dep:
    attempts: 1
    breaker: {window: {kind: count, size: 20}, minimum-calls: 10, failure-rate: 50, open-duration: 1s}
    rate-limit: {rate: 100000}
    fleet:
      rate-limit: {rate: 1000, burst: 50}
      lease: 5
      publish-every: 50ms
      timeout: 5ms
      retry-every: 100ms
  strict:
    attempts: 1
    breaker: {window: {kind: count, size: 100}, minimum-calls: 100}
    fleet: {publish: strict, rate-limit: {rate: 1, per: 1s, burst: 5}, timeout: 200ms}
  count:
    attempts: 1
    breaker: {window: {kind: count, size: 1000}, minimum-calls: 1000, failure-rate: 100}
    fleet: {quorum: 100, publish-every: 10s, ttl: 30s, timeout: 200ms}
  ratio:
    attempts: 2
    backoff: {kind: constant, base: 1ms, jitter: none}
    budget: {kind: ratio, percent: 20, min-per-second: 0, ttl: 10s}
    fleet: {publish-every: 10s, ttl: 30s, timeout: 200ms}
"#;

type Events = Arc<Mutex<Vec<FleetEventKind>>>;

async fn fleet(levee: &Levee, node: &str, url: &str) -> (Fleet, Events) {
    let events: Events = Arc::default();
    let ev = events.clone();
    let f = Fleet::builder(levee).node(node).on_event(move |e| ev.lock().unwrap().push(e.kind)).connect(url).await.unwrap();
    (f, events)
}

fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port() // dropped: nothing listens there
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_store_leaves_every_call_local() {
    let levee = Levee::from_str(DOC).unwrap();
    let (f, events) = fleet(&levee, "n1", &format!("redis://127.0.0.1:{}/0", closed_port())).await;
    assert!(!f.is_up());
    assert_eq!(*events.lock().unwrap(), [FleetEventKind::Degraded]);
    let start = Instant::now();
    for _ in 0..500 {
        f.run("dep", "k", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap();
        f.run("strict", "k", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap();
    }
    // Local-only: no call waits on the store (1,000 calls well under a second).
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    assert!(!f.sync("count", "k").await);
    assert!(f.inspect("count", "k").await.is_err());
    // A key longer than the bound (issue 41) is refused before the store, whatever its state.
    let long = "q".repeat(levee::constants::GUARD_MAX_KEY_BYTES as usize + 1);
    let e = f.inspect("count", &long).await.unwrap_err();
    assert!(matches!(&e, levee::fleet::FleetError::KeyTooLong(k) if k.bytes == long.len()), "{e}");
    assert_eq!(f.publications(), 0);
    // The local breaker still works while the fleet is down.
    for _ in 0..20 {
        let _ = f.run("dep", "bad", |_| async { Err::<(), _>(std::io::Error::other("down")) }).await;
    }
    let e = f.run("dep", "bad", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::BreakerOpen);
    f.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_store_is_left_after_the_timeout() {
    // Accepts connections and never answers: every operation runs into its timeout.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            conns.push(s);
        }
    });
    let levee = Levee::from_str(DOC).unwrap();
    let (f, events) = fleet(&levee, "n1", &format!("redis://127.0.0.1:{port}/0")).await;
    assert!(!f.is_up());
    assert_eq!(*events.lock().unwrap(), [FleetEventKind::Degraded]);
    let start = Instant::now();
    for _ in 0..200 {
        f.run("dep", "k", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap();
    }
    assert!(start.elapsed() < Duration::from_millis(500), "{:?}", start.elapsed());
    // The retries (every 100 ms) find it silent still: no `restored`.
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(*events.lock().unwrap(), [FleetEventKind::Degraded]);
    f.close().await;
    held.abort();
}

fn redis_url() -> String {
    let addr = std::env::var("LEVEE_FLEET_REDIS").expect("LEVEE_FLEET_REDIS=host:port (fleet/tests/run.sh sets it)");
    format!("redis://{addr}/0")
}

fn flush(url: &str) {
    let c = redis::Client::open(url).unwrap();
    let mut conn = c.get_connection().unwrap();
    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis: LEVEE_FLEET_REDIS=host:port (fleet/tests/run.sh runs it)"]
async fn two_engines_share_their_records_and_a_strict_limit() {
    let url = redis_url();
    flush(&url);
    let (a, b) = (Levee::from_str(DOC).unwrap(), Levee::from_str(DOC).unwrap());
    let (fa, ea) = fleet(&a, "rust-a", &url).await;
    let (fb, _) = fleet(&b, "rust-b", &url).await;
    assert!(fa.is_up() && fb.is_up(), "{:?}", ea.lock().unwrap());
    for _ in 0..3 {
        let _ = fa.run("count", "k", |_| async { Err::<(), _>(std::io::Error::other("x")) }).await;
    }
    for _ in 0..5 {
        let _ = fb.run("count", "k", |_| async { Err::<(), _>(std::io::Error::other("x")) }).await;
    }
    assert!(fa.sync("count", "k").await && fb.sync("count", "k").await);
    let json: serde_json::Value = serde_json::from_str(&fa.inspect("count", "k").await.unwrap().unwrap()).unwrap();
    let failures = |node: &str| json["records"].as_array().unwrap().iter().find(|r| r["node"] == node).map(|r| r["failures"].clone());
    assert_eq!((failures("rust-a"), failures("rust-b")), (Some(3.into()), Some(5.into())), "{json}");

    // Strict, 1/s with a burst of 5, shared by both: 5 admitted, then rejected with a hint.
    let mut admitted = 0;
    let mut hint = None;
    for i in 0..10 {
        let f = if i % 2 == 0 { &fa } else { &fb };
        match f.run("strict", "k", |_| async { Ok::<_, std::io::Error>(()) }).await {
            Ok(()) => admitted += 1,
            Err(e) => {
                assert_eq!(e.reason, Reason::RateLimited);
                hint = e.retry_after;
            }
        }
    }
    assert_eq!(admitted, 5);
    let hint = hint.unwrap();
    assert!(hint > Duration::from_millis(500) && hint <= Duration::from_secs(1), "{hint:?}");
    assert!(fa.publications() > 0 && fb.publications() > 0);
    assert!(ea.lock().unwrap().is_empty());

    // Bytes the core refuses: event `bad-state`, calls go on, inspect names what is wrong.
    let c = redis::Client::open(url.as_str()).unwrap();
    let mut conn = c.get_connection().unwrap();
    let _: () = redis::cmd("HSET").arg("levee:{count/bad}:s").arg("v").arg(1).arg("d").arg("garbage").query(&mut conn).unwrap();
    assert!(fa.sync("count", "bad").await);
    assert_eq!(*ea.lock().unwrap(), [FleetEventKind::BadState]);
    assert!(fa.is_up());
    fa.run("count", "bad", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap();
    assert!(matches!(fa.inspect("count", "bad").await, Err(levee::fleet::FleetError::BadState(_))));
    fa.close().await;
    fb.close().await;
}

/// How many times a call that always fails (connection refused: retryable) ran its operation:
/// 2 when the budget paid a retry.
async fn invocations(f: &Fleet, policy: &str) -> usize {
    let n = Arc::new(Mutex::new(0));
    let m = n.clone();
    let r = f
        .run(policy, "k", move |_| {
            *m.lock().unwrap() += 1;
            async { Err::<(), _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) }
        })
        .await;
    assert!(r.is_err());
    let n = *n.lock().unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis: LEVEE_FLEET_REDIS=host:port (fleet/tests/run.sh runs it)"]
async fn a_ratio_budget_is_shared_one_engines_deposits_pay_anothers_retries() {
    // 20 %: a retry withdraws 5 deposits, a call deposits 1, no reserve (min-per-second 0).
    let url = redis_url();
    flush(&url);
    let (a, b, alone) = (Levee::from_str(DOC).unwrap(), Levee::from_str(DOC).unwrap(), Levee::from_str(DOC).unwrap());
    let (fa, ea) = fleet(&a, "rust-a", &url).await;
    let (fb, eb) = fleet(&b, "rust-b", &url).await;
    for _ in 0..10 {
        fa.run("ratio", "k", |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap();
    }
    assert!(fa.sync("ratio", "k").await);
    let json: serde_json::Value = serde_json::from_str(&fa.inspect("ratio", "k").await.unwrap().unwrap()).unwrap();
    let balance = |j: &serde_json::Value| j["ratio"].as_array().unwrap().iter().map(|s| s[1].as_i64().unwrap()).sum::<i64>();
    assert_eq!(balance(&json), 10_000, "the ledger holds rust-a's 10 deposits (milli-deposits): {json}");

    // An engine that shares nothing has its own single deposit: no retry.
    let (lone, _) = fleet(&alone, "alone", &format!("redis://127.0.0.1:{}/0", closed_port())).await;
    assert_eq!(invocations(&lone, "ratio").await, 1);
    lone.close().await;
    // rust-b, after one publication, spends rust-a's deposits: each call deposits 1 and each retry
    // withdraws 5: 11 → 6, 7 → 2, then 3 cannot pay.
    assert!(fb.sync("ratio", "k").await);
    assert_eq!(invocations(&fb, "ratio").await, 2);
    assert_eq!(invocations(&fb, "ratio").await, 2);
    assert_eq!(invocations(&fb, "ratio").await, 1);
    assert!(fb.sync("ratio", "k").await);
    let json: serde_json::Value = serde_json::from_str(&fb.inspect("ratio", "k").await.unwrap().unwrap()).unwrap();
    assert_eq!(balance(&json), 3_000, "10 + 3 deposits, 2 retries of 5 withdrawn: {json}");
    assert!(ea.lock().unwrap().is_empty() && eb.lock().unwrap().is_empty());
    fa.close().await;
    fb.close().await;
}

/// A key longer than the bound (issue 41) is refused before the fleet's store sees it: no
/// rate-limit token or record is written under it, and the call fails as a local call does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis: LEVEE_FLEET_REDIS=host:port (fleet/tests/run.sh runs it)"]
async fn a_key_longer_than_the_bound_never_reaches_the_store() {
    let url = redis_url();
    flush(&url);
    let levee = Levee::from_str(DOC).unwrap();
    let (f, _) = fleet(&levee, "rust-a", &url).await;
    assert!(f.is_up());
    let long = "q".repeat(levee::constants::GUARD_MAX_KEY_BYTES as usize + 1);
    for policy in ["strict", "dep", "count"] {
        let e = f.run(policy, &long, |_| async { Ok::<_, std::io::Error>(()) }).await.unwrap_err();
        assert_eq!(e.key_too_long, Some(levee::KeyTooLong { bytes: long.len() }), "{policy}");
    }
    assert!(!f.sync("count", &long).await);
    let c = redis::Client::open(url.as_str()).unwrap();
    let mut conn = c.get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*qqqq*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "{} store keys name the long key", keys.len());
    f.close().await;
}
