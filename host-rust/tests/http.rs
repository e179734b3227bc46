//! End to end against a real HTTP server on 127.0.0.1, through the reqwest client wrapper,
//! the reqwest-middleware middleware and the tower layer, on the default backend.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::time::{Duration, Instant, SystemTime};

use common::{dead_port, recorder, Resp, Server};
use levee::client::{Client, Middleware};
use levee::core::{BreakerState, Reason};
use levee::{Backend, LeveeError, Outcome};

const DOC: &str = r#"
policies:
  flaky:
    attempts: 3
    attempt-timeout: 2s
    backoff: {base: 10ms, cap: 40ms}
  throttled:
    attempts: 2
    attempt-timeout: 2s
    backoff: {base: 10ms, cap: 40ms}
  slow:
    attempts: 2
    attempt-timeout: 100ms
    backoff: {base: 10ms, cap: 20ms}
  dead:
    attempts: 1
    attempt-timeout: 1s
    breaker:
      window: {kind: count, size: 4}
      minimum-calls: 4
      failure-rate: 50
      open-duration: 300ms
      half-open-permits: 1
  fb:
    attempts: 2
    attempt-timeout: 1s
    backoff: {base: 5ms, cap: 10ms}
    fallbacks:
      - {name: cached, on: [retries-exhausted]}
"#;

fn levee() -> levee::Levee {
    // The default backend: the component, or levee-core with `--features native` (ci.sh
    // runs this file both ways).
    let l = levee::Levee::builder().seed(7).load(DOC).expect("the document loads");
    assert_eq!(l.backend(), Backend::DEFAULT);
    l
}

