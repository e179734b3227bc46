//! The bulkhead queue through the public API (docs/policy.md, "The queue"): calls the core
//! queues are parked, and woken only when the core grants them a slot (it names them in
//! `take-wakes`); the core decides who gets a slot and when a wait is over, a dropped waiter
//! leaves the queue, and none is lost under load: thousands of waiters on a small bulkhead
//! under tokio's paused clock, and hundreds under real time on a multi-threaded runtime (where
//! a lost wake-up shows as a call that waits its whole queue timeout). The cost of a release
//! does not grow with the queue: one woken call, one acquire.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, clippy::print_stdout)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use levee::core::Reason;
use levee::layer::LeveeLayer;
use levee::telemetry::{Attributes, Telemetry};
use levee::time::{Clock, TokioClock};
use levee::Levee;
use tower::{Layer, Service, ServiceExt};

const MS: u64 = 1_000_000;

/// Counts events by name.
#[derive(Default)]
struct Counts(Mutex<HashMap<String, u64>>);

impl Counts {
    fn get(&self, name: &str) -> u64 {
        self.0.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

struct Sink(Arc<Counts>);

impl Telemetry for Sink {
    fn event(&self, name: &str, _attributes: &Attributes<'_>) {
        *self.0 .0.lock().unwrap().entry(name.to_string()).or_default() += 1;
    }
    fn add(&self, _counter: &'static str, _value: u64, _attributes: &Attributes<'_>) {}
    fn record(&self, _histogram: &'static str, _value: f64, _attributes: &Attributes<'_>) {}
    fn gauge(&self, _gauge: &'static str, _value: f64, _attributes: &Attributes<'_>) {}
}

/// What the trace hook saw: the calls in the order they started, and the acquires of each.
#[derive(Default)]
struct Trace {
    started: Vec<u64>,
    acquires: HashMap<u64, u64>,
}

/// A handle on tokio's paused clock that records the trace and counts the events. Every time
/// in these tests is a whole number of milliseconds, so tokio's timers end on the exact
/// instant (`TokioClock::paused`'s exact sleeps move the clock themselves, which hundreds of
/// tasks doing at once would make late).
fn paused(doc: &str) -> (Levee, TokioClock, Arc<Mutex<Trace>>, Arc<Counts>) {
    let clock = TokioClock::new();
    let trace = Arc::new(Mutex::new(Trace::default()));
    let counts = Arc::new(Counts::default());
    let t = trace.clone();
    let levee = Levee::builder()
        .seed(7)
        .clock(clock)
        .telemetry(Sink(counts.clone()))
        .trace(move |s| {
            let mut t = t.lock().unwrap();
            match s.op {
                "start" => t.started.push(s.call),
                "acquire" => *t.acquires.entry(s.call).or_default() += 1,
                _ => {}
            }
        })
        .load(doc)
        .unwrap();
    (levee, clock, trace, counts)
}

/// Sleep `ns` (whole milliseconds) on tokio's clock.
async fn sleep_exact(ns: u64) {
    tokio::time::sleep(Duration::from_nanos(ns)).await;
}

/// The load test: `N` calls join a queue in front of `SLOTS` slots at once; each attempt takes
/// 10 ms and a waiter may wait 205 ms. The core serves them oldest first, `SLOTS` per 10 ms,
/// each the instant a report frees a slot (no polling: a call that were not woken would start
/// at its timeout or never), and rejects the rest at 205 ms with `bulkhead-full`; no call is
/// lost, and a queued call crosses into the engine once more only: when the core grants it a
/// slot, or when its wait ends.
#[tokio::test(start_paused = true)]
async fn thousands_of_waiters_on_a_small_bulkhead_are_served_in_order_or_time_out() {
    const N: usize = 3000;
    const SLOTS: u64 = 4;
    const ROUNDS: u64 = 21; // attempts start at 0, 10, .., 200 ms; the waits end at 205 ms
    let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 4, queue: 5000, queue-timeout: 205ms }\n";
    let (levee, clock, trace, counts) = paused(doc);
    let attempts: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let wall = Instant::now();
    let mut tasks = Vec::with_capacity(N);
    for i in 0..N {
        let (levee, attempts) = (levee.clone(), attempts.clone());
        tasks.push(tokio::spawn(async move {
            let r = levee
                .call::<usize, Infallible>("q")
                .run(|a| {
                    attempts.lock().unwrap().push((a.call, clock.now()));
                    async move {
                        sleep_exact(10 * MS).await;
                        Ok(i)
                    }
                })
                .await;
            (r, clock.now())
        }));
    }
    let (mut served, mut rejected) = (0u64, 0u64);
    for t in tasks {
        let (r, ended) = tokio::time::timeout(Duration::from_secs(60), t).await.expect("a call never ended").unwrap();
        match r {
            Ok(_) => served += 1,
            Err(e) => {
                assert_eq!((e.reason(), e.attempts), (Reason::BulkheadFull, 0), "{e}");
                assert_eq!(ended, 205 * MS, "rejected when its wait was over, by the core");
                rejected += 1;
            }
        }
    }
    let real = wall.elapsed();
    assert_eq!(served + rejected, N as u64, "every call ended");
    assert_eq!(served, SLOTS * ROUNDS);
    let trace = trace.lock().unwrap();
    let attempts = attempts.lock().unwrap();
    // Oldest first, each round the instant the previous one reported.
    let order: HashMap<u64, usize> = trace.started.iter().enumerate().map(|(i, c)| (*c, i)).collect();
    let mut by_order: Vec<(usize, u64)> = attempts.iter().map(|(c, at)| (order[c], *at)).collect();
    by_order.sort_unstable();
    for (n, (place, at)) in by_order.iter().enumerate() {
        assert_eq!(*place, n, "served out of order");
        assert_eq!(*at, (n as u64 / SLOTS) * 10 * MS, "call {place} started late");
    }
    // Only the named call is woken: each queued call acquires exactly once, granted or timed
    // out (a host waking every waiter on every report would make thousands acquire per round).
    let acquires: u64 = trace.acquires.values().sum();
    let most = trace.acquires.values().copied().max().unwrap_or(0);
    assert_eq!(most, 1, "a call acquired {most} times");
    assert_eq!(acquires, N as u64 - SLOTS, "one acquire per queued call");
    assert_eq!(counts.get("rejected"), rejected);
    // Every acquire follows a wait (the start's or an acquire's), and every wait is an event.
    assert_eq!(counts.get("rate-limit-wait"), acquires, "one wait event per park");
    println!(
        "queue load: {N} calls, {SLOTS} slots: {served} served, {rejected} timed out; {acquires} acquires ({:.1} per call, at most {most}); {:.0} ms real, {:.2} us per acquire",
        acquires as f64 / N as f64,
        real.as_secs_f64() * 1e3,
        real.as_secs_f64() * 1e6 / acquires as f64,
    );
}

/// Waiters dropped while they wait (tokio cancellation) leave the queue: the ones behind them
/// move up and are served as if the dropped ones had never queued; the waiters that stay are
/// all served, none waits past its turn.
#[tokio::test(start_paused = true)]
async fn dropped_waiters_free_their_places() {
    const N: u64 = 600;
    let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 2, queue: 1000, queue-timeout: 60s }\n";
    let (levee, clock, trace, _) = paused(doc);
    let attempts: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..N {
        let (levee, attempts) = (levee.clone(), attempts.clone());
        let run = async move {
            levee
                .call::<u64, Infallible>("q")
                .run(|a| {
                    attempts.lock().unwrap().push((a.call, clock.now()));
                    async move {
                        sleep_exact(10 * MS).await;
                        Ok(i)
                    }
                })
                .await
        };
        tasks.push(tokio::spawn(async move {
            if i % 3 == 2 {
                // Dropped while it waits: at 1..=N ms, long before its turn.
                tokio::select! {
                    r = run => Some(r),
                    () = sleep_exact((i + 1) * MS) => None,
                }
            } else {
                Some(run.await)
            }
        }));
    }
    let mut served = 0;
    for t in tasks {
        if let Some(r) = tokio::time::timeout(Duration::from_secs(3600), t).await.expect("a call never ended").unwrap() {
            r.unwrap();
            served += 1;
        }
    }
    // The first two run at once; of those that queue, every third is dropped.
    let kept = (0..N).filter(|i| i % 3 != 2).count() as u64;
    assert_eq!(served, kept);
    let trace = trace.lock().unwrap();
    let order: HashMap<u64, usize> = trace.started.iter().enumerate().map(|(i, c)| (*c, i)).collect();
    let mut starts: Vec<(usize, u64)> = attempts.lock().unwrap().iter().map(|(c, at)| (order[c], *at)).collect();
    starts.sort_unstable();
    assert_eq!(starts.len() as u64, kept, "a dropped waiter ran");
    for (n, (_, at)) in starts.iter().enumerate() {
        assert_eq!(*at, (n as u64 / 2) * 10 * MS, "the {n}th call served started late");
    }
}

