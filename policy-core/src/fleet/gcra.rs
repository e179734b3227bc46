//! The fleet's GCRA: the core's rate limiter ([`crate::rate`]) with a cost, as the store's
//! Lua script (`fleet/lua/gcra.lua`) evaluates it on the store's clock. This function is the
//! reference the script is tested against (`fleet/tests/gcra-cases.json`, replayed through a
//! real Redis by `fleet/tests/run.sh`).
//!
//! With emission interval `T`, burst `b`, cost `c` and `t = max(TAT, now)`: the request is
//! admitted when `t + T*c - T*b <= now`, and then `TAT = t + T*c`. For `c = 1` that is the
//! core's `max(TAT, now) - T*(b-1) <= now`: a fresh bucket admits exactly `b` at once. When it
//! is not admitted, `allow_at - now` is how long until it would be: the answer is *wait*
//! (reserving the tokens, so waiters are served in order) if that is at most `max-wait`, else
//! *reject* with that time as the retry-after hint. A `now` earlier than the stored TAT's
//! reference is no problem: `max` makes a stale clock mint nothing.
//!
//! `upto` (the async mode's leases) takes as many tokens as are free, at most `c`; with none
//! free it answers as a request for one token would.
//!
//! go-redis/redis_rate writes the same test as `remaining = floor((now - (new - T*b)) / T +
//! 0.5) >= 0`, which admits up to half an interval early; its burst count is the same as ours
//! (`b`, not ITU-T's `b + 1` for a limit of `T*b`). We round nothing: times are exact integers.

/// What the store answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Admitted now, with `granted` tokens.
    Admit {
        /// Tokens taken.
        granted: u32,
    },
    /// Tokens reserved; the call may go after `wait` ns.
    Wait {
        /// Tokens taken.
        granted: u32,
        /// How long to wait.
        wait: u64,
    },
    /// Not admitted; retry after `retry_after` ns (the hint).
    Reject {
        /// The hint.
        retry_after: u64,
    },
}

/// One GCRA decision: the new TAT (unchanged on a reject) and the answer.
pub fn take(tat: u64, now: u64, interval: u64, burst: u32, cost: u32, max_wait: u64, upto: bool) -> (u64, Answer) {
    let interval = interval.max(1);
    let t = tat.max(now);
    let full = interval.saturating_mul(u64::from(burst.max(1)));
    if upto && cost > 1 {
        let free = now.saturating_add(full).saturating_sub(t) / interval;
        let granted = free.min(u64::from(cost)) as u32;
        if granted >= 1 {
            return (t.saturating_add(interval.saturating_mul(u64::from(granted))), Answer::Admit { granted });
        }
        return take(tat, now, interval, burst, 1, max_wait, false);
    }
    let new = t.saturating_add(interval.saturating_mul(u64::from(cost)));
    let allow_at = new.saturating_sub(full);
    if allow_at <= now {
        (new, Answer::Admit { granted: cost })
    } else if allow_at - now <= max_wait {
        (new, Answer::Wait { granted: cost, wait: allow_at - now })
    } else {
        (tat, Answer::Reject { retry_after: allow_at - now })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::RateCfg;
    use crate::rng::Rng;

    #[test]
    fn cost_one_is_the_core_limiter() {
        let mut rng = Rng::new(7);
        for _ in 0..200 {
            let cfg =
                RateCfg { rate: 1 + (rng.next_u64() % 50) as u32, per: 1_000_000, burst: 1 + (rng.next_u64() % 8) as u32, max_wait: 0 };
            let mut g = cfg.fresh();
            let mut tat = 0u64;
            let mut now = 0u64;
            for _ in 0..100 {
                now += rng.next_u64() % 100_000;
                let core = g.try_take(&cfg, now);
                let (next, ans) = take(tat, now, cfg.interval(), cfg.burst, 1, 0, false);
                match (core, ans) {
                    (Ok(()), Answer::Admit { granted: 1 }) => tat = next,
                    (Err(d), Answer::Reject { retry_after }) => assert_eq!(d, retry_after),
                    other => panic!("diverged: {other:?}"),
                }
                assert_eq!(tat, g.tat.max(tat));
            }
        }
    }

    #[test]
    fn burst_wait_reject_and_leases() {
        // 10 per ms, burst 3: T = 100_000 ns.
        let t = 100_000;
        let mut tat = 0;
        for _ in 0..3 {
            let (next, a) = take(tat, 0, t, 3, 1, 0, false);
            assert_eq!(a, Answer::Admit { granted: 1 });
            tat = next;
        }
        assert_eq!(take(tat, 0, t, 3, 1, 0, false), (tat, Answer::Reject { retry_after: t }));
        assert_eq!(take(tat, 0, t, 3, 1, t, false), (tat + t, Answer::Wait { granted: 1, wait: t }));
        // A lease of up to 5 from a fresh bucket of 3 takes 3; from an empty one it answers as one.
        assert_eq!(take(0, 0, t, 3, 5, 0, true), (3 * t, Answer::Admit { granted: 3 }));
        assert_eq!(take(3 * t, 0, t, 3, 5, 0, true), (3 * t, Answer::Reject { retry_after: t }));
        // A cost above the burst is never admitted: the hint says how far over it is.
        assert_eq!(take(0, 0, t, 3, 4, 0, false), (0, Answer::Reject { retry_after: t }));
    }

    /// The cases the Lua script must reproduce: `fleet/tests/gcra-cases.json`
    /// (`LEVEE_BLESS=1` rewrites it).
    #[test]
    fn lua_cases_file_is_current() {
        let mut rng = Rng::new(18);
        let mut traces = Vec::new();
        for i in 0..24u64 {
            let interval = [1_000_000u64, 333_333_333, 7_919, 1_000_000_000][(i % 4) as usize];
            let burst = 1 + (rng.next_u64() % 10) as u32;
            let max_wait = [0, interval, 5 * interval][(i % 3) as usize];
            let mut tat = 0u64;
            let mut now = 1_000_000_000u64;
            let mut steps = Vec::new();
            for _ in 0..40 {
                now += rng.next_u64() % (interval * 2);
                let cost = 1 + (rng.next_u64() % 4) as u32;
                let upto = rng.next_u64() % 2 == 0;
                let (next, ans) = take(tat, now, interval, burst, cost, max_wait, upto);
                tat = next;
                let (kind, n, ns) = match ans {
                    Answer::Admit { granted } => (0, granted, 0),
                    Answer::Wait { granted, wait } => (1, granted, wait),
                    Answer::Reject { retry_after } => (2, 0, retry_after),
                };
                steps.push(format!(
                    "{{\"now\": {now}, \"cost\": {cost}, \"upto\": {upto}, \"kind\": {kind}, \"granted\": {n}, \"ns\": {ns}, \"tat\": {tat}}}"
                ));
            }
            traces.push(format!(
                "{{\"interval\": {interval}, \"burst\": {burst}, \"max_wait\": {max_wait}, \"steps\": [\n    {}\n  ]}}",
                steps.join(",\n    ")
            ));
        }
        let text = format!("[\n  {}\n]\n", traces.join(",\n  "));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fleet/tests/gcra-cases.json");
        if std::env::var_os("LEVEE_BLESS").is_some() {
            std::fs::write(path, &text).expect("write the cases");
        }
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == text, "fleet/tests/gcra-cases.json is stale: run with LEVEE_BLESS=1");
    }
}
