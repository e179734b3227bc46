//! One Rust process of the fleet test (fleet/tests/run.sh, feature `fleet-redis`): runs a
//! scenario against the shared Redis from a common wall-clock start and prints one JSON line
//! of counts, as the Python and Go workers do (fleet/tests/worker.py, cmd/fleet-worker).
//!
//! `fleet-worker --policies FILE --addr HOST:PORT --node NAME --start UNIX_SECONDS
//!  [--seconds S] [--bad FROM:TO] [--failures N] MODE`, MODE one of `rate`, `rate-strict`,
//! `breaker`, `steady`, `records`, `bench` (the cost per call of fleet/tests/bench.yaml).
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use levee::core::Reason;
use levee::fleet::Fleet;
use levee::Levee;
use serde_json::{json, Map, Value};

struct Args {
    mode: String,
    addr: String,
    node: String,
    start: f64,
    seconds: f64,
    bad: (f64, f64),
    failures: u32,
    policies: String,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        mode: String::new(),
        addr: String::new(),
        node: "rust".into(),
        start: 0.0,
        seconds: 10.0,
        bad: (-1.0, -1.0),
        failures: 0,
        policies: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        let num = |s: String| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
        match arg.as_str() {
            "--addr" => a.addr = val()?,
            "--node" => a.node = val()?,
            "--policies" => a.policies = val()?,
            "--start" => a.start = num(val()?)?,
            "--seconds" => a.seconds = num(val()?)?,
            "--failures" => a.failures = val()?.parse().map_err(|e| format!("--failures: {e}"))?,
            "--bad" => {
                let v = val()?;
                let (from, to) = v.split_once(':').ok_or("--bad is FROM:TO")?;
                a.bad = (num(from.to_string())?, num(to.to_string())?);
            }
            m if !m.starts_with("--") => a.mode = m.to_string(),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(a)
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

async fn sleep_until(at: f64) {
    let left = at - unix_now();
    if left > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(left)).await;
    }
}

#[derive(Default, Clone, Copy)]
struct Phase {
    ok: u64,
    open: u64,
    failed: u64,
    invoked: u64,
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => fail(&e),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => fail(&e.to_string()),
    };
    match rt.block_on(run(args)) {
        Ok(out) => println!("{out}"),
        Err(e) => fail(&e),
    }
}

fn fail(e: &str) -> ! {
    eprintln!("fleet-worker: {e}");
    std::process::exit(1)
}

async fn run(a: Args) -> Result<Value, String> {
    let quorum = Arc::new(AtomicU64::new(0));
    let q = quorum.clone();
    let levee = Levee::builder()
        .on_event(move |e, _policy| {
            if e.name == "fleet-quorum" {
                q.fetch_add(1, Ordering::Relaxed);
            }
        })
        .load_file(&a.policies)
        .map_err(|e| e.to_string())?;
    let events = Arc::new(Mutex::new(Vec::<String>::new()));
    let ev = events.clone();
    let fleet = Fleet::builder(&levee)
        .node(a.node.clone())
        .on_event(move |e| ev.lock().unwrap_or_else(|p| p.into_inner()).push(e.kind.name().to_string()))
        .connect(&format!("redis://{}/0", a.addr))
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Map::new();
    out.insert("node".into(), a.node.clone().into());
    out.insert("lang".into(), "rust".into());
    out.insert("mode".into(), a.mode.clone().into());
    match a.mode.as_str() {
        "bench" => {
            out.insert("ns_per_call".into(), bench(&levee, &fleet).await?);
        }
        "records" => {
            for _ in 0..a.failures {
                let _ = fleet.run("count", "k", |_| async { Err::<(), _>(std::io::Error::other("recorded failure")) }).await;
            }
            sleep_until(a.start).await;
            for _ in 0..50 {
                fleet.sync("count", "k").await;
            }
            out.insert("conflicts".into(), fleet.conflicts().into());
            out.insert("publications".into(), fleet.publications().into());
        }
        "rate" | "rate-strict" | "breaker" | "steady" => scenario(&a, &fleet, &mut out).await,
        other => return Err(format!("unknown mode {other:?}")),
    }
    fleet.close().await;
    out.insert("quorum_events".into(), quorum.load(Ordering::Relaxed).into());
    out.insert("fleet_events".into(), events.lock().unwrap_or_else(|p| p.into_inner()).clone().into());
    Ok(out.into())
}