/// Under real time on a multi-threaded runtime, with successes that the hot path holds back
/// while nothing is parked: every waiter is served, each soon after a slot frees. A lost
/// wake-up would leave a call waiting its whole queue timeout (30 s).
#[test]
fn no_wake_up_is_lost_across_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(async {
        const N: u64 = 400;
        let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 3, queue: 1000, queue-timeout: 30s }\n";
        let levee = Levee::builder().seed(3).load(doc).unwrap();
        let running = Arc::new(AtomicU64::new(0));
        let most = Arc::new(AtomicU64::new(0));
        let wall = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..N {
            let (levee, running, most) = (levee.clone(), running.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                // Some arrive while others wait, some while the queue is empty.
                tokio::time::sleep(Duration::from_micros(i % 50 * 40)).await;
                levee
                    .call::<u64, Infallible>("q")
                    .key("k")
                    .run(|_| {
                        let n = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        let running = running.clone();
                        async move {
                            if i % 2 == 0 {
                                tokio::task::yield_now().await;
                            } else {
                                tokio::time::sleep(Duration::from_micros(200)).await;
                            }
                            running.fetch_sub(1, Ordering::SeqCst);
                            Ok(i)
                        }
                    })
                    .await
            }));
        }
        for t in tasks {
            let r = tokio::time::timeout(Duration::from_secs(20), t).await.expect("a waiter was never woken").unwrap();
            r.unwrap();
        }
        let real = wall.elapsed();
        assert!(most.load(Ordering::SeqCst) <= 3, "the bulkhead let {} run", most.load(Ordering::SeqCst));
        assert!(real < Duration::from_secs(20), "{real:?}");
        println!("queue across threads: {N} calls through 3 slots in {:.0} ms", real.as_secs_f64() * 1e3);
    });
}

