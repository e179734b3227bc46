//! Worst cases of a policy, for `levee check`.
//!
//! Everything is computed in closed form: the cost does not depend on `attempts` (which may
//! be up to `u32::MAX`), only on how long the backoff grows before it reaches its cap, and
//! that walk is bounded by [`EXACT_STEPS`].

use crate::budget::BudgetCfg;
use crate::classify::Rule;
use crate::policy::Policy;
use crate::retry::backoff::{exponential, Jitter, Kind};

/// Worst cases of a policy (see the WIT `analysis` record).
#[derive(Clone, Debug, PartialEq)]
pub struct Analysis {
    /// Attempts in the worst case: `attempts`, or fewer when even the shortest delays between
    /// attempts cannot fit them under the deadline.
    pub worst_attempts: u32,
    /// Worst-case latency in ns; `None` when nothing bounds it.
    pub worst_latency: Option<u64>,
    /// `worst_attempts ^ layers`: load on the deepest dependency when every attempt fails.
    pub amplification: f64,
    /// The same with the retry budget holding (long-run bound).
    pub amplification_with_budget: f64,
}

/// Retries whose delays are summed one by one before the still-growing part of a backoff is
/// bounded by its smallest (or largest) term. A backoff that reaches its cap within this many
/// retries (every exponential one with a multiplier of 1.03 or more, and any whose cap is at
/// most this many times its base) is analysed exactly.
pub const EXACT_STEPS: u32 = 1024;

/// Analyse a policy for `layers` layers of callers each running it.
///
/// **Attempts.** An attempt can fail at once (a refused connection, an immediate 503),
/// whatever its timeout, so the most attempts a call can make is `attempts`, or fewer only
/// when the *shortest* delays the policy can give between them already reach the deadline.
/// The shortest delay is 0 under full jitter, and 0 whenever a server may direct the delay
/// (`retry-after.honor` with a `retry-on` rule for HTTP or gRPC statuses: `Retry-After: 0`).
/// A retry counts only if it starts before the deadline, as the engine guarantees.
///
/// **Latency.** Those attempts each run to their timeout (or to the deadline), and every
/// delay is the longest the policy allows: the capped backoff at the top of its jitter range,
/// or `retry-after.cap` when a server may direct it. It is the deadline when there is one and
/// no attempt timeout, and unbounded (`None`) with neither.
///
/// **Amplification.** `worst_attempts ^ layers`. With a budget, the long-run bound per layer
/// under a total outage is: token throttling, 1 (retries stop once tokens fall to half, and
/// only successes refill them); ratio budget, `1 + percent / 100` (the `min-per-second`
/// reserve adds a fixed rate on top, not a factor).
pub fn analyze(p: &Policy, layers: u32) -> Analysis {
    if let Some(h) = &p.hedge {
        return analyze_hedged(p, h, layers);
    }
    let retries = p.attempts.saturating_sub(1);
    let shortest = Delays::new(p, Bound::Shortest);
    let longest = Delays::new(p, Bound::Longest);
    let worst_retries = match p.deadline {
        Some(d) => shortest.retries_before(d, retries),
        None => retries,
    };
    let attempts = worst_retries.saturating_add(1);
    let worst_latency = match (p.attempt_timeout, p.deadline) {
        (None, None) => None,
        (None, Some(d)) => Some(d),
        (Some(t), deadline) => {
            let busy = u64::try_from(u128::from(t) * u128::from(attempts)).unwrap_or(u64::MAX);
            let total = busy.saturating_add(longest.sum(worst_retries));
            Some(deadline.map_or(total, |d| total.min(d)))
        }
    };
    amplified(p, attempts, worst_latency, layers)
}

/// The analysis of `attempts` per call in the worst case, on `layers` layers, with and without
/// the policy's budget.
fn amplified(p: &Policy, attempts: u32, worst_latency: Option<u64>, layers: u32) -> Analysis {
    let exponent = layers.min(i32::MAX as u32) as i32;
    let per_layer = f64::from(attempts);
    let amplification = per_layer.powi(exponent);
    let with_budget = match &p.budget {
        // The AWS client rate slows retries down but never refuses one.
        None | Some(BudgetCfg::AwsAdaptive(_)) => amplification,
        Some(BudgetCfg::Token { .. }) => 1.0,
        Some(BudgetCfg::Ratio { percent, .. }) => (1.0 + percent / 100.0).min(per_layer).powi(exponent),
    };
    Analysis { worst_attempts: attempts, worst_latency, amplification, amplification_with_budget: with_budget }
}