async fn scenario(a: &Args, fleet: &Fleet, out: &mut Map<String, Value>) {
    let policy = match a.mode.as_str() {
        "rate" => "rate",
        "rate-strict" => "rate-strict",
        _ => "dep",
    };
    let paced = matches!(a.mode.as_str(), "breaker" | "steady");
    let (mut ok, mut limited, mut open, mut failed, mut errors, mut invoked) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut phases: BTreeMap<String, Phase> = BTreeMap::new();
    let mut samples: Vec<String> = Vec::new();
    // How late this process was for the common start (loading the engine compiles the component).
    out.insert("late_ms".into(), ((unix_now() - a.start).max(0.0) * 1000.0).round().into());
    sleep_until(a.start).await;
    let end = a.start + a.seconds;
    loop {
        let now = unix_now();
        if now >= end {
            break;
        }
        let t = now - a.start;
        let failing = a.bad.0 <= t && t < a.bad.1;
        let ran = std::cell::Cell::new(false);
        let r = fleet
            .run(policy, "k", |_| {
                ran.set(true);
                async move {
                    if failing {
                        Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "the dependency is down"))
                    } else {
                        Ok(1u32)
                    }
                }
            })
            .await;
        let phase = phases.entry((t as u64).to_string()).or_default();
        if ran.get() {
            invoked += 1;
            phase.invoked += 1;
        }
        match r {
            Ok(_) => {
                ok += 1;
                phase.ok += 1;
            }
            Err(e) if e.reason == Reason::RateLimited => {
                limited += 1;
                let hint = e.retry_after.unwrap_or_default();
                tokio::time::sleep(hint.clamp(Duration::from_millis(1), Duration::from_millis(5))).await;
            }
            Err(e) if e.reason == Reason::BreakerOpen => {
                open += 1;
                phase.open += 1;
            }
            Err(e) if e.invalid.is_none() && e.trap.is_none() => {
                failed += 1;
                phase.failed += 1;
            }
            Err(e) => {
                errors += 1;
                if samples.len() < 5 {
                    samples.push(format!("{:?} {:?}", e.reason, e.invalid));
                }
            }
        }
        if paced {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // `invoked` counts attempts: with `attempts: 1` one per call that ran.
    let phases: Map<String, Value> =
        phases.into_iter().map(|(k, p)| (k, json!({"ok": p.ok, "open": p.open, "failed": p.failed, "invoked": p.invoked}))).collect();
    out.insert("ok".into(), ok.into());
    out.insert("limited".into(), limited.into());
    out.insert("open".into(), open.into());
    out.insert("failed".into(), failed.into());
    out.insert("errors".into(), errors.into());
    out.insert("invoked".into(), invoked.into());
    out.insert("phases".into(), phases.into());
    out.insert("error_samples".into(), samples.into());
    out.insert("conflicts".into(), fleet.conflicts().into());
    out.insert("publications".into(), fleet.publications().into());
}

/// The cost of one call per policy of fleet/tests/bench.yaml: the best of 3 rounds of 0.5 s
/// (the machine is shared: the best round is the cost).
async fn bench(levee: &Levee, fleet: &Fleet) -> Result<Value, String> {
    let mut res = Map::new();
    for name in ["local", "async", "lease", "strict-rate", "strict"] {
        let once = || async {
            let r = if name == "local" {
                levee.call(name).key("k").run(|_| async { Ok::<_, std::io::Error>(()) }).await
            } else {
                fleet.run(name, "k", |_| async { Ok::<_, std::io::Error>(()) }).await
            };
            r.map_err(|e| format!("{name}: {:?}", e.reason))
        };
        for _ in 0..200 {
            once().await?;
        }
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let (mut n, start) = (0u64, Instant::now());
            while start.elapsed() < Duration::from_millis(500) {
                once().await?;
                n += 1;
            }
            best = best.min(start.elapsed().as_nanos() as f64 / n.max(1) as f64);
        }
        res.insert(name.to_string(), best.into());
    }
    Ok(res.into())
}