/// The tower layer: a request that finds the bulkhead full waits in the queue and is sent the
/// instant the running one's response is reported; dropping a waiting request's future takes
/// it out of the queue, and the one behind it moves up.
#[tokio::test(start_paused = true)]
async fn the_tower_layer_queues_requests() {
    let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 1s }\n";
    let (levee, clock, _, counts) = paused(doc);
    let sent: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let s = sent.clone();
    let svc = tower::service_fn(move |req: http::Request<String>| {
        s.lock().unwrap().push((req.uri().path().to_string(), clock.now()));
        async move {
            sleep_exact(50 * MS).await;
            Ok::<_, Infallible>(http::Response::new(String::new()))
        }
    });
    let layer = LeveeLayer::new(levee.clone(), "q").unwrap();
    let service = layer.layer(svc);
    let request = |path: &str| http::Request::builder().uri(format!("http://api.test{path}")).body(String::new()).unwrap();
    let send = |path: &'static str, after: u64| {
        let mut svc = service.clone();
        let req = request(path);
        async move {
            sleep_exact(after).await;
            svc.ready().await.unwrap().call(req).await.map(|r| r.status().as_u16())
        }
    };
    let a = tokio::spawn(send("/a", 0));
    let b = tokio::spawn(send("/b", MS));
    // Dropped at 20 ms while it waits.
    let fc = send("/c", 2 * MS);
    let c = tokio::spawn(async move {
        tokio::select! {
            r = fc => Some(r),
            () = sleep_exact(20 * MS) => None,
        }
    });
    let d = tokio::spawn(send("/d", 30 * MS));
    assert_eq!(a.await.unwrap().unwrap(), 200);
    assert_eq!(b.await.unwrap().unwrap(), 200);
    assert!(c.await.unwrap().is_none());
    assert_eq!(d.await.unwrap().unwrap(), 200);
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent, vec![("/a".into(), 0), ("/b".into(), 50 * MS), ("/d".into(), 100 * MS)]);
    // b and c queue; c's drop grants nothing (a waiter); d queues; a's report grants b, the
    // only one woken; b's report grants d. Nobody waits twice.
    assert_eq!(counts.get("rate-limit-wait"), 3);
    assert_eq!(counts.get("rejected"), 0);
}