/// A hedged policy: every one of `hedge.attempts` can start (a failure sends the next at
/// once, and `delay: 0` sends them together), whatever the deadline, so that is the worst
/// case and the amplification's base. The last attempt starts at most `(attempts - 1) *
/// delay` after the first and runs to its timeout, bounded by the deadline; under `envoy`
/// attempts have no timeout of their own, so only the deadline bounds the call. Budgets bound
/// hedges as they bound retries.
fn analyze_hedged(p: &Policy, h: &crate::hedge::HedgeCfg, layers: u32) -> Analysis {
    let attempts = h.attempts;
    let per_try = if h.preset == crate::hedge::Preset::Envoy { None } else { p.attempt_timeout };
    let worst_latency = match (per_try, p.deadline) {
        (None, None) => None,
        (None, Some(d)) => Some(d),
        (Some(t), deadline) => {
            let last_start = h.delay.saturating_mul(u64::from(attempts.saturating_sub(1)));
            let total = last_start.saturating_add(t);
            Some(deadline.map_or(total, |d| total.min(d)))
        }
    };
    amplified(p, attempts, worst_latency, layers)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Bound {
    Shortest,
    Longest,
}

/// The shortest or the longest delay before each retry: a nondecreasing function of the
/// retry number that is constant from the backoff's cap on.
struct Delays<'a> {
    p: &'a Policy,
    bound: Bound,
    /// A server may set the delay (from 0 to `retry-after.cap`).
    server: bool,
}

impl<'a> Delays<'a> {
    fn new(p: &'a Policy, bound: Bound) -> Self {
        let statuses = p.retry_on.0.iter().any(|r| matches!(r, Rule::Http(..) | Rule::Grpc { .. }));
        Delays { p, bound, server: p.retry_after.honor && statuses }
    }

    /// The delay before retry `n` (n >= 1).
    fn at(&self, n: u32) -> u64 {
        let b = &self.p.backoff;
        if self.bound == Bound::Shortest && self.server {
            return 0;
        }
        // The largest delay of the backoff before jitter; for `decorrelated`, the top of the
        // draw when every earlier draw was at the top of its range: min(cap, base * 3^n).
        let raw = match b.kind {
            Kind::Decorrelated => exponential(b.base, 3.0, n, b.cap),
            _ => b.raw(n, 0),
        };
        let backoff = match (self.bound, b.jitter) {
            (Bound::Shortest, Jitter::None) => raw,
            (Bound::Shortest, Jitter::Full) => 0,
            (Bound::Shortest, Jitter::Equal) => raw / 2,
            (Bound::Shortest, Jitter::Decorrelated) => b.base.min(b.cap),
            (Bound::Shortest, Jitter::Proportional) => raw.saturating_sub(spread(raw, b.jitter_ratio)).min(b.cap),
            (Bound::Longest, Jitter::Proportional) => raw.saturating_add(spread(raw, b.jitter_ratio)).min(b.cap),
            (Bound::Longest, _) => raw,
        };
        if self.server {
            backoff.max(self.p.retry_after.cap)
        } else {
            backoff
        }
    }

