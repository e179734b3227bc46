//! Hedged calls end to end, beyond the host scenarios (tests/hosts.rs replays those, the tower
//! layer's and a stream body's among them): the reqwest client against a real server on
//! 127.0.0.1 (the losing request is aborted), a closure whose futures are neither `Send` nor
//! `'static`, an attempt lease holding a cancelled attempt open, the engine's table once a call
//! with cancelled attempts is over, and the recovery path on a trap of `hedge-step`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Resp, Server};
use levee::client::Client;
use levee::time::TokioClock;
use levee::{Backend, FaultOp, Levee};

#[derive(Debug)]
struct Boom;

impl std::fmt::Display for Boom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("boom")
    }
}

impl std::error::Error for Boom {}

impl levee::IntoOutcome for Boom {
    fn outcome(&self) -> levee::Outcome {
        levee::Outcome::error("Boom")
    }
}

/// Live calls the engine still has (each call id below `upto`).
fn live(l: &Levee, upto: u64) -> Vec<u64> {
    l.with_raw(|raw| (1..upto).filter(|c| raw.try_call_info(*c).ok().flatten().is_some()).collect())
}

/// The first request hangs; the hedge sent after 50 ms answers at once and wins. The first
/// request is aborted (the call does not wait for it), the server saw both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reqwest_client_hedges_and_aborts_the_slow_request() {
    let server =
        Server::start(
            |_, n| if n == 1 { Resp::status(200).delay(Duration::from_secs(20)).body("slow") } else { Resp::status(200).body("fast") },
        )
        .await;
    let l = Levee::builder().seed(1).load("policies:\n  h:\n    hedge: { attempts: 2, delay: 50ms }\n").unwrap();
    let c = Client::new(reqwest::Client::new(), l.clone(), "h").unwrap();
    let t0 = std::time::Instant::now();
    let resp = c.send(c.get(server.url("/r"))).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "fast");
    assert!(t0.elapsed() < Duration::from_secs(5), "the call waited for the slow request: {:?}", t0.elapsed());
    assert_eq!(server.hits("/r"), 2);
    assert!(live(&l, 3).is_empty(), "the call left the engine's table");
}

/// The attempts are futures of the call's own task: a closure whose futures hold an `Rc`
/// (not `Send`) and borrow a local (not `'static`) hedges like any other, on either backend.
#[tokio::test(start_paused = true)]
async fn attempts_need_not_be_send_or_static() {
    for backend in [Backend::Native, Backend::DEFAULT] {
        let l = Levee::builder()
            .seed(1)
            .backend(backend)
            .clock(TokioClock::paused())
            .load("policies:\n  h:\n    hedge: { attempts: 3, delay: 100ms }\n")
            .unwrap();
        let seen = Rc::new(std::cell::RefCell::new(Vec::new()));
        let local = String::from("borrowed");
        let t0 = tokio::time::Instant::now();
        let r = l
            .call::<String, Boom>("h")
            .run(|a| {
                let seen = seen.clone();
                let local = &local;
                async move {
                    seen.borrow_mut().push((a.number, t0.elapsed().as_millis()));
                    let wait = if a.number == 1 { 1_000 } else { 10 };
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    Ok(format!("{local} {}", a.number))
                }
            })
            .await;
        assert_eq!(r.unwrap(), "borrowed 2", "{backend:?}");
        // #2 at the delay; it wins at 110 ms, before #3 was due (200 ms).
        assert_eq!(*seen.borrow(), vec![(1, 0), (2, 100)], "{backend:?}");
        assert_eq!(t0.elapsed(), Duration::from_millis(110), "{backend:?}");
        assert!(live(&l, 2).is_empty(), "{backend:?}");
    }
}

/// An attempt's lease holds it open past its future: the call returns at once, and the core
/// hears of the cancelled attempt (its bulkhead slot is freed) only when the lease is dropped.
#[tokio::test(start_paused = true)]
async fn a_lease_holds_a_cancelled_attempt_open() {
    let doc = "policies:\n  h:\n    bulkhead: { max-concurrent: 2 }\n    hedge: { attempts: 2, delay: 100ms }\n  plain: {}\n";
    let l = Levee::builder().seed(1).clock(TokioClock::paused()).load(doc).unwrap();
    let leases: Arc<Mutex<Vec<levee::AttemptLease>>> = Arc::default();
    let kept = leases.clone();
    let r = l
        .call::<u32, Boom>("h")
        .run(|a| {
            let kept = kept.clone();
            async move {
                if a.number == 1 {
                    kept.lock().unwrap().push(a.lease().expect("a hedged attempt has a lease"));
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok(a.number)
            }
        })
        .await;
    assert_eq!(r.unwrap(), 2);
    // Attempt 1 was cancelled at 110 ms but is still open: the call and its slot stay.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(live(&l, 2), vec![1]);
    assert_eq!(l.with_raw(|raw| raw.try_call_info(1).unwrap().map(|i| i.in_flight)), Some(true));
    drop(std::mem::take(&mut *leases.lock().unwrap()));
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    assert!(live(&l, 2).is_empty(), "the lease dropped: the attempt is reported and the call leaves");
    // Outside a hedged attempt there is no lease.
    let r = l.call::<bool, Boom>("plain").run(|a| async move { Ok(a.lease().is_none()) }).await;
    assert!(r.unwrap(), "an attempt of a call that does not hedge has no lease");
}

/// A trap of `hedge-step` takes the one recovery path: attempt 1, already running with the
/// core's leave, goes on alone and its value is the call's; no hedge starts.
#[tokio::test(start_paused = true)]
async fn a_trap_of_hedge_step_leaves_attempt_one_alone() {
    let faults: Arc<Mutex<Vec<String>>> = Arc::default();
    let f2 = faults.clone();
    let l = Levee::builder()
        .seed(1)
        .clock(TokioClock::paused())
        .on_event(move |e, _| f2.lock().unwrap().push(format!("{:?}", e.kind)))
        .load("policies:\n  h:\n    hedge: { attempts: 3, delay: 100ms }\n")
        .unwrap();
    let starts: Arc<Mutex<Vec<u32>>> = Arc::default();
    let s2 = starts.clone();
    let r = l
        .call::<u32, Boom>("h")
        .hedge_fault(FaultOp::HedgeStep, 2, None)
        .run(move |a| {
            s2.lock().unwrap().push(a.number);
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(a.number)
            }
        })
        .await;
    assert_eq!(r.unwrap(), 1);
    assert_eq!(*starts.lock().unwrap(), vec![1]);
    assert_eq!(l.traps(), 1);
}
