//! Property tests of durable call records: any bytes are an answer, never a panic; valid
//! records round-trip byte for byte; random traces with crashes keep the record's invariants.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_core::durable::{inspect, Action, DurableReason, Record, FLAG_NON_IDEMPOTENT};
use levee_core::{Engine, OutcomeKind};
use proptest::prelude::*;

const S: u64 = 1_000_000_000;
const DOC: &str = "policies:\n  p:\n    attempts: 5\n    deadline: 60s\n    attempt-timeout: 2s\n    durable: { lease: 10s, max-crashes: 3 }\n    backoff: { kind: exponential, base: 100ms, cap: 5s, jitter: full }\n";

fn engine() -> Engine {
    Engine::load(DOC, 11).unwrap()
}

fn valid_record(e: &mut Engine) -> Vec<u8> {
    e.durable_begin(0, "host-a", "idem", FLAG_NON_IDEMPOTENT, 1_700_000_000 * S).unwrap().record
}

#[derive(Clone, Debug)]
enum Op {
    /// A process takes the call up after `advance` ms of wall time (an owner of 0..3).
    Step { owner: u8, advance: u32, back: bool },
    /// The attempt's outcome (0 success, 1 timeout, 2 http 503 with Retry-After, 3 http 404, 4 error).
    Outcome { kind: u8, elapsed: u32 },
    /// The process dies (the record stays as it was last persisted).
    Crash { advance: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 0u32..20_000, any::<bool>()).prop_map(|(owner, advance, back)| Op::Step { owner, advance, back }),
        (0u8..5, 0u32..3_000).prop_map(|(kind, elapsed)| Op::Outcome { kind, elapsed }),
        (0u32..30_000).prop_map(|advance| Op::Crash { advance }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn any_record_bytes_are_an_answer_not_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), now in any::<u64>(), el in any::<u64>()) {
        let e = engine();
        let _ = inspect(&bytes);
        let _ = e.durable_step(&bytes, "w", now, el);
        let _ = e.durable_outcome(&bytes, "w", now, el, OutcomeKind::Timeout, 0, "", "", 0);
        let _ = e.durable_renew(&bytes, "w", now, el);
        let _ = e.durable_cancel(&bytes, now);
        let _ = e.durable_revive(&bytes, now);
    }

    #[test]
    fn mutated_records_are_refused_or_canonical(flip in 0usize..400, bit in 0u8..8, cut in 0usize..400) {
        let mut e = engine();
        let rec = valid_record(&mut e);
        let mut bad = rec.clone();
        let i = flip % bad.len();
        bad[i] ^= 1 << bit;
        // A flipped bit is caught (the checksum covers every byte; the magic and version are read first).
        prop_assert!(Record::decode(&bad).is_err());
        let short = &rec[..cut % rec.len()];
        prop_assert!(Record::decode(short).is_err());
        // Decode then encode is the identity on valid bytes.
        prop_assert_eq!(Record::decode(&rec).unwrap().encode(), rec);
    }

    #[test]
    fn traces_with_crashes_keep_the_record_invariants(ops in prop::collection::vec(op(), 1..60)) {
        let mut e = engine();
        let mut stored = valid_record(&mut e);
        let mut wall = 1_700_000_000 * S;
        let mut running: Option<(Vec<u8>, String)> = None;
        let mut last_attempt = 0u32;
        for op in ops {
            match op {
                Op::Step { owner, advance, back } => {
                    if back { wall = wall.saturating_sub(u64::from(advance) * 1_000_000) } else { wall += u64::from(advance) * 1_000_000 }
                    let owner = format!("w{owner}");
                    let Ok(s) = e.durable_step(&stored, &owner, wall, 0) else { continue };
                    let before = Record::decode(&stored).unwrap();
                    prop_assert!(s.wait <= 300 * S, "wait {} above the largest delay", s.wait);
                    let after = Record::decode(&s.record).unwrap();
                    prop_assert!(after.last_seen >= before.last_seen, "last-seen went back");
                    prop_assert!(after.attempts >= before.attempts && after.crashes >= before.crashes);
                    prop_assert!(after.attempts <= 5);
                    if s.action == Action::Run {
                        prop_assert_eq!(s.attempt, last_attempt + 1, "the attempt number continues");
                        last_attempt = s.attempt;
                        running = Some((s.record.clone(), owner));
                    }
                    if s.action == Action::Dead && after.crashes >= 3 {
                        prop_assert_eq!(s.reason, DurableReason::CrashLimit);
                    }
                    stored = s.record;
                }
                Op::Outcome { kind, elapsed } => {
                    // The store fences a stale writer: only the bytes it still holds get an outcome.
                    let Some((rec, owner)) = running.take().filter(|(r, _)| *r == stored) else { continue };
                    let (k, code, text) = match kind {
                        0 => (OutcomeKind::Success, 0, ""),
                        1 => (OutcomeKind::Timeout, 0, ""),
                        2 => (OutcomeKind::HttpStatus, 503, "1"),
                        3 => (OutcomeKind::HttpStatus, 404, ""),
                        _ => (OutcomeKind::ErrorClass, 0, "IOError"),
                    };
                    let s = e.durable_outcome(&rec, &owner, wall, u64::from(elapsed) * 1_000_000, k, code, text, "boom", 0).unwrap();
                    prop_assert!(matches!(s.action, Action::Wait | Action::Done | Action::Dead));
                    if s.action == Action::Wait {
                        prop_assert!(Record::decode(&s.record).unwrap().next_at <= Record::decode(&s.record).unwrap().deadline_at);
                    }
                    stored = s.record;
                }
                Op::Crash { advance } => {
                    running = None;
                    wall += u64::from(advance) * 1_000_000;
                }
            }
            let r = Record::decode(&stored).unwrap();
            prop_assert_eq!(r.encode(), stored.clone());
        }
    }
}
