//! Runs one policy against a URL through `levee::client::Client` (reqwest) and prints every
//! decision of the core, one line per step.
//!
//! ```text
//! levee-example-reqwest [--policy-file FILE] [--policy NAME] [--seed N] [--native] URL
//! ```

use std::time::Duration;

use levee::core::{Verdict, VerdictKind};
use levee::{Backend, Levee, Outcome, Step};

const DEFAULT_DOC: &str = include_str!("../policy.yaml");

fn describe(v: Verdict) -> String {
    match v.kind() {
        Some(VerdictKind::Attempt) => {
            let t = if v.payload() > 0 { format!("{:?}", Duration::from_nanos(v.payload())) } else { "none".into() };
            format!("attempt #{} (timeout {t})", v.detail())
        }
        Some(VerdictKind::Wait) => format!("wait {:?} ({})", Duration::from_nanos(v.payload()), v.reason()),
        Some(VerdictKind::Retry) => format!("retry after {:?}", Duration::from_nanos(v.payload())),
        Some(VerdictKind::Done) => "done".into(),
        Some(VerdictKind::Fallback) => format!("fallback #{} ({})", v.payload(), v.reason()),
        Some(VerdictKind::Fail) => format!("fail: {}", v.reason()),
        _ => format!("invalid (code {})", v.detail()),
    }
}

fn outcome(o: &Outcome) -> String {
    match o {
        Outcome::Http { status, retry_after, .. } if !retry_after.is_empty() => format!("http {status} (Retry-After {retry_after:?})"),
        Outcome::Http { status, .. } => format!("http {status}"),
        Outcome::Error(class) => format!("error {class}"),
        other => other.parts().0.name().to_string(),
    }
}

fn trace(s: &Step<'_>) {
    static STEP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    let at = Duration::from_micros(s.now / 1000);
    match (s.op, s.outcome, s.verdict) {
        ("hold-success", Some(o), _) => {
            println!("rust step {n} t={at:?} call={} report {} -> done (success held back, settled on the next start)", s.call, outcome(o))
        }
        (op, Some(o), Some(v)) => println!("rust step {n} t={at:?} call={} {op} {} -> {}", s.call, outcome(o), describe(v)),
        (op, _, Some(v)) => println!("rust step {n} t={at:?} call={} {op} -> {}", s.call, describe(v)),
        (op, _, None) => println!("rust step {n} t={at:?} call={} {op}", s.call),
    }
}

fn usage() -> ! {
    eprintln!("usage: levee-example-reqwest [--policy-file FILE] [--policy NAME] [--seed N] [--native] URL");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (mut file, mut policy, mut seed, mut backend, mut url) = (None, "demo".to_string(), 1u64, Backend::DEFAULT, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--policy-file" | "-policy-file" => file = Some(args.next().unwrap_or_else(|| usage())),
            "--policy" | "-policy" => policy = args.next().unwrap_or_else(|| usage()),
            "--seed" | "-seed" => seed = args.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| usage()),
            "--native" => backend = Backend::Native,
            _ if url.is_none() && !a.starts_with('-') => url = Some(a),
            _ => usage(),
        }
    }
    let Some(url) = url else { usage() };
    let doc = match file {
        Some(f) => std::fs::read_to_string(&f).unwrap_or_else(|e| {
            eprintln!("{f}: {e}");
            std::process::exit(2)
        }),
        None => DEFAULT_DOC.to_string(),
    };
    let levee = Levee::builder()
        .seed(seed)
        .backend(backend)
        .trace(trace)
        .on_event(|e, _policy| {
            println!(
                "rust event {} reason={} attempt={} duration={:?} {}",
                e.kind,
                e.reason,
                e.attempt,
                Duration::from_nanos(e.duration),
                e.name
            )
        })
        .load(&doc)
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(1)
        });
    println!("rust backend {}", levee.backend());
    let client = levee::client::Client::new(reqwest::Client::new(), levee.clone(), &policy).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    match client.send(client.get(&url)).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let n = resp.bytes().await.map(|b| b.len()).unwrap_or(0);
            // Send the held-back success so that its events print too.
            levee.with_raw(|_| ());
            println!("rust result http {status} ({n} bytes)");
        }
        Err(e) => {
            println!("rust result error: {e}");
            std::process::exit(1)
        }
    }
}