fn client(l: &levee::Levee, policy: &str) -> Client {
    Client::new(reqwest::Client::new(), l.clone(), policy).expect("a policy of the document")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_then_a_200_is_retried_to_success() {
    let server = Server::start(|_, n| if n == 1 { Resp::status(503) } else { Resp::status(200) }).await;
    let l = levee();
    let c = client(&l, "flaky");
    let resp = c.send(c.get(server.url("/flaky"))).await.expect("a response");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.hits("/flaky"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_in_seconds_waits_that_long() {
    let server = Server::start(|_, n| if n == 1 { Resp::status(429).header("Retry-After", "1") } else { Resp::status(200) }).await;
    let l = levee();
    let c = client(&l, "throttled");
    let t0 = Instant::now();
    let resp = c.send(c.get(server.url("/seconds"))).await.expect("a response");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.hits("/seconds"), 2);
    assert!(t0.elapsed() >= Duration::from_millis(950), "the retry waited only {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_as_an_http_date_waits_until_then() {
    let server = Server::start(|_, n| {
        if n == 1 {
            let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(2));
            Resp::status(429).header("Retry-After", &at)
        } else {
            Resp::status(200)
        }
    })
    .await;
    let l = levee();
    let c = client(&l, "throttled");
    let t0 = Instant::now();
    let resp = c.send(c.get(server.url("/date"))).await.expect("a response");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.hits("/date"), 2);
    // Whole seconds on both sides: the date is 1 to 2 s ahead when the core reads it.
    assert!(t0.elapsed() >= Duration::from_millis(900), "the retry waited only {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_is_never_retried() {
    let server = Server::start(|_, _| Resp::status(400)).await;
    let l = levee();
    let c = client(&l, "flaky");
    let resp = c.send(c.get(server.url("/bad"))).await.expect("the 400 comes back as a response");
    assert_eq!(resp.status(), 400);
    assert_eq!(server.hits("/bad"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_responses_hit_the_per_attempt_timeout() {
    let server = Server::start(|_, _| Resp::status(200).delay(Duration::from_secs(3))).await;
    let l = levee();
    let c = client(&l, "slow");
    let t0 = Instant::now();
    let err: LeveeError<reqwest::Error> = c.send(c.get(server.url("/slow"))).await.expect_err("every attempt times out");
    assert_eq!(err.reason, Reason::RetriesExhausted);
    assert_eq!(err.attempts, 2);
    assert!(t0.elapsed() < Duration::from_secs(3), "the timeout did not cut the attempts: {:?}", t0.elapsed());
    // Both attempts reached the server.
    for _ in 0..100 {
        if server.hits("/slow") == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.hits("/slow"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_port_trips_the_breaker_which_recovers_through_half_open() {
    let rec = recorder();
    let port = dead_port();
    let key = format!("127.0.0.1:{port}");
    let l = levee();
    let c = client(&l, "dead");
    let url = format!("http://127.0.0.1:{port}/up");
    for _ in 0..4 {
        let err = c.send(c.get(&url)).await.expect_err("nobody listens");
        assert_eq!(err.reason, Reason::RetriesExhausted);
        assert!(err.last.as_ref().is_some_and(|e| e.is_connect()), "{err:?}");
    }
    assert_eq!(l.breaker_state("dead", &key), Some(BreakerState::Open));
    let err = c.send(c.get(&url)).await.expect_err("the breaker is open");
    assert_eq!(err.reason, Reason::BreakerOpen);
    assert_eq!(err.attempts, 0);
    assert!(err.is_rejected());
    assert!(err.retry_after.is_some_and(|d| d <= Duration::from_millis(300)), "{:?}", err.retry_after);

    // The port comes back; after the open duration a half-open probe closes the breaker.
    let server = Server::start_on(port, |_, _| Resp::status(200)).await;
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(l.breaker_state("dead", &key), Some(BreakerState::HalfOpen));
    let resp = c.send(c.get(&url)).await.expect("the probe goes through");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.hits("/up"), 1);
    assert_eq!(l.breaker_state("dead", &key), Some(BreakerState::Closed));
    let labels =
        |from: &str, to: &str| format!("levee.breaker.transitions{{levee.breaker.from={from},levee.breaker.to={to},levee.policy=dead}}");
    assert_eq!(rec.counter(&labels("closed", "open")), 1);
    assert_eq!(rec.counter(&labels("open", "half-open")), 1);
    assert_eq!(rec.counter(&labels("half-open", "closed")), 1);
    assert_eq!(rec.gauge(&format!("levee.breaker.state{{levee.key={key},levee.policy=dead}}")), Some(0.0));
    assert!(rec.counter("levee.rejections{levee.policy=dead,levee.reason=breaker-open}") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_is_used_and_reported() {
    let rec = recorder();
    let server = Server::start(|_, _| Resp::status(503)).await;
    let l = levee();
    let http = reqwest::Client::new();
    let url = server.url("/fb");
    let fetch = |_a: levee::Attempt| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let r = http.get(&url).send().await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.text().await?))
        }
    };
    let classify = |r: &Result<(u16, String), reqwest::Error>| match r {
        Ok((status, _)) => Outcome::http(*status),
        Err(e) => levee::IntoOutcome::outcome(e),
    };
    let got = l
        .call("fb")
        .key("origin")
        .fallback("cached", |ctx| async move {
            assert_eq!(ctx.reason, Reason::RetriesExhausted);
            assert_eq!(ctx.attempts, 2);
            Ok((200, "from cache".to_string()))
        })
        .run_classified(classify, fetch)
        .await
        .expect("the fallback answers");
    assert_eq!(got, (200, "from cache".to_string()));
    assert_eq!(server.hits("/fb"), 2);
    assert_eq!(rec.counter("levee.fallbacks{levee.fallback=cached,levee.policy=fb,levee.reason=retries-exhausted}"), 1);
    assert_eq!(rec.counter("levee.retries{levee.policy=fb}"), 1);

    // A fallback registered on the handle serves calls that bring none.
    l.register_fallback("cached", |_ctx| async { Ok::<_, reqwest::Error>((200u16, "registered".to_string())) });
    let got = l.call("fb").key("origin").run_classified(classify, fetch).await.expect("the registered fallback answers");
    assert_eq!(got.1, "registered");
    assert_eq!(rec.counter("levee.fallbacks{levee.fallback=cached,levee.policy=fb,levee.reason=retries-exhausted}"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reqwest_middleware_retries_and_reports_refusals() {
    let server = Server::start(|path, n| match path {
        "/mw" if n == 1 => Resp::status(502),
        "/mw" => Resp::status(200),
        _ => Resp::status(404),
    })
    .await;
    let l = levee();
    let c =
        reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l.clone(), "flaky").expect("known")).build();
    let resp = c.get(server.url("/mw")).send().await.expect("a response");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.hits("/mw"), 2);
    let resp = c.get(server.url("/missing")).send().await.expect("a 404 response");
    assert_eq!(resp.status(), 404);
    assert_eq!(server.hits("/missing"), 1);

    // A refusal is a LeveeError inside Error::Middleware.
    let port = dead_port();
    let c = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l.clone(), "dead").expect("known")).build();
    for _ in 0..4 {
        let _ = c.get(format!("http://127.0.0.1:{port}/")).send().await;
    }
    let err = c.get(format!("http://127.0.0.1:{port}/")).send().await.expect_err("open");
    let reqwest_middleware::Error::Middleware(e) = err else { panic!("expected a middleware error") };
    let levee_err = e.downcast_ref::<LeveeError<reqwest_middleware::Error>>().expect("a LeveeError");
    assert_eq!(levee_err.reason, Reason::BreakerOpen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tower_layer_retries_an_http_service() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use tower::{Layer, ServiceExt};

    let l = levee();
    let seen = Arc::new(AtomicU32::new(0));
    let s = seen.clone();
    let svc = tower::service_fn(move |req: http::Request<String>| {
        let n = s.fetch_add(1, Ordering::SeqCst) + 1;
        let mark = req.headers().get(levee::outcome::HEADER_ATTEMPT).map(|v| v.to_str().unwrap_or("").to_string());
        async move {
            assert_eq!(mark.as_deref(), Some(n.to_string().as_str()), "attempt {n} carries x-levee-attempt");
            assert_eq!(req.body(), "payload");
            let status = if n < 3 { 503 } else { 200 };
            Ok::<_, std::io::Error>(http::Response::builder().status(status).body(format!("try {n}")).expect("response"))
        }
    });
    let svc = levee::layer::LeveeLayer::new(l.clone(), "flaky").expect("known").layer(svc);
    let req = http::Request::builder().method("GET").uri("http://svc.local/x").body("payload".to_string()).expect("request");
    let resp = svc.clone().oneshot(req).await.expect("a response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(), "try 3");
    assert_eq!(seen.load(Ordering::SeqCst), 3);

    // POST is not idempotent by default: a 503 is not retried.
    let req = http::Request::builder().method("POST").uri("http://svc.local/x").body("payload".to_string()).expect("request");
    seen.store(0, Ordering::SeqCst);
    let resp = svc.oneshot(req).await.expect("the 503 comes back");
    assert_eq!(resp.status(), 503);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

/// Issue 39: one fallback name registered for the reqwest client's result and for a tower
/// layer's: each integration runs its own (the second registration replaced the first, and
/// the client then fell through to its last 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_fallback_name_serves_the_client_and_the_tower_layer() {
    use tower::{Layer, ServiceExt};

    let server = Server::start(|_, _| Resp::status(503)).await;
    let l = levee();
    l.register_fallback("cached", |_ctx| async { Ok::<_, reqwest::Error>(response(200, "cached for reqwest")) });
    l.register_fallback("cached", |_ctx| async {
        Ok::<_, std::io::Error>(http::Response::builder().status(200).body("cached for tower".to_string()).expect("response"))
    });
    let c = client(&l, "fb");
    let resp = c.send(c.get(server.url("/a"))).await.expect("the reqwest fallback's response");
    assert_eq!(resp.text().await.expect("a body"), "cached for reqwest");

    let svc = tower::service_fn(|_req: http::Request<String>| async {
        Ok::<_, std::io::Error>(http::Response::builder().status(503).body(String::new()).expect("response"))
    });
    let svc = levee::layer::LeveeLayer::new(l.clone(), "fb").expect("known").layer(svc);
    let req = http::Request::builder().uri("http://svc.local/x").body(String::new()).expect("request");
    let resp = svc.oneshot(req).await.expect("the tower fallback's response");
    assert_eq!(resp.body(), "cached for tower");
}

/// Issue 39: every instrument is described to the `metrics` recorder with the unit and the
/// description of the contract (`wit/constants.json`, generated as `INSTRUMENTS`), so that a
/// Prometheus exporter publishes seconds and `# HELP`. There was no `describe_*` call at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instrument_is_described_from_the_contract() {
    let rec = recorder();
    let l = levee();
    let r = l.call::<u8, std::io::Error>("flaky").key("describe").run(|_| async { Ok(1) }).await;
    assert_eq!(r.expect("a success"), 1);
    assert_eq!(levee::constants::INSTRUMENTS.len(), levee::constants::INSTRUMENTS.iter().filter(|i| i.0.starts_with("levee.")).count());
    for (name, kind, unit, help) in levee::constants::INSTRUMENTS {
        let (got_kind, got_unit, got_help) = rec.description(name).unwrap_or_else(|| panic!("{name} was never described"));
        let want_unit = match unit {
            "s" => Some(metrics::Unit::Seconds),
            "1" => None,
            _ => Some(metrics::Unit::Count),
        };
        assert_eq!((got_kind, got_unit, got_help.as_str()), (kind, want_unit, help), "{name}");
    }
    let (_, unit, _) = rec.description(levee::constants::METRIC_ATTEMPT_DURATION).expect("described");
    assert_eq!(unit, Some(metrics::Unit::Seconds));
}

// ---------------------------------------------------------------- what an attempt covers (docs/http.md)

const BODY_DOC: &str = r#"
policies:
  deadline:
    attempts: 3
    deadline: 2s
    backoff: { kind: constant, base: 10ms, jitter: none }
  retry:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_covers_the_body() {
    // 50 bytes, one every 200 ms: 10 s of body under a 2 s deadline.
    let server = Server::start(|_, _| Resp::status(200).body(&"x".repeat(50)).trickle(Duration::from_millis(200))).await;
    let l = levee::Levee::builder().seed(1).load(BODY_DOC).expect("loads");
    let c = Client::new(reqwest::Client::new(), l, "deadline").expect("known");
    let t0 = Instant::now();
    let r = c.send(c.get(server.url("/trickle"))).await;
    assert!(r.is_err(), "a late response: {:?}", r.map(|r| r.status()));
    assert!(t0.elapsed() < Duration::from_secs(3), "failed after {:?} under a 2 s deadline", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_mid_body_is_a_connection_error_retried() {
    let server =
        Server::start(|_, n| if n == 1 { Resp::status(200).body(&"y".repeat(1000)).cut() } else { Resp::status(200).body("whole") }).await;
    let l = levee::Levee::builder().seed(1).load(BODY_DOC).expect("loads");
    let c = Client::new(reqwest::Client::new(), l, "retry").expect("known");
    let resp = c.send(c.get(server.url("/cut"))).await.expect("retried to the whole body");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.url().path(), "/cut");
    assert_eq!(resp.text().await.expect("in memory"), "whole");
    assert_eq!(server.hits("/cut"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_middleware_reads_the_body_inside_the_attempt() {
    let server = Server::start(|path, n| match path {
        "/cut" if n == 1 => Resp::status(200).body(&"y".repeat(1000)).cut(),
        "/cut" => Resp::status(200).body("whole"),
        _ => Resp::status(200).body(&"x".repeat(50)).trickle(Duration::from_millis(200)),
    })
    .await;
    let l = levee::Levee::builder().seed(1).load(BODY_DOC).expect("loads");
    let c =
        reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l.clone(), "retry").expect("known")).build();
    let resp = c.get(server.url("/cut")).send().await.expect("retried to the whole body");
    assert_eq!(resp.text().await.expect("in memory"), "whole");
    assert_eq!(server.hits("/cut"), 2);
    let c = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l, "deadline").expect("known")).build();
    let t0 = Instant::now();
    assert!(c.get(server.url("/trickle")).send().await.is_err());
    assert!(t0.elapsed() < Duration::from_secs(3), "failed after {:?} under a 2 s deadline", t0.elapsed());
}

fn response(status: u16, body: &str) -> reqwest::Response {
    reqwest::Response::from(http::Response::builder().status(status).body(body.to_string()).expect("a response"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_runs_registered_fallbacks_and_keeps_the_last_503_without_one() {
    // Issue 14, item 7: the client never ran a registered fallback.
    let server = Server::start(|_, _| Resp::status(503)).await;
    let l = levee();
    let c = client(&l, "fb");
    // No fallback registered: the policy's chain has nothing to run, and the last 503 comes
    // back as the response (as reqwest returns it).
    let resp = c.send(c.get(server.url("/a"))).await.expect("the last 503");
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.text().await.expect("a body"), "status 503");
    assert_eq!(server.hits("/a"), 2);

    l.register_fallback("cached", |ctx: levee::FallbackContext| async move {
        assert_eq!((ctx.reason, ctx.attempts), (Reason::RetriesExhausted, 2));
        Ok::<_, reqwest::Error>(response(200, "from cache"))
    });
    let resp = c.send(c.get(server.url("/b"))).await.expect("the fallback's response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.expect("a body"), "from cache");
    assert_eq!(server.hits("/b"), 2);

    // The middleware runs the same registration.
    let m = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l.clone(), "fb").expect("known")).build();
    let resp = m.get(server.url("/c")).send().await.expect("the fallback's response");
    assert_eq!(resp.text().await.expect("a body"), "from cache");

    // A fallback that fails: the last 503 comes back, as without one.
    let l = levee();
    l.register_fallback("cached", |_ctx| async {
        Err::<reqwest::Response, _>(reqwest::Client::new().get("http://[::1").build().expect_err("a bad URL"))
    });
    let c = client(&l, "fb");
    let resp = c.send(c.get(server.url("/d"))).await.expect("the last 503");
    assert_eq!((resp.status().as_u16(), server.hits("/d")), (503, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_lets_a_post_be_retried() {
    // Issue 14, item 8: the client, the middleware and the tower layer ignored the header.
    let server = Server::start(|_, n| if n < 3 { Resp::status(503) } else { Resp::status(200) }).await;
    let l = levee();
    let c = client(&l, "flaky");
    let resp = c.send(c.post(server.url("/plain")).body("x")).await.expect("the 503");
    assert_eq!((resp.status().as_u16(), server.hits("/plain")), (503, 1));
    for (header, path) in [("Idempotency-Key", "/keyed"), ("X-Idempotency-Key", "/x-keyed")] {
        let resp = c.send(c.post(server.url(path)).header(header, "order-17").body("x")).await.expect("a response");
        assert_eq!((resp.status().as_u16(), server.hits(path)), (200, 3), "{header}");
    }
    // An empty key is no key.
    let resp = c.send(c.post(server.url("/empty")).header("Idempotency-Key", "").body("x")).await.expect("the 503");
    assert_eq!((resp.status().as_u16(), server.hits("/empty")), (503, 1));

    let m =
        reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(Middleware::new(l.clone(), "flaky").expect("known")).build();
    let resp = m.post(server.url("/mw")).header("Idempotency-Key", "k").body("x").send().await.expect("a response");
    assert_eq!((resp.status().as_u16(), server.hits("/mw")), (200, 3));

    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use tower::{Layer, ServiceExt};
    let seen = Arc::new(AtomicU32::new(0));
    let s = seen.clone();
    let svc = tower::service_fn(move |_req: http::Request<String>| {
        let n = s.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            Ok::<_, std::io::Error>(http::Response::builder().status(if n < 3 { 503 } else { 200 }).body(String::new()).expect("response"))
        }
    });
    let svc = levee::layer::LeveeLayer::new(l.clone(), "flaky").expect("known").layer(svc);
    let req = http::Request::builder()
        .method("POST")
        .uri("http://svc.local/x")
        .header("Idempotency-Key", "k")
        .body(String::new())
        .expect("request");
    let resp = svc.oneshot(req).await.expect("a response");
    assert_eq!((resp.status().as_u16(), seen.load(Ordering::SeqCst)), (200, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_policy_fails_where_it_is_named() {
    // Issue 14, item 19: `Client::new(..., "upstrem")` was accepted, and every request then
    // failed with `protocol error (unknown-policy)`.
    let l = levee();
    let e = Client::new(reqwest::Client::new(), l.clone(), "flaky-").expect_err("not a policy");
    assert_eq!(e.name, "flaky-");
    assert_eq!(e.known, ["flaky", "throttled", "slow", "dead", "fb"]);
    let text = e.to_string();
    assert_eq!(text, "no policy named `flaky-` in the document; did you mean `flaky`? (its policies: flaky, throttled, slow, dead, fb)");
    assert!(Middleware::new(l.clone(), "nope").is_err());
    assert!(levee::layer::LeveeLayer::new(l.clone(), "nope").is_err());
    assert!(l.policy("nope").is_err() && l.policy("fb").is_ok());
    // A call names its policy when it runs: the error lists the names too.
    let err = l.call::<(), std::io::Error>("upstrem").run(|_| async { Ok(()) }).await.expect_err("unknown");
    assert!(err.to_string().contains("no policy named `upstrem` in the document (its policies: flaky,"), "{err}");
    assert!(l.set_breaker_state("upstrem", "", BreakerState::ForcedOpen).is_err_and(|e| e.contains("its policies: flaky")));
}
