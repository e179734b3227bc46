//! What a keyed call costs when the caller cycles over 1,000 keys of an N-key table rather than
//! calling one key (issue 41's calls ratio): `keycycle N CALLS native|wasm` fills N keys (k0,
//! k1, ...) with a success each, then makes CALLS calls (`start` and a success `report`) over
//! k0..k999 (over k0 when N = 1). Run under callgrind with CALLS = 0 and CALLS > 0, the
//! difference divided by CALLS is one call's instructions and cache misses
//! (docs/performance.md, "Python's calls ratio, in turns").
use levee::core::OutcomeKind;
use levee::{Backend, Limits, LoadErrors, RawEngine};
const DOC: &str = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(n), Some(calls), Some(backend)) = (args.next(), args.next(), args.next()) else {
        return Err("usage: keycycle N CALLS native|wasm".into());
    };
    let (n, calls): (u64, u64) = (n.parse()?, calls.parse()?);
    let b = if backend == "native" { Backend::Native } else { Backend::Wasm };
    let limits = Limits { checkpoint_interval: 0, call_ticks: u64::MAX / 2, ..Limits::default() };
    let mut e = RawEngine::load_with(b, DOC, 1, limits).map_err(LoadErrors)?;
    let mut t = 1_000u64;
    let mut id = 0u64;
    for i in 0..n {
        id += 1;
        t += 1;
        let key = format!("k{i}");
        e.try_start(id, 0, &key, 0, t, 0, 0, 0)?;
        e.try_report(id, t, 10, OutcomeKind::Success, 0, "", 0, 0)?;
    }
    let keys: Vec<String> = (0..n.min(1000)).map(|i| format!("k{i}")).collect();
    for c in 0..calls {
        id += 1;
        t += 1;
        let Some(key) = keys.get((c % keys.len() as u64) as usize) else { break };
        e.try_start(id, 0, key, 0, t, 0, 0, 0)?;
        e.try_report(id, t, 10, OutcomeKind::Success, 0, "", 0, 0)?;
    }
    Ok(())
}