/// The cost of a release, whatever the number of waiters: through the component (wasmtime),
/// `waiters` calls queue behind one slot; each release is the running call's report, then the
/// wakes: the old contract (every parked call acquires again) or the named one (`take-wakes`,
/// then the one named acquires); then one more call queues, so the queue keeps its length.
/// Returns ns per release (report, wakes, acquires) and ns per acquire crossing.
fn release_cost(waiters: u64, releases: u64, wake_all: bool) -> (f64, f64) {
    use levee::core::{OutcomeKind, VerdictKind};
    use levee::{Backend, Limits, RawEngine};
    let doc = "policies:\n  q:\n    attempts: 1\n    bulkhead: { max-concurrent: 1, queue: 100000, queue-timeout: 1h }\n";
    let mut e = RawEngine::load_with(Backend::Wasm, doc, 1, Limits::default()).unwrap();
    assert_eq!(e.start(1, 0, "", 0, 1, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    // The old contract's host keeps its parked calls in order; the named one by id.
    let mut queue: std::collections::VecDeque<u64> = (2..2 + waiters).collect();
    let mut parked: std::collections::HashSet<u64> = queue.iter().copied().collect();
    for &c in &queue {
        assert_eq!(e.start(c, 0, "", 0, 1, 0, 0, 0).kind(), Some(VerdictKind::Wait));
    }
    let (mut running, mut next, mut acquires) = (1u64, 2 + waiters, 0u64);
    let (mut in_release, mut in_acquire) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..releases {
        let t = Instant::now();
        let v = e.report(running, 2, 0, OutcomeKind::Success, 0, "", 0, 0);
        assert!(v.wakes_pending(), "a release with waiters names one");
        if wake_all {
            let _ = e.take_wakes();
            for _ in 0..queue.len() {
                let c = queue.pop_front().unwrap();
                acquires += 1;
                let a = Instant::now();
                let v = e.acquire(c, 3);
                in_acquire += a.elapsed();
                match v.kind() {
                    Some(VerdictKind::Attempt) => running = c,
                    Some(VerdictKind::Wait) => queue.push_back(c),
                    other => panic!("{other:?}"),
                }
            }
        } else {
            let woken = e.take_wakes();
            assert_eq!(woken.len(), 1, "one call named per release");
            running = woken[0];
            assert!(parked.remove(&running));
            acquires += 1;
            let a = Instant::now();
            let v = e.acquire(running, 3);
            in_acquire += a.elapsed();
            assert_eq!(v.kind(), Some(VerdictKind::Attempt), "a named call takes its slot");
        }
        in_release += t.elapsed();
        assert_eq!(e.start(next, 0, "", 0, 3, 0, 0, 0).kind(), Some(VerdictKind::Wait));
        queue.push_back(next);
        parked.insert(next);
        next += 1;
    }
    (in_release.as_secs_f64() * 1e9 / releases as f64, in_acquire.as_secs_f64() * 1e9 / acquires as f64)
}

/// Named wakes cost one acquire per release at 250, 1,000 and 4,000 waiters; waking every
/// waiter costs one per waiter. Prints both (docs/performance.md, "The core at production
/// load"): `cargo test --release -p levee-resilience --test queue release_cost -- --nocapture`.
#[test]
fn release_cost_does_not_grow_with_the_queue() {
    for waiters in [250u64, 1_000, 4_000] {
        let (named_release, named_acquire) = release_cost(waiters, 20_000, false);
        let (all_release, all_acquire) = release_cost(waiters, 50, true);
        println!(
            "queue release cost, {waiters} waiters: named {:.2} us per release, {:.2} us per woken acquire; wake-all {:.1} us per release, {:.2} us per acquire ({waiters} per release)",
            named_release / 1e3,
            named_acquire / 1e3,
            all_release / 1e3,
            all_acquire / 1e3,
        );
    }
}
