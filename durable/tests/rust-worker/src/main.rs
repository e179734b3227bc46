//! The Rust durable worker of the crash tests (durable/tests/run.sh): it takes the arguments of
//! durable/tests/worker.py and writes the same log lines, so that the harness kills and resumes
//! Python, Go, JS and Rust workers alike.
//!
//! ```text
//! levee-durable-worker STORE --owner NAME --log FILE [--submit HANDLER[:KEY[:PAYLOAD]]]... [--die-after-outcome]
//!                [--until-idle] [--scale N] [--concurrency N] [--submit-only]
//! ```
//!
//! STORE is `sqlite:PATH` or `postgres:CONNINFO`. Handlers write `start CALL ATTEMPT PID WALL_NS`
//! and `end CALL ATTEMPT PID WALL_NS RESULT` to FILE (O_APPEND, one write per line).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use levee::durable::{Executor, PostgresStore, SqliteStore, Store};
use levee::{Levee, Outcome};

/// worker.py's DOC: the same policies, so that a record either wrote runs in both.
const DOC: &str = "
policies:
  flaky:
    attempts: 5
    attempt-timeout: 60s
    retry-on: [timeout, connection-error]
    backoff: { kind: constant, base: 3s, cap: 3s, jitter: none }
    durable: { lease: 2s, max-crashes: 3 }
  work:
    attempts: 10
    attempt-timeout: 10s
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    durable: { lease: 2s, max-crashes: 5 }
";

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The `work` handler's failures: what they stand for, and their text.
#[derive(Debug)]
struct WorkError(Outcome, String);

impl std::fmt::Display for WorkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl levee::IntoOutcome for WorkError {
    fn outcome(&self) -> Outcome {
        self.0.clone()
    }
}

/// The handlers' log: one `write` per line on an O_APPEND file keeps lines whole.
#[derive(Clone)]
struct Log(Arc<File>);

impl Log {
    fn line(&self, parts: &[&dyn std::fmt::Display]) {
        let mut s = parts.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" ");
        s.push('\n');
        let _ = (&*self.0).write_all(s.as_bytes());
    }
}

fn now() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

struct Args {
    store: String,
    owner: String,
    log: String,
    submits: Vec<String>,
    die_after_outcome: bool,
    until_idle: bool,
    scale: usize,
    concurrency: usize,
    submit_only: bool,
}

fn args() -> Result<Args, Error> {
    let mut it = std::env::args().skip(1);
    let store = it.next().ok_or("usage: levee-durable-worker STORE --owner NAME --log FILE ...")?;
    let mut a = Args {
        store,
        owner: String::new(),
        log: String::new(),
        submits: Vec::new(),
        die_after_outcome: false,
        until_idle: false,
        scale: 0,
        concurrency: 16,
        submit_only: false,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--owner" => a.owner = value()?,
            "--log" => a.log = value()?,
            "--submit" => a.submits.push(value()?),
            "--scale" => a.scale = value()?.parse()?,
            "--concurrency" => a.concurrency = value()?.parse()?,
            "--die-after-outcome" => a.die_after_outcome = true,
            "--until-idle" => a.until_idle = true,
            "--submit-only" => a.submit_only = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let a = args()?;
    let log = Log(Arc::new(OpenOptions::new().append(true).create(true).open(&a.log)?));
    let pid = std::process::id();
    let store: Store = match a.store.split_once(':') {
        Some(("sqlite", path)) => SqliteStore::open(path).await?.into(),
        Some(("postgres", conninfo)) => PostgresStore::connect(conninfo).await?.into(),
        _ => return Err(format!("unknown store {}", a.store).into()),
    };
    let mut b = Executor::builder(Levee::from_str(DOC)?, store)
        .owner(a.owner.clone())
        .poll_interval(Duration::from_millis(50))
        .claim_hold(Duration::from_secs(1))
        .concurrency(a.concurrency);
    if a.die_after_outcome {
        let log = log.clone();
        b = b.on_attempt_done(move |id, attempt, o: &Outcome| {
            log.line(&[&"outcome", &id, &attempt, &pid, &now(), &o.kind_name()]);
            // Between the outcome and its write: SIGKILL, as the other workers do.
            let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            std::thread::sleep(Duration::from_secs(10));
        });
    }
    let x = b.build();

    let l = log.clone();
    x.register("flaky", move |_payload, c| {
        let l = l.clone();
        async move {
            l.line(&[&"start", &c.id, &c.attempt, &pid, &now()]);
            if c.attempt == 1 {
                l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"timeout"]);
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the first attempt always times out"));
            }
            l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"ok"]);
            Ok("ok")
        }
    })?;
    let slow = |log: Log| {
        move |payload: Vec<u8>, c: levee::durable::DurableCall| {
            let l = log.clone();
            async move {
                l.line(&[&"start", &c.id, &c.attempt, &pid, &now()]);
                let secs: f64 = if c.attempt == 1 { String::from_utf8_lossy(&payload).parse().unwrap_or(0.0) } else { 0.05 };
                tokio::time::sleep(Duration::from_secs_f64(secs.max(0.0))).await;
                l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"ok"]);
                Ok::<_, std::io::Error>("ok")
            }
        }
    };
    x.handler("slow").policy("flaky").register(slow(log.clone()))?;
    x.handler("slow-bare").policy("flaky").not_idempotent().register(slow(log.clone()))?;
    let l = log.clone();
    x.register("work", move |payload, c| {
        let l = l.clone();
        async move {
            l.line(&[&"start", &c.id, &c.attempt, &pid, &now()]);
            let n: u64 = String::from_utf8_lossy(&payload).parse().map_err(|e| WorkError(Outcome::error("ValueError"), format!("{e}")))?;
            tokio::time::sleep(Duration::from_millis(1)).await;
            if n.wrapping_mul(7).wrapping_add(u64::from(c.attempt)).is_multiple_of(10) {
                // about one call in ten fails once
                l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"fail"]);
                return Err(WorkError(Outcome::ConnectionError, "transient".into()));
            }
            if n % 1000 == 999 {
                // ten calls in 10,000 always fail with a non-retryable error
                l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"fatal"]);
                return Err(WorkError(Outcome::error("ValueError"), format!("call {n} is refused")));
            }
            l.line(&[&"end", &c.id, &c.attempt, &pid, &now(), &"ok"]);
            Ok("ok")
        }
    })?;

    for s in &a.submits {
        let (handler, rest) = s.split_once(':').unwrap_or((s, ""));
        let (key, payload) = rest.split_once(':').unwrap_or((rest, ""));
        let id = x.submit(handler, payload.as_bytes().to_vec(), Some(key)).await?;
        log.line(&[&"submitted", &id, &handler, &if key.is_empty() { "-" } else { key }, &pid, &now()]);
    }
    for i in 0..a.scale {
        x.submit("work", i.to_string().into_bytes(), Some(&format!("work-{i}"))).await?;
    }
    if a.scale > 0 {
        log.line(&[&"submitted-scale", &a.scale, &pid, &now()]);
    }
    log.line(&[&"ready", &a.owner, &pid, &now()]);
    if a.submit_only {
        return Ok(());
    }
    if a.until_idle {
        x.run_until_idle().await;
    } else {
        // Until SIGTERM, whose default action ends the process: the calls it was running stay
        // `running` in the store and are resumed once their lease lapses, as after a crash.
        x.run(std::future::pending()).await;
    }
    Ok(())
}
