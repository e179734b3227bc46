//! What loading a policy document costs: `loadtime N REPS native|wasm` builds a document of N
//! policies (retries, backoff, a breaker, retry rules; about 230 bytes each) and loads it REPS
//! times. Run under callgrind with REPS = 1 and REPS > 1, the difference divided by REPS - 1 is
//! one load's instructions (docs/performance.md, "One sort for the cold paths").
use levee::{Backend, Limits, LoadErrors, RawEngine};
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(n), Some(reps), Some(backend)) = (args.next(), args.next(), args.next()) else {
        return Err("usage: loadtime N REPS native|wasm".into());
    };
    let (n, reps): (usize, usize) = (n.parse()?, reps.parse()?);
    let b = if backend == "native" { Backend::Native } else { Backend::Wasm };
    let mut doc = String::from("policies:\n");
    for i in 0..n {
        doc.push_str(&format!(
            "  p{i}:\n    attempts: 4\n    backoff: {{ kind: exponential, base: 100ms, cap: 10s, jitter: full }}\n    \
             breaker: {{ window: {{ kind: count, size: 20 }}, minimum-calls: 10, failure-rate: 0.5, open-duration: 30s }}\n    \
             retry-on: [timeout, connection-error, 503]\n"
        ));
    }
    for _ in 0..reps {
        drop(RawEngine::load_with(b, &doc, 1, Limits::default()).map_err(LoadErrors)?);
    }
    Ok(())
}
