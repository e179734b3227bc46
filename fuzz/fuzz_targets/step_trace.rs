//! Any sequence of protocol operations, well-formed or not: verdicts, never a panic, and the
//! invariants hold (bulkhead slots within bounds, budget tokens within bounds), for plain and
//! hedged calls (policy `h`: `hedge-step` and `report-attempt` of any attempt number) and
//! calls queued for a bulkhead slot (policy `q`, three keys through `keys.max: 2`: evictions of
//! keys with waiters; `take-wakes` names only calls the core knows).
#![no_main]
use levee_core::{Engine, OutcomeKind};
use libfuzzer_sys::fuzz_target;

const DOC: &str = "policies:\n  p:\n    attempts: 4\n    deadline: 2s\n    budget: { kind: token, max-tokens: 3 }\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 100ms, half-open-permits: 2 }\n    bulkhead: { max-concurrent: 2 }\n    rate-limit: { rate: 50, burst: 3, max-wait: 30ms }\n    fallbacks: [{ name: a, on: [any] }, b]\n    keys: { max: 2 }\n  h:\n    attempt-timeout: 50ms\n    deadline: 1s\n    hedge: { attempts: 4, delay: 20ms }\n    budget: { kind: token, max-tokens: 3 }\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 100ms }\n    bulkhead: { max-concurrent: 3 }\n    fallbacks: [a]\n    keys: { max: 2 }\n  q:\n    attempts: 3\n    deadline: 1s\n    backoff: { kind: constant, base: 15ms, jitter: none }\n    bulkhead: { max-concurrent: 2, queue: 3, queue-timeout: 50ms }\n    keys: { max: 2 }\n";

fuzz_target!(|data: &[u8]| {
    let Ok(mut e) = Engine::load(DOC, 7) else { return };
    let mut now = 0u64;
    for chunk in data.chunks(4) {
        let [op, call, arg, t] = [0, 1, 2, 3].map(|i| chunk.get(i).copied().unwrap_or(0));
        now = now.wrapping_add(u64::from(t) * 1_000_000);
        let call = u64::from(call % 8);
        let key = ["", "a", "b"][usize::from(arg / 3 % 3)]; // independent of the policy (arg % 3)
        match op % 9 {
            0 => {
                let _ = e.start(call, u32::from(arg % 3), key, u32::from(arg), now, 0, 0, 0);
            }
            1 => {
                let _ = e.acquire(call, now);
            }
            2 => {
                let kind = OutcomeKind::from_index(u32::from(arg % 6)).unwrap_or(OutcomeKind::Success);
                let _ = e.report(call, now, u64::from(t), kind, i32::from(arg) * 4, "1", 0, 0);
            }
            3 => {
                let _ = e.report_fallback(call, now, arg % 2 == 0);
            }
            4 => e.cancel(call, now),
            5 => {
                let _ = e.hedge_step(call, now);
            }
            6 => {
                let kind = OutcomeKind::from_index(u32::from(arg % 6)).unwrap_or(OutcomeKind::Success);
                let _ = e.report_attempt(call, u32::from(arg % 7), now, u64::from(t) * 1_000_000, kind, i32::from(arg) * 4, "2", 0, 0);
            }
            7 => {
                for woken in e.take_wakes() {
                    assert!(woken < 8, "take-wakes named call {woken}, which was never started");
                }
            }
            _ => {
                let _ = e.drain_events();
            }
        }
        for k in ["", "a", "b"] {
            assert!(e.in_flight(0, k) <= 2);
            assert!((0..=3000).contains(&e.budget_tokens(0, k).unwrap_or(0)));
            assert!(e.in_flight(1, k) <= 3);
            assert!((0..=3000).contains(&e.budget_tokens(1, k).unwrap_or(0)));
            assert!(e.in_flight(2, k) <= 2);
        }
    }
});