    /// The first retry number in `1..=last` from which the delay stays at its final value
    /// `at(last)` (the delay is nondecreasing, so this is a binary search).
    fn flat_from(&self, last: u32) -> u32 {
        let top = self.at(last);
        let (mut lo, mut hi) = (1u32, last);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.at(mid) >= top {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }

    /// The segments of retries `1..=last`: `(first, count, value)`, where `value` is the exact
    /// delay of every retry in the segment, or for the still-growing part beyond
    /// [`EXACT_STEPS`], a bound of it (the smallest term for `Shortest`, the largest for
    /// `Longest`), so that sums never understate the worst case.
    fn walk(&self, last: u32, mut visit: impl FnMut(u32, u64) -> bool) {
        if last == 0 {
            return;
        }
        let flat = self.flat_from(last);
        let exact_end = flat.min(EXACT_STEPS.saturating_add(1));
        for n in 1..exact_end {
            if !visit(1, self.at(n)) {
                return;
            }
        }
        if exact_end < flat {
            let bound = match self.bound {
                Bound::Shortest => self.at(exact_end),
                Bound::Longest => self.at(flat - 1),
            };
            if !visit(flat - exact_end, bound) {
                return;
            }
        }
        visit(last - flat + 1, self.at(last));
    }

    /// The total delay of retries `1..=retries`, saturating.
    fn sum(&self, retries: u32) -> u64 {
        let mut total = 0u64;
        self.walk(retries, |count, value| {
            total = total.saturating_add(u64::try_from(u128::from(count) * u128::from(value)).unwrap_or(u64::MAX));
            true
        });
        total
    }

    /// How many of retries `1..=retries` start before `deadline` when every attempt takes no
    /// time.
    fn retries_before(&self, deadline: u64, retries: u32) -> u32 {
        let (mut elapsed, mut fit) = (0u64, 0u32);
        self.walk(retries, |count, value| {
            // Retries of this segment that still start before the deadline.
            let room = deadline.saturating_sub(elapsed).saturating_sub(1);
            let n = room.checked_div(value).map_or(count, |k| u32::try_from(k).unwrap_or(u32::MAX).min(count));
            fit += n;
            elapsed = elapsed.saturating_add(u64::from(n).saturating_mul(value));
            n == count
        });
        fit
    }
}

/// The spread of proportional jitter around `d`, as the engine computes it.
fn spread(d: u64, ratio: f64) -> u64 {
    (d as f64 * ratio) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_document;
    use crate::time::{MILLISECOND, SECOND};

    fn analyse(body: &str, layers: u32) -> Analysis {
        let doc = format!("policies:\n  p: {body}\n");
        match parse_document(&doc) {
            Ok(p) => analyze(&p[0], layers),
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn an_attempt_can_fail_fast_without_a_timeout() {
        // Issue 14, item 5: 5 attempts under a 10 s deadline, no attempt timeout.
        let a = analyse("{ attempts: 5, deadline: 10s }", 3);
        assert_eq!(a.worst_attempts, 5);
        assert_eq!(a.amplification, 125.0);
        assert_eq!(a.worst_latency, Some(10 * SECOND));
        // The same with a timeout: the timeout changes the latency, not the attempts.
        let t = analyse("{ attempts: 5, deadline: 10s, attempt-timeout: 1s }", 3);
        assert_eq!((t.worst_attempts, t.amplification, t.worst_latency), (5, 125.0, Some(10 * SECOND)));
        // Long timeouts cannot cut the attempts either: each may fail at once.
        let long = analyse("{ attempts: 5, deadline: 10s, attempt-timeout: 8s }", 1);
        assert_eq!(long.worst_attempts, 5);
    }

    #[test]
    fn only_the_shortest_delays_limit_attempts() {
        let none = "backoff: { kind: constant, base: 1s, jitter: none }, retry-after: { honor: false }";
        let a = analyse(&format!("{{ attempts: 10, attempt-timeout: 1s, deadline: 2500ms, {none} }}"), 1);
        assert_eq!((a.worst_attempts, a.worst_latency), (3, Some(2500 * MILLISECOND)));
        // Exactly at the deadline is too late: retries at 1s and 2s, not at 3s.
        let b = analyse(&format!("{{ attempts: 10, deadline: 3s, {none} }}"), 1);
        assert_eq!(b.worst_attempts, 3);
        // Full jitter can draw 0, and a server may send `Retry-After: 0`.
        let full = analyse("{ attempts: 10, deadline: 2500ms, backoff: { kind: constant, base: 1s, jitter: full } }", 1);
        assert_eq!(full.worst_attempts, 10);
        let server = analyse("{ attempts: 10, deadline: 2500ms, backoff: { kind: constant, base: 1s, jitter: none } }", 1);
        assert_eq!(server.worst_attempts, 10);
        // Not when no rule retries a status.
        let conn = analyse(
            "{ attempts: 10, deadline: 2500ms, retry-on: [connection-error], backoff: { kind: constant, base: 1s, jitter: none } }",
            1,
        );
        assert_eq!(conn.worst_attempts, 3);
        // Equal jitter halves the shortest delay; decorrelated never goes below base.
        let equal = analyse(&format!("{{ attempts: 10, deadline: 2500ms, {} }}", none.replace("none }", "equal }")), 1);
        assert_eq!(equal.worst_attempts, 5);
        let dec = analyse(
            "{ attempts: 10, deadline: 2500ms, retry-after: { honor: false }, backoff: { kind: decorrelated, base: 1s, cap: 9s } }",
            1,
        );
        assert_eq!(dec.worst_attempts, 3);
    }

    #[test]
    fn longest_delays_make_the_latency() {
        let quiet = "retry-after: { honor: false }";
        let a = analyse(&format!("{{ attempts: 3, attempt-timeout: 1s, backoff: {{ base: 100ms, cap: 1s }}, {quiet} }}"), 1);
        assert_eq!(a.worst_latency, Some(3300 * MILLISECOND));
        // Proportional jitter can lengthen a delay by its ratio (then the cap).
        let p = analyse(
            &format!(
                "{{ attempts: 3, attempt-timeout: 1s, backoff: {{ kind: constant, base: 1s, cap: 2s, jitter: proportional }}, {quiet} }}"
            ),
            1,
        );
        assert_eq!(p.worst_latency, Some(5500 * MILLISECOND));
        // Decorrelated: base * 3^n, capped.
        let d =
            analyse(&format!("{{ attempts: 4, attempt-timeout: 1s, backoff: {{ kind: decorrelated, base: 1s, cap: 5s }}, {quiet} }}"), 1);
        assert_eq!(d.worst_latency, Some((4 + 3 + 5 + 5) * SECOND));
        // A server may ask for up to retry-after.cap before each retry.
        let s = analyse("{ attempts: 3, attempt-timeout: 1s, retry-after: { cap: 60s } }", 1);
        assert_eq!(s.worst_latency, Some(123 * SECOND));
    }

    #[test]
    fn closed_form_for_any_number_of_attempts() {
        // Issue 14, item 4: no loop per attempt.
        let started = std::time::Instant::now();
        for body in [
            "{ attempts: 4294967295 }",
            "{ attempts: 4294967295, attempt-timeout: 1s }",
            "{ attempts: 4294967295, deadline: 1h, retry-after: { honor: false }, backoff: { kind: linear, base: 1ns, cap: 1h, jitter: none } }",
            "{ attempts: 4294967295, attempt-timeout: 1s, backoff: { kind: linear, base: 1ns, cap: 1h, jitter: equal } }",
            "{ attempts: 4294967295, deadline: 1h, retry-after: { honor: false }, backoff: { base: 1ns, multiplier: 1.0000001, cap: 1h, jitter: none } }",
            "{ attempts: 4294967295, deadline: 1h, retry-after: { honor: false }, backoff: { kind: decorrelated, base: 1ns, cap: 1h } }",
            "{ attempts: 4294967295, deadline: 1h, retry-after: { honor: false }, backoff: { kind: constant, base: 1ns, jitter: proportional, jitter-ratio: 1 } }",
        ] {
            let a = analyse(body, 64);
            assert!(a.worst_attempts >= 1, "{body}");
        }
        assert!(started.elapsed() < std::time::Duration::from_millis(500), "{:?}", started.elapsed());
        let all = analyse("{ attempts: 4294967295 }", 1);
        assert_eq!((all.worst_attempts, all.worst_latency), (u32::MAX, None));
        let busy = analyse("{ attempts: 4294967295, attempt-timeout: 1h }", 1);
        assert_eq!(busy.worst_latency, Some(u64::MAX));
        // Linear from 1ns under a deadline of 1s, no jitter: the n-th retry starts at n(n+1)/2 ns.
        let lin = analyse(
            "{ attempts: 4294967295, deadline: 1s, retry-after: { honor: false }, backoff: { kind: linear, base: 1ns, cap: 1h, jitter: none } }",
            1,
        );
        // n(n+1)/2 < 1e9 for n = 44720, not for 44721; beyond the exact steps the bound may
        // only over-count.
        assert!(lin.worst_attempts > 44_720 && lin.worst_attempts < 1_000_000_000, "{}", lin.worst_attempts);
    }

    #[test]
    fn budgets_bound_amplification() {
        let t = analyse("{ attempts: 3, budget: { kind: token } }", 3);
        assert_eq!((t.amplification, t.amplification_with_budget), (27.0, 1.0));
        let r = analyse("{ attempts: 4, budget: { kind: ratio, percent: 10 } }", 3);
        assert_eq!(r.amplification, 64.0);
        assert!((r.amplification_with_budget - 1.331).abs() < 1e-9);
    }
}
